// The kernel of v4_head_norm_blocks.h: NormalizeHeadRows (v4_attention.cc) for one row per thread.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_head_norm_blocks.h"
#include "kernels/formats.h"

namespace quantd::kernels::cuda {
namespace {

using formats::RoundToBf16;

__global__ void NormalizeHeadsKernel(bool official, float eps, float* q, int64_t rows,
                                     int64_t dim) {
  for (int64_t r = FirstItem(); r < rows; r += ItemStride()) {
    float* v = q + r * dim;
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += official ? RoundToBf16(v[i] * v[i]) : v[i] * v[i];
    float mean = sum / static_cast<float>(dim);
    float scale;
    if (official) {
      mean = RoundToBf16(mean);
      scale = RoundToBf16(1.0f / sqrtf(RoundToBf16(mean + eps)));
    } else {
      scale = 1.0f / sqrtf(mean + eps);
    }
    for (int64_t i = 0; i < dim; ++i) v[i] = official ? RoundToBf16(v[i] * scale) : v[i] * scale;
  }
}

}  // namespace

cudaError_t LaunchNormalizeHeads(bool official, float eps, float* q, int64_t rows, int64_t dim,
                                 const Launch& launch) {
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  NormalizeHeadsKernel<<<GridFor(rows, launch), kThreads, 0, launch.stream>>>(official, eps, q,
                                                                              rows, dim);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
