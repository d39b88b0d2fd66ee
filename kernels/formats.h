// Scalar codecs for every number format quantd reads or writes: E4M3FN, E8M0, E2M1, BF16.
//
// This file is the reference that every other backend (kernels/cpu, kernels/cuda) is tested
// against. It is deliberately plain: one element at a time, integer bit manipulation, no tables
// that could drift from the definitions. Functions are usable from host and device code.
//
// Semantics follow the sources in ../shared/reference/:
//  - E4M3FN encode: PyTorch `fp8e4m3fn_from_fp32_value` (round-to-nearest-even; >= 480 -> NaN).
//  - E2M1 encode: ModelOpt `_cast_fp4` (bounds 0.25/0.75/1.25/1.75/2.5/3.5/5, ties to even,
//    sign taken before rounding, saturation at 6).
//  - NVFP4 block scale: ModelOpt >= 0.45 dynamic path (nvfp4_modelopt.md §1.2-§1.5).
#ifndef QUANTD_KERNELS_FORMATS_H_
#define QUANTD_KERNELS_FORMATS_H_

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define QUANTD_HD __host__ __device__ __forceinline__
#else
#define QUANTD_HD inline
#endif

namespace quantd::formats {

// ---- bit casts --------------------------------------------------------------------------------

QUANTD_HD uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

QUANTD_HD float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

QUANTD_HD bool IsFinite(float f) { return (FloatBits(f) & 0x7F800000u) != 0x7F800000u; }

QUANTD_HD float AbsF(float f) { return BitsToFloat(FloatBits(f) & 0x7FFFFFFFu); }

// 2^e for e in [-149, 127], exact (subnormal results included).
QUANTD_HD float Exp2Int(int e) {
  if (e >= -126) return BitsToFloat(static_cast<uint32_t>(e + 127) << 23);
  return BitsToFloat(1u << (e + 149));
}

// ---- BF16 -------------------------------------------------------------------------------------

QUANTD_HD float Bf16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// Round-to-nearest-even; NaN -> 0x7FC0 (PyTorch's canonical quiet NaN, sign dropped).
QUANTD_HD uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// f rounded to the nearest BF16 value, as float32 (a BF16 tensor's value in float32 code).
QUANTD_HD float RoundToBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

// ---- E4M3FN (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; 0x7F/0xFF = NaN; no inf) ---

inline constexpr float kE4m3Max = 448.0f;

QUANTD_HD float E4m3ToFloat(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const int exp = (b >> 3) & 0xF;
  const int mant = b & 0x7;
  if (exp == 0xF && mant == 0x7) return BitsToFloat(0x7FC00000u | sign);
  if (exp == 0) {  // subnormal: mant * 2^-9, exact in float
    return BitsToFloat(FloatBits(static_cast<float>(mant) * Exp2Int(-9)) | sign);
  }
  return BitsToFloat(sign | (static_cast<uint32_t>(exp - 7 + 127) << 23) |
                     (static_cast<uint32_t>(mant) << 20));
}

// PyTorch's cast: round-to-nearest-even; |f| >= 480 (after rounding: > 464), inf and NaN -> NaN
// (0x7F, with the input's sign bit).
QUANTD_HD uint8_t FloatToE4m3(float f) {
  const uint32_t kNanThreshold = 1087u << 20;  // 480.0f
  const uint32_t kDenormMagic = 141u << 23;    // 2^14: adding it rounds to the 2^-9 grid (RNE)
  uint32_t bits = FloatBits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= kNanThreshold) {
    result = 0x7F;
  } else if (bits < (121u << 23)) {  // |f| < 2^-6: E4M3 subnormal range
    bits = FloatBits(BitsToFloat(bits) + BitsToFloat(kDenormMagic));
    result = static_cast<uint8_t>(bits - kDenormMagic);
  } else {
    const uint32_t mant_odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu;  // rebias, round half up...
    bits += mant_odd;                                            // ...and make ties even
    result = static_cast<uint8_t>(bits >> 20);
  }
  return static_cast<uint8_t>(result | (sign >> 24));
}

