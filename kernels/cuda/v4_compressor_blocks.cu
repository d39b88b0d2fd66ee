// Kernel of v4_compressor_blocks.h: PoolWindows (v4_compressor.cc) per output element, its float
// operations in the same order.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_compressor_blocks.h"

namespace quantd::kernels::cuda {
namespace {

// Slot s of a window, as PoolWindows fills slot_kv / slot_score: with the overlap and a previous
// window, slots [0, ratio) are that window's tokens in its first `width` channels, then slots of
// the window's own tokens (in the second `width` channels with the overlap).
struct WindowSlots {
  const float* kv;     // the sequence's kv rows
  const float* score;  // the sequence's score rows
  const float* ape;    // [ratio, stride]
  int64_t stride;      // coff * width
  int64_t ratio;
  int64_t window;
  int64_t previous;  // slots taken from the previous window: ratio, or 0
  int64_t channel;   // c in the previous window's slots
  int64_t current;   // the channel of the window's own slots: width + c with the overlap, else c

  __device__ int64_t count() const { return previous + ratio; }
  // Slot s's token within its window and channel.
  __device__ int64_t Token(int64_t s) const { return s < previous ? s : s - previous; }
  __device__ int64_t Channel(int64_t s) const { return s < previous ? channel : current; }
  // Slot s's element of the kv and score rows.
  __device__ int64_t At(int64_t s) const {
    const int64_t row = (s < previous ? window - 1 : window) * ratio + Token(s);
    return row * stride + Channel(s);
  }
  __device__ float Score(int64_t s) const {
    return score[At(s)] + ape[Token(s) * stride + Channel(s)];
  }
  __device__ float Kv(int64_t s) const { return kv[At(s)]; }
};

// One item per (sequence, window, channel).
__global__ void PoolCompressorWindowsKernel(const float* kv, const float* score, const float* ape,
                                            int64_t sequences, int64_t seq_len, int64_t ratio,
                                            int64_t width, float* out) {
  const bool overlap = ratio == 4;
  const int64_t stride = overlap ? 2 * width : width;
  const int64_t windows = seq_len / ratio;
  for (int64_t item = FirstItem(); item < sequences * windows * width; item += ItemStride()) {
    const int64_t c = item % width;
    const int64_t w = (item / width) % windows;
    const int64_t b = item / (width * windows);
    const WindowSlots slots{kv + b * seq_len * stride,
                            score + b * seq_len * stride,
                            ape,
                            stride,
                            ratio,
                            w,
                            overlap && w > 0 ? ratio : 0,
                            c,
                            overlap ? width + c : c};
    const int64_t n = slots.count();
    float max = -INFINITY;
    for (int64_t s = 0; s < n; ++s) {
      const float v = slots.Score(s);
      max = v > max ? v : max;
    }
    float sum = 0.0f;
    for (int64_t s = 0; s < n; ++s) sum += expf(slots.Score(s) - max);
    float acc = 0.0f;
    for (int64_t s = 0; s < n; ++s) acc += slots.Kv(s) * (expf(slots.Score(s) - max) / sum);
    out[item] = acc;
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
