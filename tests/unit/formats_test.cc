// Oracles for kernels/formats.h, the numeric specification every backend is tested against:
//  - every E4M3, E8M0 and E2M1 code decoded and compared with a value built from its bit fields;
//  - BF16 <-> float round trips and round-to-nearest-even;
//  - every BF16 bit pattern, every E4M3 midpoint and a dense float32 sweep encoded and compared
//    with CUDA's own host-side conversions (cuda_fp8.h, cuda_fp4.h, cuda_bf16.h), asserting the
//    exact set of inputs where the two specifications differ;
//  - NVFP4 blocks whose expected bytes were computed by hand.
#include "kernels/formats.h"

#include <gtest/gtest.h>
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/reference.h"
#include "kernels/tensor_views.h"

#if defined(QUANTD_HAVE_CUDA_HEADERS)
// CUDA's headers are not -Wextra clean (unused parameters in cuda_fp4.hpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#pragma GCC diagnostic pop
#endif

namespace quantd::formats {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

float Up(float x) { return std::nextafter(x, kInf); }
float Down(float x) { return std::nextafter(x, -kInf); }
bool IsNanBits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// ---- decoding every code ----------------------------------------------------------------------

TEST(E4m3Decode, EveryCodeMatchesItsBitFields) {
  for (int b = 0; b < 256; ++b) {
    const bool negative = (b & 0x80) != 0;
    const int exp = (b >> 3) & 0xF;
    const int mant = b & 0x7;
    const uint32_t got = FloatBits(E4m3ToFloat(static_cast<uint8_t>(b)));
    if (exp == 0xF && mant == 0x7) {  // 0x7F, 0xFF: the only NaNs; quiet NaN keeping the sign
      EXPECT_EQ(got, 0x7FC00000u | (negative ? 0x80000000u : 0u)) << b;
      EXPECT_TRUE(E4m3IsNan(static_cast<uint8_t>(b)));
      continue;
    }
    EXPECT_FALSE(E4m3IsNan(static_cast<uint8_t>(b))) << b;
    // Subnormal: 0.mmm * 2^(1-7); normal: 1.mmm * 2^(e-7).
    const double magnitude =
        exp == 0 ? std::ldexp(static_cast<double>(mant), -9) : std::ldexp(8.0 + mant, exp - 10);
    const float want = static_cast<float>(negative ? -magnitude : magnitude);
    EXPECT_EQ(got, FloatBits(want)) << b;
  }
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(E4m3ToFloat(0x07), std::ldexp(7.0f, -9));  // largest subnormal
  EXPECT_EQ(E4m3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(E4m3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0xFE), -448.0f);
  EXPECT_EQ(FloatBits(E4m3ToFloat(0x80)), 0x80000000u);  // -0
}

TEST(E4m3Decode, EveryFiniteCodeRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    if (E4m3IsNan(static_cast<uint8_t>(b))) continue;
    const float f = E4m3ToFloat(static_cast<uint8_t>(b));
    EXPECT_EQ(FloatToE4m3(f), b) << b;
    EXPECT_EQ(FloatToE4m3Sat(f), b) << b;
  }
}

TEST(E8m0Decode, EveryCodeIsAPowerOfTwo) {
  for (int b = 0; b < 255; ++b) {
    const float want = std::ldexp(1.0f, b - 127);  // 2^-127 is subnormal, still exact
    EXPECT_EQ(FloatBits(E8m0ToFloat(static_cast<uint8_t>(b))), FloatBits(want)) << b;
    EXPECT_FALSE(E8m0IsNan(static_cast<uint8_t>(b)));
  }
  EXPECT_TRUE(E8m0IsNan(0xFF));
  EXPECT_EQ(FloatBits(E8m0ToFloat(0xFF)), 0x7FC00000u);
  EXPECT_EQ(FloatBits(E8m0ToFloat(0x00)), 0x00400000u);  // 2^-127
  EXPECT_EQ(E8m0ToFloat(0x7F), 1.0f);
  EXPECT_EQ(FloatBits(E8m0ToFloat(0xFE)), 0x7F000000u);  // 2^127
}

TEST(E2m1Decode, EveryCodeMatchesItsBitFields) {
  const float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 16; ++c) {
    const int exp = (c >> 1) & 0x3;
    const int mant = c & 0x1;
    // Subnormal (exp 0): 0.m * 2^0; normal: 1.m * 2^(exp-1).
    const float magnitude =
        exp == 0 ? 0.5f * static_cast<float>(mant) : std::ldexp(1.0f + 0.5f * mant, exp - 1);
    ASSERT_EQ(magnitude, kMagnitudes[c & 7]);
    const float want = (c & 0x8) ? -magnitude : magnitude;
    EXPECT_EQ(FloatBits(E2m1ToFloat(static_cast<uint8_t>(c))), FloatBits(want)) << c;
  }
  EXPECT_EQ(FloatBits(E2m1ToFloat(0x8)), 0x80000000u);  // -0
}

