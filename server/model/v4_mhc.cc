#include "server/model/v4_mhc.h"

#include <cmath>

#include "server/base/status_macros.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// 1 / sqrt(mean(x^2) + eps) over n values, the sum in double.
float RsqrtMeanSquare(const float* x, int64_t n, float eps) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(sum / static_cast<double>(n));
  return 1.0f / std::sqrt(mean + eps);
}

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

void SplitSinkhorn(const float* mixes, const float* scale, const float* base, int64_t hc,
                   int64_t iters, float eps, float* pre, float* post, float* comb) {
  for (int64_t j = 0; j < hc; ++j) {
    pre[j] = Sigmoid(mixes[j] * scale[0] + base[j]) + eps;
    post[j] = 2.0f * Sigmoid(mixes[hc + j] * scale[1] + base[hc + j]);
  }
  for (int64_t j = 0; j < hc; ++j) {
    float* row = comb + j * hc;
    float max = -INFINITY;
    for (int64_t k = 0; k < hc; ++k) {
      row[k] = mixes[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k];
      max = row[k] > max ? row[k] : max;
    }
    float sum = 0.0f;
    for (int64_t k = 0; k < hc; ++k) {
      row[k] = std::exp(row[k] - max);
      sum += row[k];
    }
    for (int64_t k = 0; k < hc; ++k) row[k] = row[k] / sum + eps;
  }
  auto normalize_columns = [&] {
    for (int64_t k = 0; k < hc; ++k) {
      float sum = 0.0f;
      for (int64_t j = 0; j < hc; ++j) sum += comb[j * hc + k];
      for (int64_t j = 0; j < hc; ++j) comb[j * hc + k] /= sum + eps;
    }
  };
  auto normalize_rows = [&] {
    for (int64_t j = 0; j < hc; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < hc; ++k) sum += comb[j * hc + k];
      for (int64_t k = 0; k < hc; ++k) comb[j * hc + k] /= sum + eps;
    }
  };
  normalize_columns();
  for (int64_t i = 1; i < iters; ++i) {
    normalize_rows();
    normalize_columns();
  }
}

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
