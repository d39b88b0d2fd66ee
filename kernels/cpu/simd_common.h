// Scalar helpers for the SIMD row-kernel files (row_kernels_avx2.cc, row_kernels_avx512.cc).
//
// Everything here is `static`, so each SIMD file gets its own copy compiled with its own
// instruction-set flags. Those files must not call shared inline code (formats.h's codecs, std::
// templates): the linker keeps one copy of an inline function, and it could keep the AVX-512
// compilation for callers that run on any CPU.
#ifndef QUANTD_KERNELS_CPU_SIMD_COMMON_H_
#define QUANTD_KERNELS_CPU_SIMD_COMMON_H_

#include <stdint.h>
#include <string.h>

#include "kernels/tensor_views.h"

namespace quantd::kernels::cpu {

static inline int64_t MinI64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline float BitsAsFloat(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

// formats::E8m0ToFloat for a byte other than 0xFF: 2^(b-127), b == 0 being the subnormal 2^-127.
static inline float E8m0Value(uint8_t b) {
  return BitsAsFloat(b == 0 ? 0x00400000u : static_cast<uint32_t>(b) << 23);
}

// The scale of FP8 block `si` as float; false for a scale the reference rejects (a NaN E8M0
// byte, a non-finite or non-positive F32 scale).
static inline bool Fp8Scale(const Fp8BlockTensor& src, int64_t si, float* scale) {
  if (src.scale_type == Fp8ScaleType::kE8M0) {
    const uint8_t b = static_cast<const uint8_t*>(src.scales)[si];
    if (b == 0xFF) return false;
    *scale = E8m0Value(b);
    return true;
  }
  const float s = static_cast<const float*>(src.scales)[si];
  uint32_t bits;
  memcpy(&bits, &s, sizeof(bits));
  if ((bits & 0x7F800000u) == 0x7F800000u || !(s > 0.0f)) return false;
  *scale = s;
  return true;
}

}  // namespace quantd::kernels::cpu

#endif  // QUANTD_KERNELS_CPU_SIMD_COMMON_H_