TEST(E2m1Decode, EveryCodeRoundTripsExceptMinusZero) {
  for (int c = 0; c < 16; ++c) {
    // -0.0 is not < 0, so ModelOpt's sign rule encodes it as +0 (code 0x0), not 0x8.
    const int want = c == 0x8 ? 0x0 : c;
    EXPECT_EQ(FloatToE2m1(E2m1ToFloat(static_cast<uint8_t>(c))), want) << c;
  }
}

// ---- BF16 -------------------------------------------------------------------------------------

TEST(Bf16, EveryPatternRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    ASSERT_EQ(FloatBits(f), b << 16);
    const uint16_t want = IsNanBits(b << 16) ? 0x7FC0 : static_cast<uint16_t>(b);
    EXPECT_EQ(FloatToBf16(f), want) << b;
  }
}

TEST(Bf16, RoundsToNearestEven) {
  struct Case {
    uint32_t f;     // float32 bits
    uint16_t bf16;  // expected BF16 bits
  };
  const Case kCases[] = {
      {0x3F808000u, 0x3F80},  // 1 + 2^-8: halfway between 0x3F80 and 0x3F81 -> even 0x3F80
      {0x3F818000u, 0x3F82},  // halfway between 0x3F81 and 0x3F82 -> even 0x3F82
      {0x3F808001u, 0x3F81},  // just above halfway -> up
      {0x3F807FFFu, 0x3F80},  // just below halfway -> down
      {0xBF808000u, 0xBF80},  // negative tie, magnitude rounds to even
      {0xBF818000u, 0xBF82},
      {0x3FFF8000u, 0x4000},  // 1.99609375 (tie): carries into the exponent -> 2.0
      {0x7F7F8000u, 0x7F80},  // halfway between the largest BF16 and 2^128: even is +inf
      {0x7F7F7FFFu, 0x7F7F},  // just below: largest finite BF16
      {0x00008000u, 0x0000},  // subnormal tie -> even 0
      {0x00018000u, 0x0002},  // subnormal tie -> even 2
      {0x80000000u, 0x8000},  // -0 keeps its sign
      {0x7F800000u, 0x7F80},  // +inf
      {0xFF800000u, 0xFF80},  // -inf
      {0x7F800001u, 0x7FC0},  // signalling NaN -> canonical quiet NaN
      {0xFFFFFFFFu, 0x7FC0},  // negative NaN -> canonical NaN, sign dropped
  };
  for (const Case& c : kCases) EXPECT_EQ(FloatToBf16(BitsToFloat(c.f)), c.bf16) << std::hex << c.f;
}

// ---- E4M3 / E2M1 encoding ---------------------------------------------------------------------

TEST(E4m3Encode, EveryMidpointRoundsToEven) {
  // Each pair of adjacent positive finite codes c, c+1 (0x00..0x7E); the midpoint needs one more
  // significand bit than E4M3 has, so it is exact in float32.
  for (int c = 0; c < 0x7E; ++c) {
    const float mid =
        (E4m3ToFloat(static_cast<uint8_t>(c)) + E4m3ToFloat(static_cast<uint8_t>(c + 1))) / 2.0f;
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(FloatToE4m3(mid), even) << c;
    EXPECT_EQ(FloatToE4m3(-mid), even | 0x80) << c;
    EXPECT_EQ(FloatToE4m3(Up(mid)), c + 1) << c;
    EXPECT_EQ(FloatToE4m3(Down(mid)), c) << c;
    EXPECT_EQ(FloatToE4m3(-Up(mid)), (c + 1) | 0x80) << c;
    EXPECT_EQ(FloatToE4m3(-Down(mid)), c | 0x80) << c;
    EXPECT_EQ(FloatToE4m3Sat(mid), even) << c;
  }
  // Above 448 the next step would be 480 (exponent 15, mantissa 7 is NaN): 464 is the tie and
  // goes to the even 448; anything above it overflows (NaN) or saturates (448).
  EXPECT_EQ(FloatToE4m3(464.0f), 0x7E);
  EXPECT_EQ(FloatToE4m3(Up(464.0f)), 0x7F);
  EXPECT_EQ(FloatToE4m3(-Up(464.0f)), 0xFF);
  EXPECT_EQ(FloatToE4m3(479.0f), 0x7F);
  EXPECT_EQ(FloatToE4m3(480.0f), 0x7F);
  EXPECT_EQ(FloatToE4m3(kInf), 0x7F);
  EXPECT_EQ(FloatToE4m3(-kInf), 0xFF);
  EXPECT_EQ(FloatToE4m3Sat(Up(464.0f)), 0x7E);
  EXPECT_EQ(FloatToE4m3Sat(1e30f), 0x7E);
  EXPECT_EQ(FloatToE4m3Sat(-kInf), 0xFE);
  EXPECT_EQ(FloatToE4m3Sat(BitsToFloat(0xFFC00000u)), 0xFF);  // NaN keeps its sign
  // Below half the smallest subnormal (2^-10, itself a tie to even 0): signed zero.
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(FloatToE4m3(Up(std::ldexp(1.0f, -10))), 0x01);
  EXPECT_EQ(FloatToE4m3(-1e-30f), 0x80);
  EXPECT_EQ(FloatToE4m3(-0.0f), 0x80);
}

