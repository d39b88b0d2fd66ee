// The DeepSeek-V4 MoE sub-block (deepseek_v4_format.md §7, v4_forward_crosscheck.md §1b.8):
// sqrtsoftplus scores from the fp32 router, hash routing (tid2eid) in the first
// num_hash_layers layers and bias top-k elsewhere, weights renormalized and scaled by
// route_scale, routed experts with the clamped SwiGLU and the routing weight applied before w2,
// an fp32 sum over experts in ascending id order, plus the (clamped) shared expert.
#ifndef QUANTD_SERVER_MODEL_V4_MOE_H_
#define QUANTD_SERVER_MODEL_V4_MOE_H_

#include <stdint.h>

#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/v4_row_math.h"
#include "server/model/v4_config.h"
#include "server/model/v4_linear.h"
#include "server/model/v4_weights.h"

namespace quantd::model {

struct ExpertWeights {
  LinearWeight w1;  // gate [inter, d]
  LinearWeight w2;  // down [d, inter]
  LinearWeight w3;  // up [inter, d]
};

// A layer's routed experts kept in their stored form (FP8 / MXFP4 / NVFP4 bytes and scales in the
// mapped source): the MoE decodes each one with the backend (into host or device memory) right
// before its products and drops it after them, so a forward holds one decoded expert at a time
// instead of all of them (at DeepSeek-V4-Pro size 384 experts are 51.5 GB in BF16, one is
// 132 MB). The checkpoint and the backend must outlive it. Decode is thread-safe.
class RoutedExperts {
 public:
  RoutedExperts() = default;
  // The experts "<prefix>experts.E." for E < count, each [inter, d] / [d, inter].
  RoutedExperts(const V4Checkpoint* ckpt, kernels::Backend* backend, std::string prefix,
                int64_t count, int64_t inter);

  int64_t size() const { return count_; }
  const V4Checkpoint* checkpoint() const { return ckpt_; }
  const std::string& prefix() const { return prefix_; }  // "layers.3.ffn."
  int64_t inter() const { return inter_; }
  // Expert `e` decoded (LoadLinear of its w1, w2, w3) into `previous`'s buffers where they are
  // large enough (the expert the caller is done with), so that stepping through the experts
  // allocates once; errors name the tensor.
  absl::StatusOr<ExpertWeights> Decode(int64_t e, ExpertWeights previous = {}) const;

 private:
  const V4Checkpoint* ckpt_ = nullptr;
  kernels::Backend* backend_ = nullptr;
  std::string prefix_;  // "layers.3.ffn."
  int64_t count_ = 0;
  int64_t inter_ = 0;
};

struct MoeWeights {
  LinearWeight gate;             // router [experts, d], run in float32
  std::vector<float> bias;       // [experts]; empty in hash layers
  std::vector<int32_t> tid2eid;  // [vocab, topk]; hash layers only
  RoutedExperts experts;         // decoded one at a time by MoeForward
  ExpertWeights shared;
};

// Loads layer `layer`'s (or the MTP block's, prefix "mtp.0.") MoE weights under `prefix`
// ("layers.3."): the router and the shared expert decoded, the routed experts checked (present,
// of the config's shapes, in a format the forward reads) and left in the source for MoeForward.
// `alive` (may be empty) is called after each expert checked: the loading task's sign of life.
absl::StatusOr<MoeWeights> LoadMoe(const V4Checkpoint& ckpt, kernels::Backend& backend,
                                   const std::string& prefix, bool hash,
                                   const std::function<void()>& alive);

// Routing of every token: `topk` expert ids and weights (route_scale included).
struct Routing {
  std::vector<int32_t> experts;  // [tokens, topk]
  std::vector<float> weights;    // [tokens, topk]
};

// sqrtsoftplus(x) = sqrt(softplus(x)), softplus with torch's threshold (x > 20: x)
// (kernels/v4_row_math.h, shared with the CUDA router).
using v4math::SqrtSoftplus;

// Routes tokens given their router logits [tokens, experts] (fp32): hash layers take
// tid2eid[token_ids[t]], the others the top-k of score + bias (ties to the lower id). Tokens
// are split over `threads`; the result does not depend on it.
Routing Route(const V4Config& config, const MoeWeights& w, const float* logits, int64_t tokens,
              const int32_t* token_ids, const HostThreads& threads = {});

// SwiGLU with the clamp: silu(min(g, limit)) * clamp(u, -limit, limit); limit 0: no clamp
// (kernels/v4_row_math.h, shared with the CUDA kernel).
using v4math::ClampedSwiglu;

// The host ops' MoE steps between the GEMMs (public: the oracle their CUDA kernels are tested
// against). The rows routed to each expert, in token order, with their routing weights.
struct ExpertRows {
  std::vector<std::vector<int64_t>> tokens;  // [experts][rows routed to the expert]
  std::vector<std::vector<float>> weights;   // the same shape: the rows' routing weights
};
ExpertRows GroupByExpert(const Routing& routing, int64_t tokens, int64_t topk, int64_t experts);

// out[i, :] = x[rows[i], :] for i < n; rows of d values.
void GatherRows(const float* x, int64_t d, const int64_t* rows, int64_t n, float* out,
                const HostThreads& threads);

// x[r, c] = weights[r] * x[r, c] over x [rows, cols]: the routing weight on a routed expert's w2
// input (or, W4A4, its output).
void ScaleRows(const float* weights, int64_t rows, int64_t cols, float* x,
               const HostThreads& threads);

// sum[rows[i], :] += out[i, :] for i < n (rows distinct, d values each): one expert's output
// into the fp32 routed sum. MoeForward adds the experts in ascending id order.
void AddRows(const float* out, const int64_t* rows, int64_t n, int64_t d, float* sum,
             const HostThreads& threads);

// y[tokens, d] = MoE(x) for the ffn-normed input x [tokens, d] (model dtype) of the tokens
// `token_ids` (host; used by hash layers), over ctx's ops: x and y in their memory. Output in
// the model dtype.
absl::Status MoeBlock(const ForwardContext& ctx, const V4Config& config, const MoeWeights& w,
                      const float* x, int64_t tokens, const int32_t* token_ids, float* y);

// MoeBlock with x and y in host memory.
absl::Status MoeForward(const ForwardContext& ctx, const V4Config& config, const MoeWeights& w,
                        const float* x, int64_t tokens, const int32_t* token_ids, float* y);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_MOE_H_
