// The kernel of v4_head_norm_blocks.h: the shared NormalizeHead (kernels/v4_row_math.h) for one
// row per thread.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_head_norm_blocks.h"
#include "kernels/v4_row_math.h"

namespace quantd::kernels::cuda {
namespace {

__global__ void NormalizeHeadsKernel(bool official, float eps, float* q, int64_t rows,
                                     int64_t dim) {
  for (int64_t r = FirstItem(); r < rows; r += ItemStride()) {
    v4math::NormalizeHead(official, eps, q + r * dim, dim);
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