TEST(E2m1Encode, ThresholdsFollowModelOpt) {
  // Thresholds between adjacent magnitudes and the code a tie goes to (the even code).
  struct Case {
    float threshold;
    uint8_t tie;    // code of exactly the threshold
    uint8_t below;  // code just below it
    uint8_t above;  // code just above it
  };
  const Case kCases[] = {{0.25f, 0, 0, 1}, {0.75f, 2, 1, 2}, {1.25f, 2, 2, 3}, {1.75f, 4, 3, 4},
                         {2.5f, 4, 4, 5},  {3.5f, 6, 5, 6},  {5.0f, 6, 6, 7}};
  for (const Case& c : kCases) {
    EXPECT_EQ(FloatToE2m1(c.threshold), c.tie) << c.threshold;
    EXPECT_EQ(FloatToE2m1(Down(c.threshold)), c.below) << c.threshold;
    EXPECT_EQ(FloatToE2m1(Up(c.threshold)), c.above) << c.threshold;
    EXPECT_EQ(FloatToE2m1(-c.threshold), c.tie | 0x8) << c.threshold;
    EXPECT_EQ(FloatToE2m1(-Down(c.threshold)), c.below | 0x8) << c.threshold;
    EXPECT_EQ(FloatToE2m1(-Up(c.threshold)), c.above | 0x8) << c.threshold;
  }
  EXPECT_EQ(FloatToE2m1(6.0f), 7);
  EXPECT_EQ(FloatToE2m1(1e30f), 7);
  EXPECT_EQ(FloatToE2m1(-kInf), 0xF);
  EXPECT_EQ(FloatToE2m1(-1e-30f), 0x8);  // sign taken before rounding
  EXPECT_EQ(FloatToE2m1(-0.0f), 0x0);    // -0.0 is not < 0
}

#if defined(QUANTD_HAVE_CUDA_HEADERS)

// Where formats.h and CUDA's host conversions (cuda_fp8.hpp __nv_cvt_double_to_fp8, reached
// from __nv_cvt_float_to_fp8 on the host) legitimately differ for E4M3, derived from both sources:
//  - NaN: CUDA first replaces every NaN by 0x7FFFFFFF, so a negative NaN becomes 0x7F; PyTorch's
//    cast (our model) keeps the sign bit: 0xFF. Positive NaNs agree (0x7F).
//  - Everything else coincides: CUDA's NOSAT sends |x| > 464 (448 + half an ulp) and +-inf to
//    0x7F | sign; PyTorch sends |x| >= 480 and inf to NaN and rounds (464, 480) up into the NaN
//    code 0x7F | sign; 464 itself is a tie to the even 448 in both. SATFINITE and FloatToE4m3Sat
//    both saturate to 0x7E | sign. Magnitudes <= 2^-10 give 0x00 | sign in both (-0 included), and
//    every other value rounds to nearest-even in both.
bool E4m3DiffersFromCuda(uint32_t bits) { return IsNanBits(bits) && (bits >> 31) != 0; }

// The same for E2M1 (cuda_fp4.hpp __nv_cvt_double_to_fp4):
//  - -0.0: CUDA ORs the sign bit onto the underflowed 0 (0x8); ModelOpt takes the sign as x < 0,
//    false for -0.0 (0x0). Tiny negatives (-0.25 <= x < 0) are 0x8 in both.
//  - NaN (either sign): CUDA gives +6 (0x7); formats.h gives 0x0 (callers reject NaN earlier).
//  - Thresholds 0.25/0.75/1.25/1.75/2.5/3.5/5 are ties to even in both, and both saturate at 6.
bool E2m1DiffersFromCuda(uint32_t bits) { return IsNanBits(bits) || bits == 0x80000000u; }

