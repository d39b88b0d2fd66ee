// mHC, the manifold-constrained hyper-connections of DeepSeek-V4 (deepseek_v4_format.md §7,
// v4_forward_crosscheck.md §1a/§1b): the residual is hc streams per token; each sub-block
// collapses them with `pre`, and re-expands its output with `post` plus the doubly-stochastic
// `comb` mix of the old streams.
#ifndef QUANTD_SERVER_MODEL_V4_MHC_H_
#define QUANTD_SERVER_MODEL_V4_MHC_H_

#include <stdint.h>

#include <vector>

#include "absl/status/status.h"
#include "kernels/v4_row_math.h"
#include "server/model/v4_config.h"
#include "server/model/v4_linear.h"

namespace quantd::model {

// One mHC site's parameters: hc_{attn,ffn}_{fn,base,scale} (fn [(2+hc)*hc, hc*d], base
// [(2+hc)*hc], scale [3]) or the head's hc_head_{fn,base,scale} (fn [hc, hc*d], base [hc],
// scale [1]).
struct HyperConnectionWeights {
  std::vector<float> fn;
  std::vector<float> base;
  std::vector<float> scale;
};

// The per-token mixing coefficients of one sub-block.
struct HcMix {
  std::vector<float> pre;   // [tokens, hc]
  std::vector<float> post;  // [tokens, hc]
  std::vector<float> comb;  // [tokens, hc, hc]: comb[j][k] weighs input stream j into output k
};

// hc_split_sinkhorn for one token (kernels/v4_row_math.h, shared with the CUDA kernel).
using v4math::SplitSinkhorn;

// hc_pre: streams [tokens, hc, d] -> the sub-block input y [tokens, d] (model dtype) and the
// mix. mixes = (streams_flat · fn^T) * rsqrt(mean(streams_flat^2) + rms_norm_eps).
absl::Status HcPre(const ForwardContext& ctx, const V4Config& config,
                   const HyperConnectionWeights& w, const float* streams, int64_t tokens, float* y,
                   HcMix* mix);

// hc_post: out[t, k] = post[t, k] * f[t] + sum_j comb[t, j, k] * streams[t, j] (model dtype).
// `out` may not alias `streams`.
void HcPost(const ForwardContext& ctx, const V4Config& config, const HcMix& mix, const float* f,
            const float* streams, int64_t tokens, float* out);

// hc_head: y[t] = sum_j (sigmoid(mix_j * scale + base_j) + eps) * streams[t, j] (model dtype).
absl::Status HcHead(const ForwardContext& ctx, const V4Config& config,
                    const HyperConnectionWeights& w, const float* streams, int64_t tokens,
                    float* y);

// RMSNorm over rows of x [rows, n]: x * rsqrt(mean(x^2) + eps) * weight, in float32, output in
// the model dtype. `out` may alias `x`.
void RmsNorm(const ForwardContext& ctx, const float* x, int64_t rows, int64_t n,
             const std::vector<float>& weight, float eps, float* out);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_MHC_H_
