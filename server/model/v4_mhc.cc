#include "server/model/v4_mhc.h"

#include "kernels/v4_row_math.h"
#include "server/base/status_macros.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

using v4math::RsqrtMeanSquare;
using v4math::Sigmoid;

// x · fn^T for every token, times its rsqrt: mixes [tokens, rows of fn].
absl::Status Mixes(const ForwardContext& ctx, const V4Config& config, const std::vector<float>& fn,
                   int64_t mix_width, const float* streams, int64_t tokens,
                   std::vector<float>* mixes) {
  const int64_t width = config.hc_mult * config.hidden_size;
  mixes->assign(static_cast<size_t>(tokens * mix_width), 0.0f);
  const kernels::DenseTensor x{streams, kernels::FloatType::kF32, tokens, width};
  const kernels::DenseTensor w{fn.data(), kernels::FloatType::kF32, mix_width, width};
  RETURN_IF_ERROR(ctx.gemm->MatMulNT(x, w, mixes->data(), false));
  float* m = mixes->data();
  ParallelRows(ctx.threads, tokens, 2 * width, [&](int, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float r = RsqrtMeanSquare(streams + t * width, width, config.rms_norm_eps);
      for (int64_t i = 0; i < mix_width; ++i) m[t * mix_width + i] *= r;
    }
  });
  return absl::OkStatus();
}

// y[t] = sum_j pre[t, j] * streams[t, j], in float32, then the model dtype.
void Collapse(const ForwardContext& ctx, const V4Config& config, const float* pre,
              const float* streams, int64_t tokens, float* y) {
  const int64_t hc = config.hc_mult, d = config.hidden_size;
  ParallelRows(ctx.threads, tokens, 2 * hc * d, [&](int, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* yt = y + t * d;
      const float* st = streams + t * hc * d;
      for (int64_t c = 0; c < d; ++c) {
        float acc = 0.0f;
        for (int64_t j = 0; j < hc; ++j) acc += pre[t * hc + j] * st[j * d + c];
        yt[c] = acc;
      }
    }
  });
  ToModelDtype(ctx, y, tokens * d);
}

}  // namespace

absl::Status HcPre(const ForwardContext& ctx, const V4Config& config,
                   const HyperConnectionWeights& w, const float* streams, int64_t tokens, float* y,
                   HcMix* mix) {
  const int64_t hc = config.hc_mult;
  const int64_t mix_width = (2 + hc) * hc;
  std::vector<float> mixes;
  RETURN_IF_ERROR(Mixes(ctx, config, w.fn, mix_width, streams, tokens, &mixes));
  mix->pre.resize(static_cast<size_t>(tokens * hc));
  mix->post.resize(static_cast<size_t>(tokens * hc));
  mix->comb.resize(static_cast<size_t>(tokens * hc * hc));
  ParallelRows(ctx.threads, tokens, 4 * hc * hc * config.hc_sinkhorn_iters,
               [&](int, int64_t begin, int64_t end) {
                 for (int64_t t = begin; t < end; ++t) {
                   SplitSinkhorn(mixes.data() + t * mix_width, w.scale.data(), w.base.data(), hc,
                                 config.hc_sinkhorn_iters, config.hc_eps, mix->pre.data() + t * hc,
                                 mix->post.data() + t * hc, mix->comb.data() + t * hc * hc);
                 }
               });
  Collapse(ctx, config, mix->pre.data(), streams, tokens, y);
  return absl::OkStatus();
}

void HcPost(const ForwardContext& ctx, const V4Config& config, const HcMix& mix, const float* f,
            const float* streams, int64_t tokens, float* out) {
  const int64_t hc = config.hc_mult, d = config.hidden_size;
  ParallelRows(ctx.threads, tokens, 2 * hc * hc * d, [&](int, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* post = mix.post.data() + t * hc;
      const float* comb = mix.comb.data() + t * hc * hc;
      const float* ft = f + t * d;
      const float* st = streams + t * hc * d;
      float* ot = out + t * hc * d;
      for (int64_t k = 0; k < hc; ++k) {
        for (int64_t c = 0; c < d; ++c) {
          float acc = 0.0f;
          for (int64_t j = 0; j < hc; ++j) acc += comb[j * hc + k] * st[j * d + c];
          ot[k * d + c] = post[k] * ft[c] + acc;
        }
      }
    }
  });
  ToModelDtype(ctx, out, tokens * hc * d);
}

absl::Status HcHead(const ForwardContext& ctx, const V4Config& config,
                    const HyperConnectionWeights& w, const float* streams, int64_t tokens,
                    float* y) {
  const int64_t hc = config.hc_mult;
  std::vector<float> mixes;
  RETURN_IF_ERROR(Mixes(ctx, config, w.fn, hc, streams, tokens, &mixes));
  std::vector<float> pre(static_cast<size_t>(tokens * hc));
  ParallelRows(ctx.threads, tokens, 20 * hc, [&](int, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < hc; ++j) {
        pre[t * hc + j] = Sigmoid(mixes[t * hc + j] * w.scale[0] + w.base[j]) + config.hc_eps;
      }
    }
  });
  Collapse(ctx, config, pre.data(), streams, tokens, y);
  return absl::OkStatus();
}

void RmsNorm(const ForwardContext& ctx, const float* x, int64_t rows, int64_t n,
             const std::vector<float>& weight, float eps, float* out) {
  ParallelRows(ctx.threads, rows, 4 * n, [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * n;
      float* orow = out + r * n;
      const float s = RsqrtMeanSquare(xr, n, eps);
      for (int64_t c = 0; c < n; ++c) orow[c] = weight[c] * (xr[c] * s);
    }
  });
  ToModelDtype(ctx, out, rows * n);
}

}  // namespace quantd::model