// BF16 (cuda_bf16.hpp __float2bfloat16_rn on the host): CUDA's NaN is 0x7FFF, PyTorch's (ours)
// is 0x7FC0; every other input is RNE in both.
bool Bf16DiffersFromCuda(uint32_t bits) { return IsNanBits(bits); }

uint8_t CudaE4m3(float f) { return __nv_cvt_float_to_fp8(f, __NV_NOSAT, __NV_E4M3); }
uint8_t CudaE4m3Sat(float f) { return __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3); }
uint8_t CudaE2m1(float f) { return __nv_cvt_float_to_fp4(f, __NV_E2M1, cudaRoundNearest); }
uint16_t CudaBf16(float f) {
  const __nv_bfloat16_raw raw = __float2bfloat16_rn(f);
  return raw.x;
}

// Compares one input with CUDA and checks the exact values wherever the specifications differ.
// Returns whether it differed.
bool CheckE4m3(uint32_t bits) {
  const float f = BitsToFloat(bits);
  const uint8_t ours = FloatToE4m3(f), ours_sat = FloatToE4m3Sat(f);
  const uint8_t cuda = CudaE4m3(f), cuda_sat = CudaE4m3Sat(f);
  if (E4m3DiffersFromCuda(bits)) {
    EXPECT_EQ(ours, 0xFF) << std::hex << bits;
    EXPECT_EQ(ours_sat, 0xFF) << std::hex << bits;
    EXPECT_EQ(cuda, 0x7F) << std::hex << bits;
    EXPECT_EQ(cuda_sat, 0x7F) << std::hex << bits;
    return true;
  }
  EXPECT_EQ(ours, cuda) << std::hex << bits;
  EXPECT_EQ(ours_sat, cuda_sat) << std::hex << bits;
  return false;
}

bool CheckE2m1(uint32_t bits) {
  const float f = BitsToFloat(bits);
  const uint8_t ours = FloatToE2m1(f), cuda = CudaE2m1(f);
  if (E2m1DiffersFromCuda(bits)) {
    EXPECT_EQ(ours, 0x0) << std::hex << bits;
    EXPECT_EQ(cuda, IsNanBits(bits) ? 0x7 : 0x8) << std::hex << bits;
    return true;
  }
  EXPECT_EQ(ours, cuda) << std::hex << bits;
  return false;
}

bool CheckBf16(uint32_t bits) {
  const float f = BitsToFloat(bits);
  if (Bf16DiffersFromCuda(bits)) {
    EXPECT_EQ(FloatToBf16(f), 0x7FC0) << std::hex << bits;
    EXPECT_EQ(CudaBf16(f), 0x7FFF) << std::hex << bits;
    return true;
  }
  EXPECT_EQ(FloatToBf16(f), CudaBf16(f)) << std::hex << bits;
  return false;
}

TEST(E4m3EncodeVsCuda, EveryBf16Pattern) {
  int differing = 0;
  for (uint32_t b = 0; b < 65536; ++b) differing += CheckE4m3(b << 16);
  EXPECT_EQ(differing, 127);  // the negative NaNs 0xFF81..0xFFFF
}

TEST(E2m1EncodeVsCuda, EveryBf16Pattern) {
  int differing = 0;
  for (uint32_t b = 0; b < 65536; ++b) differing += CheckE2m1(b << 16);
  EXPECT_EQ(differing, 2 * 127 + 1);  // 254 NaNs and -0.0
}

TEST(E4m3EncodeVsCuda, EveryMidpointAndItsNeighbours) {
  for (int c = 0; c < 0x7E; ++c) {
    const float mid =
        (E4m3ToFloat(static_cast<uint8_t>(c)) + E4m3ToFloat(static_cast<uint8_t>(c + 1))) / 2.0f;
    for (float f : {mid, Up(mid), Down(mid), -mid, -Up(mid), -Down(mid)}) {
      EXPECT_FALSE(CheckE4m3(FloatBits(f))) << f;
    }
  }
  for (float f : {464.0f, Up(464.0f), Down(464.0f), 480.0f, Down(480.0f), kInf}) {
    EXPECT_FALSE(CheckE4m3(FloatBits(f))) << f;
    EXPECT_FALSE(CheckE4m3(FloatBits(-f))) << f;
  }
}

TEST(E2m1EncodeVsCuda, EveryThresholdAndItsNeighbours) {
  for (float t : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f}) {
    for (float f : {t, Up(t), Down(t), -t, -Up(t), -Down(t)}) {
      EXPECT_FALSE(CheckE2m1(FloatBits(f))) << f;
    }
  }
}

