// Kernels of v4_mhc_blocks.h, each with the float operations of v4_mhc.cc in the same order.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_mhc_blocks.h"
#include "kernels/formats.h"
#include "kernels/v4_row_math.h"

namespace quantd::kernels::cuda {
namespace {

using formats::RoundToBf16;

// One thread per token: RsqrtMeanSquare of its streams, then its mixes scaled.
__global__ void HcScaleMixesKernel(const float* streams, int64_t tokens, int64_t width, float eps,
                                   float* mixes, int64_t mix_width) {
  for (int64_t t = FirstItem(); t < tokens; t += ItemStride()) {
    const float r = v4math::RsqrtMeanSquare(streams + t * width, width, eps);
    float* m = mixes + t * mix_width;
    for (int64_t i = 0; i < mix_width; ++i) m[i] *= r;
  }
}

// One item per (token, stream).
__global__ void HcHeadPreKernel(const float* mixes, const float* scale, const float* base,
                                int64_t tokens, int64_t hc, float eps, float* pre) {
  for (int64_t item = FirstItem(); item < tokens * hc; item += ItemStride()) {
    pre[item] = v4math::Sigmoid(mixes[item] * scale[0] + base[item % hc]) + eps;
  }
}

// One item per output element (token, column).
__global__ void HcCollapseKernel(const float* pre, const float* streams, int64_t tokens,
                                 int64_t hc, int64_t d, bool round_bf16, float* y) {
  for (int64_t item = FirstItem(); item < tokens * d; item += ItemStride()) {
    const int64_t t = item / d;
    const int64_t c = item % d;
    const float* st = streams + t * hc * d;
    float acc = 0.0f;
    for (int64_t j = 0; j < hc; ++j) acc += pre[t * hc + j] * st[j * d + c];
    y[item] = round_bf16 ? RoundToBf16(acc) : acc;
  }
}

// One item per stream element (token, stream, column).
__global__ void AddToStreamsKernel(const float* e, int64_t tokens, int64_t hc, int64_t d,
                                   float* x) {
  for (int64_t item = FirstItem(); item < tokens * hc * d; item += ItemStride()) {
    x[item] = e[item / (hc * d) * d + item % d] + x[item];
  }
}

}  // namespace

cudaError_t LaunchHcScaleMixes(const float* streams, int64_t tokens, int64_t width, float eps,
                               float* mixes, int64_t mix_width, const Launch& launch) {
  if (tokens <= 0 || width <= 0) return cudaSuccess;
  HcScaleMixesKernel<<<GridFor(tokens, launch), kThreads, 0, launch.stream>>>(
      streams, tokens, width, eps, mixes, mix_width);
  return cudaGetLastError();
}

cudaError_t LaunchHcHeadPre(const float* mixes, const float* scale, const float* base,
                            int64_t tokens, int64_t hc, float eps, float* pre,
                            const Launch& launch) {
  const int64_t items = tokens * hc;
  if (items <= 0) return cudaSuccess;
  HcHeadPreKernel<<<GridFor(items, launch), kThreads, 0, launch.stream>>>(mixes, scale, base,
                                                                           tokens, hc, eps, pre);
  return cudaGetLastError();
}

cudaError_t LaunchHcCollapse(const float* pre, const float* streams, int64_t tokens, int64_t hc,
                             int64_t d, bool round_bf16, float* y, const Launch& launch) {
  const int64_t items = tokens * d;
  if (items <= 0) return cudaSuccess;
  HcCollapseKernel<<<GridFor(items, launch), kThreads, 0, launch.stream>>>(pre, streams, tokens,
                                                                            hc, d, round_bf16, y);
  return cudaGetLastError();
}

cudaError_t LaunchAddToStreams(const float* e, int64_t tokens, int64_t hc, int64_t d, float* x,
                               const Launch& launch) {
  const int64_t items = tokens * hc * d;
  if (items <= 0) return cudaSuccess;
  AddToStreamsKernel<<<GridFor(items, launch), kThreads, 0, launch.stream>>>(e, tokens, hc, d, x);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
