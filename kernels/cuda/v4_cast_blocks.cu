// Kernels of v4_cast_blocks.h: one grid-stride loop each over formats.h's conversions.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_cast_blocks.h"
#include "kernels/formats.h"

namespace quantd::kernels::cuda {
namespace {

__global__ void RoundToBf16Kernel(float* x, int64_t n) {
  for (int64_t i = FirstItem(); i < n; i += ItemStride()) x[i] = formats::RoundToBf16(x[i]);
}

__global__ void NarrowToBf16Kernel(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = FirstItem(); i < n; i += ItemStride()) out[i] = formats::FloatToBf16(x[i]);
}

__global__ void WidenBf16Kernel(const uint16_t* x, int64_t n, float* out) {
  for (int64_t i = FirstItem(); i < n; i += ItemStride()) out[i] = formats::Bf16ToFloat(x[i]);
}

}  // namespace

cudaError_t LaunchRoundToBf16(float* x, int64_t n, const Launch& launch) {
  if (n <= 0) return cudaSuccess;
  RoundToBf16Kernel<<<GridFor(n, launch), kThreads, 0, launch.stream>>>(x, n);
  return cudaGetLastError();
}

cudaError_t LaunchNarrowToBf16(const float* x, int64_t n, uint16_t* out, const Launch& launch) {
  if (n <= 0) return cudaSuccess;
  NarrowToBf16Kernel<<<GridFor(n, launch), kThreads, 0, launch.stream>>>(x, n, out);
  return cudaGetLastError();
}

cudaError_t LaunchWidenBf16(const uint16_t* x, int64_t n, float* out, const Launch& launch) {
  if (n <= 0) return cudaSuccess;
  WidenBf16Kernel<<<GridFor(n, launch), kThreads, 0, launch.stream>>>(x, n, out);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