// All 2^32 patterns take about 90 s here, so the sweeps visit every 7th (613,566,757 patterns;
// 7 is odd, so every residue of the low mantissa bits, which decide rounding, is visited).
constexpr uint64_t kSweepStride = 7;

// How many patterns in [lo, hi] the sweep visits (the multiples of kSweepStride).
uint64_t SweptIn(uint64_t lo, uint64_t hi) { return hi / kSweepStride - (lo - 1) / kSweepStride; }

// The hot loops compare without gtest macros; the first few failures are re-run through the
// Check* functions above, which report them in detail.
TEST(E4m3EncodeVsCuda, Float32Sweep) {
  uint64_t differing = 0, failed = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += kSweepStride) {
    const uint32_t bits = static_cast<uint32_t>(u);
    const float f = BitsToFloat(bits);
    const uint8_t ours = FloatToE4m3(f), ours_sat = FloatToE4m3Sat(f);
    const uint8_t cuda = CudaE4m3(f), cuda_sat = CudaE4m3Sat(f);
    const bool differs = E4m3DiffersFromCuda(bits);
    const bool ok = differs ? ours == 0xFF && ours_sat == 0xFF && cuda == 0x7F && cuda_sat == 0x7F
                            : ours == cuda && ours_sat == cuda_sat;
    differing += differs;
    if (!ok && failed++ < 10) CheckE4m3(bits);
  }
  EXPECT_EQ(failed, 0u);
  EXPECT_EQ(differing, SweptIn(0xFF800001u, 0xFFFFFFFFu));  // the negative NaNs visited
}

TEST(E2m1EncodeVsCuda, Float32Sweep) {
  uint64_t differing = 0, failed = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += kSweepStride) {
    const uint32_t bits = static_cast<uint32_t>(u);
    const float f = BitsToFloat(bits);
    const uint8_t ours = FloatToE2m1(f), cuda = CudaE2m1(f);
    const bool differs = E2m1DiffersFromCuda(bits);
    const bool ok = differs ? ours == 0x0 && cuda == (IsNanBits(bits) ? 0x7 : 0x8) : ours == cuda;
    differing += differs;
    if (!ok && failed++ < 10) CheckE2m1(bits);
  }
  EXPECT_EQ(failed, 0u);
  // The NaNs of both signs visited; -0.0 (0x80000000 = 2 mod 7) is not on the stride.
  EXPECT_EQ(differing, SweptIn(0x7F800001u, 0x7FFFFFFFu) + SweptIn(0xFF800001u, 0xFFFFFFFFu));
  EXPECT_TRUE(CheckE2m1(0x80000000u));
}

TEST(Bf16VsCuda, Float32Sweep) {
  uint64_t differing = 0, failed = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += kSweepStride) {
    const uint32_t bits = static_cast<uint32_t>(u);
    const float f = BitsToFloat(bits);
    const uint16_t ours = FloatToBf16(f), cuda = CudaBf16(f);
    const bool differs = Bf16DiffersFromCuda(bits);
    const bool ok = differs ? ours == 0x7FC0 && cuda == 0x7FFF : ours == cuda;
    differing += differs;
    if (!ok && failed++ < 10) CheckBf16(bits);
  }
  EXPECT_EQ(failed, 0u);
  EXPECT_EQ(differing, SweptIn(0x7F800001u, 0x7FFFFFFFu) + SweptIn(0xFF800001u, 0xFFFFFFFFu));
}

TEST(DecodeVsCuda, EveryE4m3AndE2m1Code) {
  for (int b = 0; b < 256; ++b) {
    const __half h = __nv_cvt_fp8_to_halfraw(static_cast<uint8_t>(b), __NV_E4M3);
    const float cuda = __half2float(h);
    const float ours = E4m3ToFloat(static_cast<uint8_t>(b));
    if (E4m3IsNan(static_cast<uint8_t>(b))) {
      EXPECT_TRUE(std::isnan(cuda)) << b;
    } else {
      EXPECT_EQ(FloatBits(ours), FloatBits(cuda)) << b;
    }
  }
  for (int c = 0; c < 16; ++c) {
    const __half h = __nv_cvt_fp4_to_halfraw(static_cast<uint8_t>(c), __NV_E2M1);
    EXPECT_EQ(FloatBits(E2m1ToFloat(static_cast<uint8_t>(c))), FloatBits(__half2float(h))) << c;
  }
}

#endif  // QUANTD_HAVE_CUDA_HEADERS

