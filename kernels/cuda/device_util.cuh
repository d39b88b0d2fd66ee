// Building blocks shared by the CUDA kernels: grid sizing, vectorized global loads and stores,
// dense BF16/F32 element access through formats.h (so values are the reference's bit for bit),
// and the reductions that hand scalars back to the host through DeviceResults.
#ifndef QUANTD_KERNELS_CUDA_DEVICE_UTIL_CUH_
#define QUANTD_KERNELS_CUDA_DEVICE_UTIL_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"
#include "kernels/formats.h"
#include "kernels/tensor_views.h"

namespace quantd::kernels::cuda {

// Threads per block of every kernel (a multiple of the warp size: reductions use whole warps).
inline constexpr int kThreads = 256;

// Blocks for a grid-stride kernel over `items` work items: enough to give each thread one item,
// at most launch.max_blocks.
inline int GridFor(int64_t items, const Launch& launch) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  if (blocks < 1) return 1;
  return blocks < launch.max_blocks ? static_cast<int>(blocks) : launch.max_blocks;
}

// Whether p may be read or written with 16-byte vector accesses.
inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Sets first_bad to kNoBad and everything else to 0, in stream order.
inline cudaError_t ResetResults(DeviceResults* results, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(results, 0, sizeof(*results), stream);
  if (e != cudaSuccess) return e;
  return cudaMemsetAsync(&results->first_bad, 0xFF, sizeof(results->first_bad), stream);
}

// This thread's first work item and the distance to its next one in a grid-stride loop.
__device__ __forceinline__ int64_t FirstItem() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t ItemStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// kWords consecutive 32-bit words at p, little-endian as the host lays bytes out. `aligned`
// promises p is aligned to the access width (16 bytes; 8 for two words): then they are read with
// vector loads, otherwise byte by byte.
template <int kWords>
__device__ __forceinline__ void LoadWords(const void* p, bool aligned, uint32_t (&w)[kWords]) {
  static_assert(kWords == 2 || kWords % 4 == 0, "8-byte or whole 16-byte accesses only");
  if (aligned) {
    if constexpr (kWords == 2) {
      const uint2 v = *static_cast<const uint2*>(p);
      w[0] = v.x;
      w[1] = v.y;
    } else {
#pragma unroll
      for (int k = 0; k < kWords / 4; ++k) {
        const uint4 v = static_cast<const uint4*>(p)[k];
        w[4 * k] = v.x;
        w[4 * k + 1] = v.y;
        w[4 * k + 2] = v.z;
        w[4 * k + 3] = v.w;
      }
    }
    return;
  }
  const uint8_t* b = static_cast<const uint8_t*>(p);
#pragma unroll
  for (int k = 0; k < kWords; ++k) {
    w[k] = static_cast<uint32_t>(b[4 * k]) | (static_cast<uint32_t>(b[4 * k + 1]) << 8) |
           (static_cast<uint32_t>(b[4 * k + 2]) << 16) | (static_cast<uint32_t>(b[4 * k + 3]) << 24);
  }
}

// The 16 bytes of chunk [i0, i0 + 16) of a byte array of `total` bytes as four little-endian
// words; a partial last chunk is zero-padded. Full chunks use LoadWords (vectorized when aligned).
__device__ __forceinline__ void LoadByteChunk16(const uint8_t* data, int64_t i0, int64_t total,
                                                bool aligned, uint32_t (&w)[4]) {
  const int64_t n = total - i0 < 16 ? total - i0 : 16;
  if (n == 16) {
    LoadWords(data + i0, aligned, w);
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (j < n) w[j / 4] |= static_cast<uint32_t>(data[i0 + j]) << (8 * (j % 4));
  }
}

