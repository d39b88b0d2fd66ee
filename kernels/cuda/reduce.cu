// Reduction kernels: abs-max over a whole tensor and per 16-block, and the largest MXFP4 scale
// byte. Maxima of finite non-negative floats are taken on their bit patterns, which order the
// same way, so integer atomicMax gives exactly the reference's float maximum.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/formats.h"

namespace quantd::kernels::cuda {
namespace {

using namespace quantd::formats;  // NOLINT: kernels spell out formats.h like the reference

// One thread per chunk of 16 consecutive flat elements; the last chunk may be partial.
__global__ void AbsMaxKernel(DenseTensor src, bool aligned, DeviceResults* results) {
  const int64_t total = src.rows * src.cols;
  const int64_t chunks = (total + 15) / 16;
  unsigned int max_bits = 0;  // bits of this thread's largest |x|
  unsigned long long bad = kNoBad;
  for (int64_t t = FirstItem(); t < chunks; t += ItemStride()) {
    const int64_t i0 = t * 16;
    const int64_t n = total - i0 < 16 ? total - i0 : 16;
    float v[16];
    if (n == 16) {
      LoadDense16(src.data, src.type, i0, aligned, v);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = j < n ? LoadDense(src.data, src.type, i0 + j) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (!IsFinite(v[j])) {
        bad = min(bad, static_cast<unsigned long long>(i0 + j));
      } else {
        max_bits = max(max_bits, FloatBits(AbsF(v[j])));
      }
    }
  }
  WarpMaxInto(&results->max_bits, max_bits);
  ReportBad(results, bad);
}

// One thread per 16-block t (cols % 16 == 0): out[t] = max |x| over it, as the reference does.
__global__ void BlockAbsMax16Kernel(DenseTensor src, float* out, bool aligned,
                                    DeviceResults* results) {
  const int64_t blocks = src.rows * src.cols / kNvfp4BlockSize;
  unsigned long long bad = kNoBad;
  for (int64_t t = FirstItem(); t < blocks; t += ItemStride()) {
    float v[16];
    LoadDense16(src.data, src.type, t * kNvfp4BlockSize, aligned, v);
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (!IsFinite(v[j])) bad = min(bad, static_cast<unsigned long long>(t * kNvfp4BlockSize + j));
      const float a = AbsF(v[j]);
      m = a > m ? a : m;
    }
    out[t] = m;
  }
  ReportBad(results, bad);
}

// One thread per 16 consecutive scale bytes; the last chunk may be partial. Scale byte s covers
// the 32 elements starting at flat index 32 * s (cols % 32 == 0).
__global__ void Mxfp4MaxScaleKernel(Mxfp4Tensor src, bool aligned, DeviceResults* results) {
  const int64_t total = src.rows * src.cols / kMxfp4BlockSize;
  const int64_t chunks = (total + 15) / 16;
  unsigned int max_byte = 0;
  unsigned long long bad = kNoBad;
  for (int64_t t = FirstItem(); t < chunks; t += ItemStride()) {
    const int64_t i0 = t * 16;
    uint32_t w[4];
    LoadByteChunk16(src.scales, i0, total, aligned, w);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint8_t b = static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
      if (E8m0IsNan(b)) {
        bad = min(bad, static_cast<unsigned long long>((i0 + j) * kMxfp4BlockSize));
      } else {
        max_byte = max(max_byte, static_cast<unsigned int>(b));  // zero padding beyond n is harmless
      }
    }
  }
  WarpMaxInto(&results->max_bits, max_byte);
  ReportBad(results, bad);
}

}  // namespace

cudaError_t LaunchAbsMax(const DenseTensor& src, DeviceResults* results, const Launch& launch) {
  if (cudaError_t e = ResetResults(results, launch.stream); e != cudaSuccess) return e;
  const int64_t chunks = (src.rows * src.cols + 15) / 16;
  AbsMaxKernel<<<GridFor(chunks, launch), kThreads, 0, launch.stream>>>(
      src, Aligned16(src.data), results);
  return cudaGetLastError();
}

cudaError_t LaunchBlockAbsMax16(const DenseTensor& src, float* out, DeviceResults* results,
                                const Launch& launch) {
  if (cudaError_t e = ResetResults(results, launch.stream); e != cudaSuccess) return e;
  const int64_t blocks = src.rows * src.cols / kNvfp4BlockSize;
  BlockAbsMax16Kernel<<<GridFor(blocks, launch), kThreads, 0, launch.stream>>>(
      src, out, Aligned16(src.data), results);
  return cudaGetLastError();
}

cudaError_t LaunchMxfp4MaxScale(const Mxfp4Tensor& src, DeviceResults* results,
                                const Launch& launch) {
  if (cudaError_t e = ResetResults(results, launch.stream); e != cudaSuccess) return e;
  const int64_t chunks = (src.rows * src.cols / kMxfp4BlockSize + 15) / 16;
  Mxfp4MaxScaleKernel<<<GridFor(chunks, launch), kThreads, 0, launch.stream>>>(
      src, Aligned16(src.scales), results);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
