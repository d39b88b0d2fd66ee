// Kernel of v4_compressor_blocks.h: the window pooling of kernels/v4_row_math.h (the host's
// PoolCompressorWindows runs the same function) per output element.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_compressor_blocks.h"
#include "kernels/v4_row_math.h"

namespace quantd::kernels::cuda {
namespace {

// One item per (sequence, window, channel): the shared PoolWindowChannel.
__global__ void PoolCompressorWindowsKernel(const float* kv, const float* score, const float* ape,
                                            int64_t sequences, int64_t seq_len, int64_t ratio,
                                            int64_t width, float* out) {
  const int64_t stride = ratio == 4 ? 2 * width : width;
  const int64_t windows = seq_len / ratio;
  for (int64_t item = FirstItem(); item < sequences * windows * width; item += ItemStride()) {
    const int64_t c = item % width;
    const int64_t w = (item / width) % windows;
    const int64_t b = item / (width * windows);
    out[item] = v4math::PoolWindowChannel(kv + b * seq_len * stride, score + b * seq_len * stride,
                                          ape, ratio, width, w, c);
  }
}

}  // namespace

cudaError_t LaunchPoolCompressorWindows(const float* kv, const float* score, const float* ape,
                                        int64_t sequences, int64_t seq_len, int64_t ratio,
                                        int64_t width, float* out, const Launch& launch) {
  if (ratio <= 0) return cudaErrorInvalidValue;
  const int64_t items = sequences * (seq_len / ratio) * width;
  if (items <= 0) return cudaSuccess;
  PoolCompressorWindowsKernel<<<GridFor(items, launch), kThreads, 0, launch.stream>>>(
      kv, score, ape, sequences, seq_len, ratio, width, out);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