// The store counterpart of LoadWords.
template <int kWords>
__device__ __forceinline__ void StoreWords(void* p, bool aligned, const uint32_t (&w)[kWords]) {
  static_assert(kWords == 2 || kWords % 4 == 0, "8-byte or whole 16-byte accesses only");
  if (aligned) {
    if constexpr (kWords == 2) {
      *static_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
      for (int k = 0; k < kWords / 4; ++k) {
        static_cast<uint4*>(p)[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
      }
    }
    return;
  }
  uint8_t* b = static_cast<uint8_t*>(p);
#pragma unroll
  for (int k = 0; k < kWords; ++k) {
#pragma unroll
    for (int j = 0; j < 4; ++j) b[4 * k + j] = static_cast<uint8_t>(w[k] >> (8 * j));
  }
}

// Nibble j (0..15) of 8 packed bytes held as two little-endian words: element j of a 16-block,
// the even element in the low nibble.
__device__ __forceinline__ uint8_t Nibble(const uint32_t (&w)[2], int j) {
  return static_cast<uint8_t>((w[j / 8] >> (4 * (j % 8))) & 0xFu);
}

// Element i of a dense BF16/F32 tensor as float (reference::LoadDense).
__device__ __forceinline__ float LoadDense(const void* data, FloatType type, int64_t i) {
  if (type == FloatType::kF32) return static_cast<const float*>(data)[i];
  return formats::Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
}

// Writes element i of a dense output, rounding to BF16 with RNE (reference::StoreDense).
__device__ __forceinline__ void StoreDense(void* data, FloatType type, int64_t i, float v) {
  if (type == FloatType::kF32) {
    static_cast<float*>(data)[i] = v;
  } else {
    static_cast<uint16_t*>(data)[i] = formats::FloatToBf16(v);
  }
}

// Elements [i, i + 16) of a dense tensor, i a multiple of 16: with a 16-byte aligned base, every
// access is aligned (32 or 64 bytes per chunk).
__device__ __forceinline__ void LoadDense16(const void* data, FloatType type, int64_t i,
                                            bool aligned, float (&v)[16]) {
  if (type == FloatType::kF32) {
    uint32_t w[16];
    LoadWords(static_cast<const float*>(data) + i, aligned, w);
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = formats::BitsToFloat(w[k]);
  } else {
    uint32_t w[8];
    LoadWords(static_cast<const uint16_t*>(data) + i, aligned, w);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[2 * k] = formats::Bf16ToFloat(static_cast<uint16_t>(w[k] & 0xFFFFu));
      v[2 * k + 1] = formats::Bf16ToFloat(static_cast<uint16_t>(w[k] >> 16));
    }
  }
}

// The store counterpart of LoadDense16.
__device__ __forceinline__ void StoreDense16(void* data, FloatType type, int64_t i, bool aligned,
                                             const float (&v)[16]) {
  if (type == FloatType::kF32) {
    uint32_t w[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) w[k] = formats::FloatBits(v[k]);
    StoreWords(static_cast<float*>(data) + i, aligned, w);
  } else {
    uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      w[k] = static_cast<uint32_t>(formats::FloatToBf16(v[2 * k])) |
             (static_cast<uint32_t>(formats::FloatToBf16(v[2 * k + 1])) << 16);
    }
    StoreWords(static_cast<uint16_t*>(data) + i, aligned, w);
  }
}

// Hands a thread's smallest bad index (kNoBad: none) to the host.
__device__ __forceinline__ void ReportBad(DeviceResults* results, unsigned long long bad) {
  if (bad != kNoBad) atomicMin(&results->first_bad, bad);
}

// Folds every thread's `v` into *target with max, one atomic per warp. All threads of the block
// must call it (no thread may have returned early).
__device__ __forceinline__ void WarpMaxInto(unsigned int* target, unsigned int v) {
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  if ((threadIdx.x & 31) == 0 && v != 0) atomicMax(target, v);
}

// Folds every thread's `v` into *target with +, one atomic per warp; called like WarpMaxInto.
__device__ __forceinline__ void WarpSumInto(unsigned long long* target, unsigned long long v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  if ((threadIdx.x & 31) == 0 && v != 0) atomicAdd(target, v);
}

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_DEVICE_UTIL_CUH_
