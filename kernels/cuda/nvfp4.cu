// NVFP4 encoding kernels: quantization of a dense tensor (ModelOpt >= 0.45) and the lossless
// MXFP4 -> NVFP4 cast. One thread per 16-block, which is the unit every NVFP4 decision is made
// on; scales and codes come from formats.h exactly as in kernels/reference.cc.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/formats.h"

namespace quantd::kernels::cuda {
namespace {

using namespace quantd::formats;  // NOLINT: kernels spell out formats.h like the reference

// Block scale byte and packed codes of one 16-block of values (reference::Nvfp4QuantizeRows).
__device__ __forceinline__ uint8_t EncodeBlock(const float (&v)[16], float scale_2,
                                               uint32_t (&packed)[2]) {
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float a = AbsF(v[j]);
    m = a > m ? a : m;
  }
  const uint8_t s = Nvfp4BlockScale(m, scale_2);
  packed[0] = 0;
  packed[1] = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    packed[j / 8] |= static_cast<uint32_t>(Nvfp4Encode(v[j], s, scale_2)) << (4 * (j % 8));
  }
  return s;
}

__global__ void Nvfp4QuantizeKernel(DenseTensor src, float scale_2, uint8_t* data,
                                    uint8_t* scales, bool aligned, DeviceResults* results) {
  const int64_t blocks = src.rows * src.cols / kNvfp4BlockSize;
  unsigned long long bad = kNoBad;
  for (int64_t t = FirstItem(); t < blocks; t += ItemStride()) {
    float v[16];
    LoadDense16(src.data, src.type, t * kNvfp4BlockSize, aligned, v);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (!IsFinite(v[j])) bad = min(bad, static_cast<unsigned long long>(t * kNvfp4BlockSize + j));
    }
    uint32_t packed[2];
    scales[t] = EncodeBlock(v, scale_2, packed);
    StoreWords(data + t * (kNvfp4BlockSize / 2), aligned, packed);
  }
  ReportBad(results, bad);
}

// 16-block t lies in MXFP4 block t / 2 (cols % 32 == 0). Its NVFP4 scale 2^(k - kmax + 8) is
// exact in E4M3 when the exponent is >= -9: then the nibbles are copied; otherwise the block's
// exact values are requantized against scale_2 (reference::Mxfp4ToNvfp4Rows).
__global__ void Mxfp4ToNvfp4Kernel(Mxfp4Tensor src, int kmax, float scale_2, uint8_t* data,
                                   uint8_t* scales, bool aligned, DeviceResults* results) {
  const int64_t blocks = src.rows * src.cols / kNvfp4BlockSize;
  unsigned long long requantized = 0;
  for (int64_t t = FirstItem(); t < blocks; t += ItemStride()) {
    const int k = static_cast<int>(src.scales[t / 2]) - 127;
    const int e = k - kmax + 8;  // <= 8 because k <= kmax
    uint32_t packed[2];
    LoadWords(src.data + t * (kNvfp4BlockSize / 2), aligned, packed);
    if (e >= -9) {
      scales[t] = FloatToE4m3(Exp2Int(e));
      StoreWords(data + t * (kNvfp4BlockSize / 2), aligned, packed);
      continue;
    }
    ++requantized;
    const float unit = Exp2Int(k);
    float v[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = E2m1ToFloat(Nibble(packed, j)) * unit;
    uint32_t out[2];
    scales[t] = EncodeBlock(v, scale_2, out);
    StoreWords(data + t * (kNvfp4BlockSize / 2), aligned, out);
  }
  WarpSumInto(&results->count, requantized);
}

}  // namespace

cudaError_t LaunchNvfp4Quantize(const DenseTensor& src, float scale_2, uint8_t* data,
                                uint8_t* scales, DeviceResults* results, const Launch& launch) {
  if (cudaError_t e = ResetResults(results, launch.stream); e != cudaSuccess) return e;
  const int64_t blocks = src.rows * src.cols / kNvfp4BlockSize;
  const bool aligned = Aligned16(src.data) && Aligned16(data);
  Nvfp4QuantizeKernel<<<GridFor(blocks, launch), kThreads, 0, launch.stream>>>(
      src, scale_2, data, scales, aligned, results);
  return cudaGetLastError();
}

cudaError_t LaunchMxfp4ToNvfp4(const Mxfp4Tensor& src, int kmax, uint8_t* data, uint8_t* scales,
                               DeviceResults* results, const Launch& launch) {
  if (cudaError_t e = ResetResults(results, launch.stream); e != cudaSuccess) return e;
  const int64_t blocks = src.rows * src.cols / kNvfp4BlockSize;
  const bool aligned = Aligned16(src.data) && Aligned16(data);
  Mxfp4ToNvfp4Kernel<<<GridFor(blocks, launch), kThreads, 0, launch.stream>>>(
      src, kmax, formats::Exp2Int(kmax - 8), data, scales, aligned, results);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
