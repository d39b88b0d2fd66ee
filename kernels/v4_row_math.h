// The per-row math of the DeepSeek-V4 forward that the host ops (server/model) and the CUDA
// kernels (kernels/cuda/v4_*_blocks.cu) both run, written once, usable from host and device code
// as formats.h's codecs are. Each is the float operations of the official forward in the order
// the host oracle runs them: compiled by nvcc with -fmad=false and IEEE division and square root
// (the library's CUDA flags) the device gives the host's bits, except where expf/log1pf differ
// from the host library's by an ulp (noted per function; the CUDA tests bound it).
#ifndef QUANTD_KERNELS_V4_ROW_MATH_H_
#define QUANTD_KERNELS_V4_ROW_MATH_H_

#include <math.h>
#include <stdint.h>

#include "kernels/formats.h"

namespace quantd::v4math {

// 1 / (1 + exp(-x)) (expf).
QUANTD_HD float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// sqrtsoftplus(x) = sqrt(softplus(x)), softplus with torch's threshold (x > 20: x) (expf,
// log1pf).
QUANTD_HD float SqrtSoftplus(float x) { return sqrtf(x > 20.0f ? x : log1pf(expf(x))); }

// SwiGLU with the clamp: silu(min(g, limit)) * clamp(u, -limit, limit); limit 0: no clamp
// (std::min / std::clamp's comparisons: a NaN passes through) (expf).
QUANTD_HD float ClampedSwiglu(float g, float u, float limit) {
  if (limit > 0.0f) {
    g = limit < g ? limit : g;
    u = u < -limit ? -limit : (limit < u ? limit : u);
  }
  return g / (1.0f + expf(-g)) * u;
}

// 1 / sqrt(mean(x^2) + eps) over n values, the sum in double.
QUANTD_HD float RsqrtMeanSquare(const float* x, int64_t n, float eps) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(sum / static_cast<double>(n));
  return 1.0f / sqrtf(mean + eps);
}

// One rotated pair (a, b) = v[0..1] of an interleaved RoPE: (a c - b s, a s + b c); `s` is
// already negated for the inverse rotation.
QUANTD_HD void RotatePair(float c, float s, float* v) {
  const float a = v[0];
  const float b = v[1];
  v[0] = a * c - b * s;
  v[1] = a * s + b * c;
}

// The unweighted RMS normalisation of one head's q [dim] in place (official: every elementwise
// step rounded to BF16 as torch does on BF16 tensors, the mean accumulated in float32).
QUANTD_HD void NormalizeHead(bool official, float eps, float* v, int64_t dim) {
  float sum = 0.0f;
  for (int64_t i = 0; i < dim; ++i) {
    sum += official ? formats::RoundToBf16(v[i] * v[i]) : v[i] * v[i];
  }
  float mean = sum / static_cast<float>(dim);
  float scale;
  if (official) {
    mean = formats::RoundToBf16(mean);
    scale = formats::RoundToBf16(1.0f / sqrtf(formats::RoundToBf16(mean + eps)));
  } else {
    scale = 1.0f / sqrtf(mean + eps);
  }
  for (int64_t i = 0; i < dim; ++i) {
    v[i] = official ? formats::RoundToBf16(v[i] * scale) : v[i] * scale;
  }
}

// hc_split_sinkhorn for one token: mixes [(2+hc)*hc] (already times rsqrt) -> pre [hc],
// post [hc], comb [hc*hc] (expf):
//   pre = sigmoid(mix[0:hc] * scale[0] + base[0:hc]) + eps
//   post = 2 * sigmoid(mix[hc:2hc] * scale[1] + base[hc:2hc])
//   comb = softmax_k(mix[2hc + hc*j + k] * scale[2] + base[...]) + eps
//   comb /= colsum + eps; (iters - 1) times { comb /= rowsum + eps; comb /= colsum + eps }
QUANTD_HD void SplitSinkhorn(const float* mixes, const float* scale, const float* base,
                             int64_t hc, int64_t iters, float eps, float* pre, float* post,
                             float* comb) {
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
      row[k] = expf(row[k] - max);
      sum += row[k];
    }
    for (int64_t k = 0; k < hc; ++k) row[k] = row[k] / sum + eps;
  }
  for (int64_t i = 0; i < (iters > 1 ? iters : 1); ++i) {
    if (i > 0) {  // rows, then columns again
      for (int64_t j = 0; j < hc; ++j) {
        float sum = 0.0f;
        for (int64_t k = 0; k < hc; ++k) sum += comb[j * hc + k];
        for (int64_t k = 0; k < hc; ++k) comb[j * hc + k] /= sum + eps;
      }
    }
    for (int64_t k = 0; k < hc; ++k) {
      float sum = 0.0f;
      for (int64_t j = 0; j < hc; ++j) sum += comb[j * hc + k];
      for (int64_t j = 0; j < hc; ++j) comb[j * hc + k] /= sum + eps;
    }
  }
}

// Channel c of window w's compressed entry, over one sequence's kv and score rows
// [seq_len, coff*width] and ape [ratio, coff*width] (coff = 2 when ratio == 4): the softmax over
// the window's slots of (score + ape) weighting kv, in slot order (expf). Slots: with ratio 4 and
// w > 0, first the previous window's `ratio` tokens in channel c (the overlap), then the window's
// own tokens in channel width + c (ratio 4) or c.
QUANTD_HD float PoolWindowChannel(const float* kv, const float* score, const float* ape,
                                  int64_t ratio, int64_t width, int64_t w, int64_t c) {
  const bool overlap = ratio == 4;
  const int64_t stride = overlap ? 2 * width : width;
  const int64_t previous = overlap && w > 0 ? ratio : 0;  // slots of the previous window
  const int64_t slots = previous + ratio;
  const int64_t current = overlap ? width + c : c;
  // Slot s's element of the kv / score rows and of ape.
  const auto at = [&](int64_t s) {
    return s < previous ? ((w - 1) * ratio + s) * stride + c
                        : (w * ratio + s - previous) * stride + current;
  };
  const auto ape_at = [&](int64_t s) {
    return s < previous ? s * stride + c : (s - previous) * stride + current;
  };
  float max = -INFINITY;
  for (int64_t s = 0; s < slots; ++s) {
    const float v = score[at(s)] + ape[ape_at(s)];
    max = v > max ? v : max;
  }
  float sum = 0.0f;
  for (int64_t s = 0; s < slots; ++s) sum += expf(score[at(s)] + ape[ape_at(s)] - max);
  float acc = 0.0f;
  for (int64_t s = 0; s < slots; ++s) {
    acc += kv[at(s)] * (expf(score[at(s)] + ape[ape_at(s)] - max) / sum);
  }
  return acc;
}

}  // namespace quantd::v4math

#endif  // QUANTD_KERNELS_V4_ROW_MATH_H_
