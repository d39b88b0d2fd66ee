// Dequantization kernels: FP8 E4M3 with 128x128 block scales, MXFP4 and NVFP4 -> dense BF16/F32.
// Each value is computed by the formats.h functions the reference uses, in the same order (this
// file is compiled with -fmad=false and IEEE division, see CMakeLists.txt), so the bytes match
// kernels/reference.cc. Threads take whole chunks (16 or 32 elements) in a grid-stride loop and
// move them with 16-byte accesses when the tensors are 16-byte aligned.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/formats.h"

namespace quantd::kernels::cuda {
namespace {

using namespace quantd::formats;  // NOLINT: kernels spell out formats.h like the reference

// One thread per chunk of 16 consecutive flat elements; the last chunk may be partial. A chunk
// can cross a row (cols need not be a multiple of 16), so the scale is looked up per element and
// reloaded only when the element moves into another 128x128 block.
__global__ void Fp8BlockDequantKernel(Fp8BlockTensor src, DenseOut dst, bool aligned,
                                      DeviceResults* results) {
  const int64_t total = src.rows * src.cols;
  const int64_t chunks = (total + 15) / 16;
  const int64_t scale_cols = (src.cols + kFp8BlockSize - 1) / kFp8BlockSize;
  unsigned long long bad = kNoBad;
  for (int64_t t = FirstItem(); t < chunks; t += ItemStride()) {
    const int64_t i0 = t * 16;
    const int64_t n = total - i0 < 16 ? total - i0 : 16;
    uint32_t w[4];
    LoadByteChunk16(src.data, i0, total, aligned, w);
    int64_t r = i0 / src.cols;
    int64_t c = i0 - r * src.cols;
    int64_t cached = -1;  // scale index of `scale`
    float scale = 0.0f;
    bool scale_ok = false;
    float v[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      v[j] = 0.0f;
      if (j >= n) continue;
      const int64_t si = (r / kFp8BlockSize) * scale_cols + c / kFp8BlockSize;
      if (si != cached) {
        cached = si;
        if (src.scale_type == Fp8ScaleType::kE8M0) {
          const uint8_t b = static_cast<const uint8_t*>(src.scales)[si];
          scale_ok = !E8m0IsNan(b);
          scale = E8m0ToFloat(b);
        } else {
          scale = static_cast<const float*>(src.scales)[si];
          scale_ok = IsFinite(scale) && scale > 0.0f;
        }
      }
      const uint8_t code = static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
      if (!scale_ok || E4m3IsNan(code)) bad = min(bad, static_cast<unsigned long long>(i0 + j));
      v[j] = E4m3ToFloat(code) * scale;
      if (++c == src.cols) {
        c = 0;
        ++r;
      }
    }
    if (n == 16) {
      StoreDense16(dst.data, dst.type, i0, aligned, v);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        if (j < n) StoreDense(dst.data, dst.type, i0 + j, v[j]);
      }
    }
  }
  ReportBad(results, bad);
}

// One thread per 32-element MXFP4 block t: 16 packed bytes and scale byte t (cols % 32 == 0, so
// the flat block index is the flat scale index).
__global__ void Mxfp4DequantKernel(Mxfp4Tensor src, DenseOut dst, bool aligned,
                                   DeviceResults* results) {
  const int64_t blocks = src.rows * src.cols / kMxfp4BlockSize;
  unsigned long long bad = kNoBad;
  for (int64_t t = FirstItem(); t < blocks; t += ItemStride()) {
    const uint8_t b = src.scales[t];
    if (E8m0IsNan(b)) bad = min(bad, static_cast<unsigned long long>(t * kMxfp4BlockSize));
    const float scale = E8m0ToFloat(b);
    uint32_t w[4];
    LoadWords(src.data + t * (kMxfp4BlockSize / 2), aligned, w);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t packed[2] = {w[2 * half], w[2 * half + 1]};
      float v[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = E2m1ToFloat(Nibble(packed, j)) * scale;
      StoreDense16(dst.data, dst.type, t * kMxfp4BlockSize + 16 * half, aligned, v);
    }
  }
  ReportBad(results, bad);
}

// One thread per 16-element NVFP4 block t: 8 packed bytes and E4M3 scale byte t.
__global__ void Nvfp4DequantKernel(Nvfp4Tensor src, DenseOut dst, bool aligned,
                                   DeviceResults* results) {
  const int64_t blocks = src.rows * src.cols / kNvfp4BlockSize;
  unsigned long long bad = kNoBad;
  for (int64_t t = FirstItem(); t < blocks; t += ItemStride()) {
    const uint8_t s = src.scales[t];
    if (E4m3IsNan(s)) bad = min(bad, static_cast<unsigned long long>(t * kNvfp4BlockSize));
    uint32_t w[2];
    LoadWords(src.data + t * (kNvfp4BlockSize / 2), aligned, w);
    float v[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = Nvfp4Decode(Nibble(w, j), s, src.scale_2);
    StoreDense16(dst.data, dst.type, t * kNvfp4BlockSize, aligned, v);
  }
  ReportBad(results, bad);
}

}  // namespace

cudaError_t LaunchFp8BlockDequant(const Fp8BlockTensor& src, const DenseOut& dst,
                                  DeviceResults* results, const Launch& launch) {
  if (cudaError_t e = ResetResults(results, launch.stream); e != cudaSuccess) return e;
  const int64_t chunks = (src.rows * src.cols + 15) / 16;
  const bool aligned = Aligned16(src.data) && Aligned16(dst.data);
  Fp8BlockDequantKernel<<<GridFor(chunks, launch), kThreads, 0, launch.stream>>>(src, dst, aligned,
                                                                                  results);
  return cudaGetLastError();
}

cudaError_t LaunchMxfp4Dequant(const Mxfp4Tensor& src, const DenseOut& dst,
                               DeviceResults* results, const Launch& launch) {
  if (cudaError_t e = ResetResults(results, launch.stream); e != cudaSuccess) return e;
  const int64_t blocks = src.rows * src.cols / kMxfp4BlockSize;
  const bool aligned = Aligned16(src.data) && Aligned16(dst.data);
  Mxfp4DequantKernel<<<GridFor(blocks, launch), kThreads, 0, launch.stream>>>(src, dst, aligned,
                                                                               results);
  return cudaGetLastError();
}

cudaError_t LaunchNvfp4Dequant(const Nvfp4Tensor& src, const DenseOut& dst,
                               DeviceResults* results, const Launch& launch) {
  if (cudaError_t e = ResetResults(results, launch.stream); e != cudaSuccess) return e;
  const int64_t blocks = src.rows * src.cols / kNvfp4BlockSize;
  const bool aligned = Aligned16(src.data) && Aligned16(dst.data);
  Nvfp4DequantKernel<<<GridFor(blocks, launch), kThreads, 0, launch.stream>>>(src, dst, aligned,
                                                                               results);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