// ---- NVFP4 blocks computed by hand ------------------------------------------------------------

// One 16-element block quantized by the reference with a given weight_scale_2.
struct Nvfp4Block {
  uint8_t scale = 0;
  uint8_t packed[8] = {};
};

Nvfp4Block Quantize(const float (&x)[16], float scale_2) {
  Nvfp4Block b;
  const kernels::DenseTensor src{x, kernels::FloatType::kF32, 1, 16};
  const kernels::Nvfp4Out dst{b.packed, &b.scale, nullptr};
  EXPECT_EQ(kernels::reference::Nvfp4QuantizeRows(src, scale_2, dst, 0, 1), -1);
  return b;
}

void ExpectBlock(const Nvfp4Block& got, uint8_t scale, const uint8_t (&packed)[8]) {
  EXPECT_EQ(got.scale, scale);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got.packed[i], packed[i]) << "byte " << i;
}

TEST(Nvfp4, GlobalScale) {
  EXPECT_EQ(Nvfp4GlobalScale(2688.0f), 1.0f);
  EXPECT_EQ(Nvfp4GlobalScale(5376.0f), 2.0f);
  // amax = 0 uses amax = 1: float32(1 / 2688) = 0x39C30C31 (3.720238e-4).
  EXPECT_EQ(FloatBits(Nvfp4GlobalScale(0.0f)), 0x39C30C31u);
  EXPECT_EQ(Nvfp4GlobalScale(0.0f), Nvfp4GlobalScale(1.0f));
  // amax = 2^-149 (the smallest float) / 2688 underflows to 0: the smallest float is used, and
  // the block scale 2^-149 / (6 * 2^-149) = 1/6 rounds to E4M3 0x23 (exponent field 4 = 2^-3,
  // mantissa 3: 1.375 * 2^-3 = 0.171875, nearer 1/6 than 1.25 * 2^-3).
  const float tiny = Exp2Int(-149);
  EXPECT_EQ(Nvfp4GlobalScale(tiny), tiny);
  EXPECT_EQ(Nvfp4BlockScale(tiny, Nvfp4GlobalScale(tiny)), 0x23);
  // 2^-137 / 2688 is still a positive subnormal: no substitution.
  EXPECT_GT(Nvfp4GlobalScale(Exp2Int(-137)), 0.0f);
  EXPECT_NE(Nvfp4GlobalScale(Exp2Int(-137)), tiny);
}

TEST(Nvfp4, AllZeroTensor) {
  // amax 0 -> scale_2 = 1/2688; each block amax 0 -> s = 0 -> 1.0 -> E4M3 0x38 (exp 7, mant 0);
  // every code 0, which decodes to +0 exactly.
  const float zeros[32] = {};
  uint8_t scales[2] = {0xAA, 0xAA}, packed[16];
  const float scale_2 = Nvfp4GlobalScale(0.0f);
  const kernels::DenseTensor src{zeros, kernels::FloatType::kF32, 1, 32};
  const kernels::Nvfp4Out dst{packed, scales, nullptr};
  ASSERT_EQ(kernels::reference::Nvfp4QuantizeRows(src, scale_2, dst, 0, 1), -1);
  EXPECT_EQ(scales[0], 0x38);
  EXPECT_EQ(scales[1], 0x38);
  for (uint8_t p : packed) EXPECT_EQ(p, 0x00);
  EXPECT_EQ(FloatBits(Nvfp4Decode(0x0, 0x38, scale_2)), 0u);
}

TEST(Nvfp4, ThresholdsTimesTheBlockDivisor) {
  // scale_2 = 1, block amax 12 -> s = 12 / 6 = 2 = E4M3 0x40 -> divisor d = 2. Every value is
  // (threshold * d), so x / d hits 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 exactly; multiplying by 2
  // is exact, so Up/Down of the products land just above/below the thresholds.
  const float t[8] = {0.5f, 1.5f, 2.5f, 3.5f, 5.0f, 7.0f, 10.0f, 12.0f};
  float on[16], above[16], below[16];
  for (int i = 0; i < 8; ++i) {
    on[i] = t[i];
    on[i + 8] = -t[i];
    above[i] = i < 7 ? Up(t[i]) : t[i];  // keep 12 itself so the block amax stays 12
    above[i + 8] = -above[i];
    below[i] = i < 7 ? Down(t[i]) : t[i];
    below[i + 8] = -below[i];
  }
  // Ties: 0.25->0, 0.75->2 (1.0), 1.25->2, 1.75->4 (2.0), 2.5->4, 3.5->6 (4.0), 5->6, 6->7; then
  // the same with the sign bit. Packed low nibble first: (0,2) (2,4) (4,6) (6,7) (8,A) (A,C)
  // (C,E) (E,F).
  ExpectBlock(Quantize(on, 1.0f), 0x40, {0x20, 0x42, 0x64, 0x76, 0xA8, 0xCA, 0xEC, 0xFE});
  // Just above: 1, 2, 3, 4, 5, 6, 7, 7 (and 9, A, B, C, D, E, F, F).
  ExpectBlock(Quantize(above, 1.0f), 0x40, {0x21, 0x43, 0x65, 0x77, 0xA9, 0xCB, 0xED, 0xFF});
  // Just below: 0, 1, 2, 3, 4, 5, 6, 7 (and 8 .. F).
  ExpectBlock(Quantize(below, 1.0f), 0x40, {0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE});
}