// Saturating variant (CUDA's __NV_SATFINITE): finite values and inf beyond 448 become +-448,
// NaN stays NaN.
QUANTD_HD uint8_t FloatToE4m3Sat(float f) {
  const uint32_t bits = FloatBits(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint8_t>(0x7F | ((bits >> 24) & 0x80));
  if ((bits & 0x7FFFFFFFu) >= FloatBits(kE4m3Max)) return static_cast<uint8_t>(0x7E | ((bits >> 24) & 0x80));
  return FloatToE4m3(f);
}

QUANTD_HD bool E4m3IsNan(uint8_t b) { return (b & 0x7F) == 0x7F; }

// ---- E8M0 (8-bit biased exponent, value 2^(b-127); 0xFF = NaN) ----------------------------------

QUANTD_HD bool E8m0IsNan(uint8_t b) { return b == 0xFF; }

QUANTD_HD float E8m0ToFloat(uint8_t b) {
  if (b == 0xFF) return BitsToFloat(0x7FC00000u);
  return Exp2Int(static_cast<int>(b) - 127);
}

// ---- E2M1 (1 sign, 2 exponent bits, 1 mantissa bit; magnitudes {0,.5,1,1.5,2,3,4,6}) -----------

inline constexpr float kE2m1Max = 6.0f;

QUANTD_HD float E2m1ToFloat(uint8_t code) {
  const uint8_t mag = code & 0x7;
  // Codes 0..3 are subnormal-like (mag/2); 4..7 are 2^((mag>>1)-1) * (1 + (mag&1)/2): 2, 3, 4, 6.
  const float v = mag < 4 ? 0.5f * static_cast<float>(mag)
                          : static_cast<float>(1 << ((mag >> 1) - 1)) * (1.0f + 0.5f * (mag & 1));
  return (code & 0x8) ? -v : v;
}

// ModelOpt's rounding: sign is taken before rounding (tiny negatives -> 0x8, i.e. -0; -0.0 -> 0x0),
// ties go to the even code, everything above 5 saturates to 6. NaN encodes as 0 (callers reject
// non-finite input before encoding).
QUANTD_HD uint8_t FloatToE2m1(float x) {
  const uint8_t sign = x < 0.0f ? 0x8 : 0x0;
  const float m = AbsF(x);
  uint8_t ord = static_cast<uint8_t>((m > 0.25f) + (m > 0.75f) + (m > 1.25f) + (m > 1.75f) +
                                     (m > 2.5f) + (m > 3.5f) + (m > 5.0f));
  ord = static_cast<uint8_t>(ord + (m == 0.75f || m == 1.75f || m == 3.5f));
  return static_cast<uint8_t>(sign | ord);
}

// ---- NVFP4 (ModelOpt >= 0.45) -----------------------------------------------------------------

inline constexpr int kNvfp4BlockSize = 16;
inline constexpr float kNvfp4AmaxDivisor = 2688.0f;  // 6 (E2M1 max) * 448 (E4M3 max)

// weight_scale_2 for a tensor (or fused group) with absolute maximum `amax`. An all-zero tensor
// gets the scale of amax = 1 instead of 0, so that every stored scale is finite and positive and
// 1/weight_scale_2 (compressed-tensors' global scale) stays finite; its blocks then all get scale
// 1.0 and code 0, which still decodes to exactly 0. (ModelOpt would divide 0 by 0 and write NaN
// block scales.)
// A positive amax so small that amax / 2688 underflows to 0 (below about 2^-137.6) gets the
// smallest positive float instead, so block scales stay finite.
QUANTD_HD float Nvfp4GlobalScale(float amax) {
  if (!(amax > 0.0f)) return 1.0f / kNvfp4AmaxDivisor;
  const float s = amax / kNvfp4AmaxDivisor;
  return s > 0.0f ? s : Exp2Int(-149);
}

// E4M3 byte of one 16-block's scale: s = block_amax / (6 * scale_2), 0 -> 1, clamped to
// [2^-9, 448], cast with round-to-nearest-even. Never 0, never NaN for finite inputs.
QUANTD_HD uint8_t Nvfp4BlockScale(float block_amax, float scale_2) {
  float s = block_amax / (6.0f * scale_2);
  if (s == 0.0f) s = 1.0f;
  const float lo = Exp2Int(-9);
  s = s < lo ? lo : s;
  s = s > kE4m3Max ? kE4m3Max : s;
  return FloatToE4m3(s);
}

// E2M1 code of one element given its block's stored scale byte: x / (float(S) * scale_2).
QUANTD_HD uint8_t Nvfp4Encode(float x, uint8_t scale_byte, float scale_2) {
  const float d = E4m3ToFloat(scale_byte) * scale_2;
  return FloatToE2m1(x / d);
}

QUANTD_HD float Nvfp4Decode(uint8_t code, uint8_t scale_byte, float scale_2) {
  return E2m1ToFloat(code) * E4m3ToFloat(scale_byte) * scale_2;
}

// E4M3 byte of one 16-block's scale when a W4A4 runtime quantizes an activation with
// input_scale (global scale 1 / input_scale): s = block_amax / (6 * input_scale), saturated at
// 448, cast with round-to-nearest-even. Unlike Nvfp4BlockScale there is no lower clamp and no
// 0 -> 1: a block whose scale rounds to 0 (block_amax < 6 * input_scale * 2^-10) is quantized to
// zeros, as vLLM's / FlashInfer's activation kernels do (reference/nvfp4_modelopt.md §2.1).
QUANTD_HD uint8_t Nvfp4ActivationBlockScale(float block_amax, float input_scale) {
  float s = block_amax / (6.0f * input_scale);
  s = s > kE4m3Max ? kE4m3Max : s;
  return FloatToE4m3(s);
}

// ---- DeepSeek's own power-of-two scales (used to encode fixtures as DeepSeek does) ------------

// ceil(log2(r)) for finite r >= 0, exact (no log2f rounding). r == 0 gives -150, below every
// float's exponent.
QUANTD_HD int CeilLog2(float r) {
  const uint32_t bits = FloatBits(r) & 0x7FFFFFFFu;
  int exp = static_cast<int>((bits >> 23) & 0xFF);
  uint32_t mant = bits & 0x7FFFFFu;
  if (bits == 0) return -150;
  if (exp == 0) {  // subnormal: normalize
    int e = -126;
    while ((mant & 0x800000u) == 0) {
      mant <<= 1;
      --e;
    }
    mant &= 0x7FFFFFu;
    return mant == 0 ? e : e + 1;
  }
  return mant == 0 ? exp - 127 : exp - 127 + 1;
}

// E8M0 byte for the scale 2^ceil(log2(amax / max_code)), amax floored at `min_amax` as DeepSeek's
// quantizers do. The exponent is clamped to E8M0's finite range [-127, 127].
QUANTD_HD uint8_t E8m0ScaleForAmax(float amax, float max_code, float min_amax) {
  const float a = amax > min_amax ? amax : min_amax;
  int e = CeilLog2(a / max_code);
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return static_cast<uint8_t>(e + 127);
}

}  // namespace quantd::formats

#endif  // QUANTD_KERNELS_FORMATS_H_