TEST(Nvfp4, NegativesRoundingToMinusZero) {
  // scale_2 = 1, block amax 6 -> s = 1 = 0x38, d = 1.
  // -0.0 -> 0x0 (not < 0); -0.1, -0.25, -1e-30 -> 0x8 (sign before rounding); 0.1, 0.25 -> 0x0;
  // 6 -> 0x7. Pairs: (-0.0, -0.1)=(0,8) (-0.25, 0)=(8,0) (0.1, 0.25)=(0,0) (-1e-30, 6)=(8,7),
  // then zeros.
  const float x[16] = {-0.0f, -0.1f, -0.25f, 0.0f, 0.1f, 0.25f, -1e-30f, 6.0f};
  ExpectBlock(Quantize(x, 1.0f), 0x38, {0x80, 0x08, 0x00, 0x78, 0x00, 0x00, 0x00, 0x00});
}

TEST(Nvfp4, BlockScaleBelowTwoToMinusNineIsClamped) {
  // scale_2 = 1, block amax 6 * 2^-11 -> s = 2^-11 < 2^-9 -> clamped to 2^-9 = E4M3 0x01 (the
  // smallest subnormal, never 0). d = 2^-9, so the values k * 2^-11 encode x / d = k / 4:
  // 1.5 -> 3, 0.25 -> 0, 0.5 -> 1, 0.75 -> 2 (tie to even), 1.0 -> 2, 1.25 -> 2 (tie),
  // -1.5 -> B, -0.75 -> A. Pairs (3,0)=0x03 (1,2)=0x21 (2,2)=0x22 (B,A)=0xAB.
  const float q = std::ldexp(1.0f, -11);
  const float x[16] = {6 * q, 1 * q, 2 * q, 3 * q, 4 * q, 5 * q, -6 * q, -3 * q};
  ExpectBlock(Quantize(x, 1.0f), 0x01, {0x03, 0x21, 0x22, 0xAB, 0x00, 0x00, 0x00, 0x00});
  EXPECT_EQ(Nvfp4BlockScale(0.9f * std::ldexp(1.0f, -9), 1.0f / 6.0f), 0x01);
  EXPECT_EQ(Nvfp4BlockScale(std::ldexp(1.0f, -140), 1.0f), 0x01);
}

TEST(Nvfp4, BlockScaleAtOrAbove464IsClampedTo448) {
  // Without the clamp these would round to E4M3's NaN code 0x7F (s > 464).
  EXPECT_EQ(Nvfp4BlockScale(6.0f * 464.0f, 1.0f), 0x7E);  // s = 464 exactly
  EXPECT_EQ(Nvfp4BlockScale(6.0f * 470.0f, 1.0f), 0x7E);
  EXPECT_EQ(Nvfp4BlockScale(6.0f * 480.0f, 1.0f), 0x7E);
  EXPECT_EQ(Nvfp4BlockScale(1e30f, 1.0f), 0x7E);
  EXPECT_EQ(Nvfp4BlockScale(6.0f * 448.0f, 1.0f), 0x7E);
  // A supplied global amax of 1 (scale_2 = 1/2688) below the block's own amax 2:
  // s = 2 / (6 / 2688) = 895.99994 -> 448; d = float32(448 / 2688) = 0.16666667, so
  // 2 / d = 12 -> 7 (saturated), 0.5 / d = 3 -> 5, 0.25 / d = 1.5 -> 3, -2 -> F.
  const float x[16] = {2.0f, -2.0f, 0.5f, 0.25f};
  ExpectBlock(Quantize(x, Nvfp4GlobalScale(1.0f)), 0x7E,
              {0xF7, 0x35, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00});
}

TEST(Nvfp4, BlockScaleRoundsToNearestEven) {
  // scale_2 = 1, block amax 6.375 -> s = 1.0625, halfway between E4M3 1.0 (0x38) and 1.125
  // (0x39) -> even 0x38; d = 1, so 6.375 saturates to code 7 and 1.0625 -> 2 (1.0).
  const float x[16] = {6.375f, 1.0625f};
  ExpectBlock(Quantize(x, 1.0f), 0x38, {0x27, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00});
}

TEST(Nvfp4, DecodeMultipliesCodeScaleAndScale2) {
  EXPECT_EQ(Nvfp4Decode(0x7, 0x7E, 1.0f), 6.0f * 448.0f);
  EXPECT_EQ(Nvfp4Decode(0xF, 0x40, 0.5f), -6.0f);
  EXPECT_EQ(Nvfp4Decode(0x1, 0x01, 1.0f), std::ldexp(1.0f, -10));
  EXPECT_EQ(FloatBits(Nvfp4Decode(0x8, 0x38, 1.0f)), 0x80000000u);
}

// ---- DeepSeek power-of-two scales -------------------------------------------------------------

// ceil(log2(x)) from frexp (x = m * 2^e with m in [0.5, 1)), independent of CeilLog2's bit logic.
int FrexpCeilLog2(float x) {
  int e;
  const float m = std::frexp(x, &e);
  return m == 0.5f ? e - 1 : e;
}

TEST(CeilLog2, PowersOfTwoAndNeighbours) {
  for (int k = -149; k <= 127; ++k) {
    const float p = std::ldexp(1.0f, k);
    EXPECT_EQ(CeilLog2(p), k) << k;
    EXPECT_EQ(CeilLog2(Up(p)), k + 1) << k;
    // Below 2^-147 the next pattern down is a power of two itself (2^-148 - 2^-149 = 2^-149).
    if (k > -148) {
      EXPECT_EQ(CeilLog2(Down(p)), k) << k;
    }
  }
  EXPECT_EQ(CeilLog2(BitsToFloat(3)), -147);           // 3 * 2^-149
  EXPECT_EQ(CeilLog2(BitsToFloat(0x007FFFFFu)), -126);  // largest subnormal
  EXPECT_EQ(CeilLog2(std::numeric_limits<float>::max()), 128);
  EXPECT_EQ(CeilLog2(1.5f), 1);
}

TEST(CeilLog2, SweepMatchesFrexp) {
  // Every 7th positive finite pattern, subnormals included.
  for (uint32_t u = 1; u < 0x7F800000u; u += 7) {
    const float x = BitsToFloat(u);
    if (CeilLog2(x) != FrexpCeilLog2(x)) {
      ADD_FAILURE() << std::hex << u;
      break;
    }
  }
}

TEST(E8m0ScaleForAmax, PowersOfTwoAndJustAbove) {
  // amax = 6 * 2^k: amax / 6 = 2^k exactly -> byte 127 + k, clamped to [0, 254].
  for (int k = -146; k <= 125; ++k) {
    const float amax = 6.0f * std::ldexp(1.0f, k);
    const int want = std::min(std::max(k, -127), 127) + 127;
    EXPECT_EQ(E8m0ScaleForAmax(amax, 6.0f, 0.0f), want) << k;
  }
  // One ulp above 6 * 2^k: the quotient rounds to 2^k (1 + 2^-23) (the ulp is 2/3 of 2^k's ulp,
  // more than half), so the exponent goes up by one, wherever 2^k is normal.
  for (int k = -126; k <= 125; ++k) {
    const float amax = Up(6.0f * std::ldexp(1.0f, k));
    EXPECT_EQ(E8m0ScaleForAmax(amax, 6.0f, 0.0f), std::min(k + 1, 127) + 127) << k;
  }
  // FP8 weights: 448 -> 1.0 (127); 449 -> 2^1 (128); 224 -> 2^-1 (126).
  EXPECT_EQ(E8m0ScaleForAmax(448.0f, 448.0f, 1e-4f), 127);
  EXPECT_EQ(E8m0ScaleForAmax(449.0f, 448.0f, 1e-4f), 128);
  EXPECT_EQ(E8m0ScaleForAmax(224.0f, 448.0f, 1e-4f), 126);
  // All-zero block: amax floored at 1e-4; 1e-4 / 448 = 2.23e-7 lies in (2^-23, 2^-22] -> 105.
  EXPECT_EQ(E8m0ScaleForAmax(0.0f, 448.0f, 1e-4f), 105);
  // Quotient overflowing to +inf clamps to 2^127 (254).
  EXPECT_EQ(E8m0ScaleForAmax(std::numeric_limits<float>::max(), 0.5f, 0.0f), 254);
}

}  // namespace
}  // namespace quantd::formats
