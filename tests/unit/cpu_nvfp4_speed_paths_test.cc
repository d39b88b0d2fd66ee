// Every SIMD level of the CPU backend against its scalar level, byte for byte, on inputs aimed at
// the shortcuts the vectorized NVFP4 kernels take (kernels/cpu/row_kernels_avx512.cc and
// row_kernels_avx2.cc): quotients a few bit steps either side of every E2M1 rounding threshold
// and of every other 2^21-step bucket boundary, exact ties, zero and subnormal elements and
// blocks, block maxima a few steps either side of every E4M3 rounding midpoint and clamp bound,
// block scales that divide to 0, divisors d >= 2, quotients that overflow, and weight_scale_2 at
// and beyond the ends of the range the shortcuts accept; and every (scale byte, code) pair
// through NVFP4 decoding, with products that are subnormal or overflow.
#include <gtest/gtest.h>
#include <stdint.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/backends.h"
#include "kernels/formats.h"
#include "tests/unit/test_vectors.h"

namespace quantd::kernels {
namespace {

using formats::BitsToFloat;
using formats::FloatBits;
using test_vectors::Dense;

constexpr int64_t kCols = 16 * 37;  // 37 blocks a row: groups of blocks straddle rows

struct LevelParam {
  std::string label;
  SimdLevel simd = SimdLevel::kScalar;
  int threads = 1;
};

void PrintTo(const LevelParam& p, std::ostream* os) { *os << p.label; }

// Every SIMD level above scalar on 1 and 3 threads (3 splits rows unevenly).
std::vector<LevelParam> SimdLevels() {
  std::vector<LevelParam> params;
  for (SimdLevel level : SupportedSimdLevels()) {
    if (level == SimdLevel::kScalar) continue;
    const char* name = level == SimdLevel::kAvx2 ? "avx2" : "avx512";
    for (int threads : {1, 3})
      params.push_back({absl::StrCat(name, "_t", threads), level, threads});
  }
  return params;
}

// The float whose bit pattern is `steps` steps from v's (toward larger magnitude for steps > 0).
float Steps(float v, int steps) { return BitsToFloat(FloatBits(v) + steps); }

// One NVFP4 encoding as bytes.
struct Encoded {
  std::vector<uint8_t> data;
  std::vector<uint8_t> scales;
  float scale_2 = 0.0f;
};

// Values appended a block at a time; becomes a [rows, kCols] tensor padded with zero blocks.
class Blocks {
 public:
  explicit Blocks(FloatType type) : type_(type) {}

  // A block of `first` then as many of `rest` as fit (zeros after). Values must be exact in the
  // tensor's type.
  void Add(float first, const std::vector<float>& rest) {
    values_.push_back(first);
    for (int j = 1; j < kNvfp4BlockSize; ++j) {
      values_.push_back(j - 1 < static_cast<int>(rest.size()) ? rest[j - 1] : 0.0f);
    }
  }
  // Blocks of `first` and 15 of `rest` each, until `rest` is used up.
  void AddAll(float first, const std::vector<float>& rest) {
    for (size_t i = 0; i < rest.size(); i += kNvfp4BlockSize - 1) {
      Add(first,
          std::vector<float>(rest.begin() + i, rest.begin() + std::min(rest.size(), i + 15)));
    }
  }
  Dense Tensor() const {
    const int64_t rows = (static_cast<int64_t>(values_.size()) + kCols - 1) / kCols;
    Dense t(type_, rows, kCols);
    for (size_t i = 0; i < values_.size(); ++i) t.Set(i / kCols, i % kCols, values_[i]);
    return t;
  }

 private:
  FloatType type_;
  std::vector<float> values_;  // row-major elements
};

// A block max |x| whose block gets scale byte `byte` (where the clamp allows) without itself
// dividing to a bucket boundary (6 * (1 + 2^-6) rather than 6), so that pairs of blocks need
// not take the kernels' exact path for its sake. Rounded to the tensor's type.
float BlockMax(uint8_t byte, float scale_2, FloatType type) {
  const float m = formats::E4m3ToFloat(byte) * (6.0f * 1.015625f) * scale_2;
  return type == FloatType::kF32 ? m : formats::Bf16ToFloat(formats::FloatToBf16(m));
}

// The block scale and divisor d = float(scale) * scale_2 of a block whose max |x| is m.
float Divisor(float m, float scale_2) {
  return formats::E4m3ToFloat(formats::Nvfp4BlockScale(m, scale_2)) * scale_2;
}

// Whether x is exact in the tensor's type.
bool Representable(FloatType type, float x) {
  return type == FloatType::kF32 || formats::Bf16ToFloat(formats::FloatToBf16(x)) == x;
}

// Global maxima covering weight_scale_2 from below 2^-100 (where the SIMD kernels hand over to
// the reference) through powers of two (exact ties) to above 2^100.
std::vector<float> GlobalMaxima() {
  return {0.0f,      // scale_2 = 1/2688
          2688.0f,   // scale_2 = 1: d = float(scale), up to 448
          21.0f,     // scale_2 = 2^-7
          70.3125f,  // a typical expert's amax
          0.37f,
          2688.0f * 0x1p-99f,   // scale_2 = 2^-99
          2688.0f * 0x1p-100f,  // scale_2 = 2^-100, the smallest the shortcuts take
          2688.0f * 0x1p-101f,  // below it
          2688.0f * 0x1p-120f,  // far below: subnormal inputs then have nonzero codes
          2688.0f * 0x1p20f,    // scale_2 = 2^20: d >= 2^17 for BF16 subnormals
          2688.0f * 0x1p100f,   // scale_2 = 2^100, the largest the shortcuts take
          2688.0f * 0x1p101f};  // above it
}

// E4M3 scale bytes to aim blocks at: both clamp bounds, subnormal and normal scales.
constexpr uint8_t kScaleBytes[] = {0x01, 0x02, 0x05, 0x07, 0x08, 0x09, 0x30,
                                   0x38, 0x3B, 0x40, 0x48, 0x55, 0x7D, 0x7E};

class Nvfp4SpeedPathsTest : public ::testing::TestWithParam<LevelParam> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> b =
        MakeCpuBackend({GetParam().threads, GetParam().simd});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
    absl::StatusOr<std::unique_ptr<Backend>> s = MakeCpuBackend({1, SimdLevel::kScalar});
    ASSERT_TRUE(s.ok()) << s.status();
    scalar_ = *std::move(s);
  }

  static Encoded Quantize(Backend& backend, const Dense& t, float global_amax) {
    const int64_t n = t.rows * t.cols;
    Encoded e;
    e.data.assign(n / 2, 0xAA);
    e.scales.assign(n / kNvfp4BlockSize, 0xAA);
    const absl::Status s = backend.Nvfp4Quantize(t.View(t.bytes.data()), GlobalAmax(global_amax),
                                                 {e.data.data(), e.scales.data(), &e.scale_2});
    EXPECT_TRUE(s.ok()) << backend.name() << ": " << s;
    return e;
  }

  // The level under test encodes `blocks` with `global_amax` exactly as the scalar level does.
  void ExpectSameQuantize(const Blocks& blocks, float global_amax) {
    const Dense t = blocks.Tensor();
    const Encoded got = Quantize(*backend_, t, global_amax);
    const Encoded want = Quantize(*scalar_, t, global_amax);
    const std::string where = absl::StrCat("global amax ", global_amax);
    EXPECT_EQ(got.scale_2, want.scale_2) << where;
    for (size_t b = 0; b < want.scales.size(); ++b) {
      ASSERT_EQ(got.scales[b], want.scales[b]) << where << ", block " << b << ", max element "
                                               << t.Get(b * 16 / t.cols, b * 16 % t.cols);
    }
    for (size_t i = 0; i < want.data.size(); ++i) {
      ASSERT_EQ(got.data[i], want.data[i])
          << where << ", elements " << 2 * i << ", " << 2 * i + 1 << ": "
          << t.Get(2 * i / t.cols, 2 * i % t.cols) << ", "
          << t.Get((2 * i + 1) / t.cols, (2 * i + 1) % t.cols) << ", block scale byte "
          << static_cast<int>(want.scales[2 * i / kNvfp4BlockSize]);
    }
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Backend> scalar_;
};

// Quotients x / d up to 12 bit steps either side of every multiple of 2^21 between 2^-4 and 16
// (each E2M1 threshold, exact ties included, and every other bucket boundary), both signs, for
// blocks aimed at each scale byte under each weight_scale_2. F32: x itself is stepped. The
// blocks of one step count k are adjacent, so that pairs of blocks far enough from every
// boundary take the kernels' fast path.
TEST_P(Nvfp4SpeedPathsTest, QuotientsAroundEveryBucketBoundaryF32) {
  for (float g : GlobalMaxima()) {
    const float scale_2 = formats::Nvfp4GlobalScale(g);
    Blocks blocks(FloatType::kF32);
    for (uint8_t byte : kScaleBytes) {
      const float m = BlockMax(byte, scale_2, FloatType::kF32);
      if (!formats::IsFinite(m) || !(m > 0.0f)) continue;
      const float d = Divisor(m, scale_2);
      for (int k = -12; k <= 12; ++k) {
        std::vector<float> rest;
        for (uint32_t boundary = 0x3D800000; boundary <= 0x41800000; boundary += 1u << 21) {
          const float x = Steps(BitsToFloat(boundary) * d, k);
          if (!formats::IsFinite(x) || !(formats::AbsF(x) <= m)) continue;
          rest.push_back(x);
          rest.push_back(-x);
        }
        blocks.AddAll(m, rest);
        blocks.AddAll(-m, rest);
      }
    }
    ExpectSameQuantize(blocks, g);
  }
}

// The elements x, among x = RN(B * d) and up to 12 bit steps either side of it for every 2^21
// step B, whose quotient estimated as the kernels do, through a reciprocal biased up by 2^-21,
// RN(x * RN(RN(1 / d) * (1 + 2^-21))), is 8 or more bit steps above RN(x / d) or in another
// bucket, for blocks aimed at every E4M3 scale byte.
TEST_P(Nvfp4SpeedPathsTest, WorstReciprocalEstimates) {
  for (float g : {2688.0f, 70.3125f, 0.37f, 2688.0f * 0x1p-77f}) {
    const float scale_2 = formats::Nvfp4GlobalScale(g);
    Blocks blocks(FloatType::kF32);
    int found = 0;
    for (int byte = 1; byte <= 0x7E; ++byte) {
      const float m = BlockMax(byte, scale_2, FloatType::kF32);
      const float d = Divisor(m, scale_2);
      const float r = (1.0f / d) * (1.0f + 0x1p-21f);
      std::vector<float> rest;
      for (uint32_t boundary = 0x3D800000; boundary <= 0x41800000; boundary += 1u << 21) {
        for (int k = -12; k <= 12; ++k) {
          const float x = Steps(BitsToFloat(boundary) * d, k);
          if (!(x <= m)) continue;
          const int64_t q = FloatBits(x / d), estimate = FloatBits(x * r);
          if (estimate - q >= 8 || (q >> 21) != (estimate >> 21)) {
            rest.push_back(x);
            rest.push_back(-x);
          }
        }
      }
      found += static_cast<int>(rest.size());
      blocks.AddAll(m, rest);
    }
    EXPECT_GT(found, 0) << "global amax " << g;
    ExpectSameQuantize(blocks, g);
  }
}

// One element a few bit steps either side of a rounding threshold per block, its other elements
// far from every bucket boundary, so that the kernels' fast path sees it alone (they fall back
// to dividing a whole pair of blocks or block where one element is near a boundary).
TEST_P(Nvfp4SpeedPathsTest, IsolatedElementsAroundThresholds) {
  static constexpr float kThresholds[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  for (float g : {2688.0f, 70.3125f, 2688.0f * 0x1p-77f}) {
    const float scale_2 = formats::Nvfp4GlobalScale(g);
    Blocks blocks(FloatType::kF32);
    for (int byte = 1; byte <= 0x7E; ++byte) {
      const float m = BlockMax(byte, scale_2, FloatType::kF32);
      const float d = Divisor(m, scale_2);
      const float filler = 0.3f * d;  // quotient about 0.3, between boundaries 0.28125 and 0.3125
      for (float t : kThresholds) {
        for (int k = -14; k <= 14; ++k) {
          const float x = Steps(t * d, k);
          if (!(x <= m)) continue;
          for (float sign : {1.0f, -1.0f}) {
            blocks.Add(m, {sign * x, filler, -filler, filler, -filler, filler, -filler, filler,
                           -filler, filler, -filler, filler, -filler, filler, -filler});
          }
        }
      }
    }
    ExpectSameQuantize(blocks, g);
  }
}

// BF16: every BF16 value from 2^-4 * d up to the block's max, both signs, for the same blocks;
// with power-of-two weight_scale_2 and scales, many quotients are ties.
TEST_P(Nvfp4SpeedPathsTest, EveryBf16QuotientNearTheThresholds) {
  for (float g : GlobalMaxima()) {
    const float scale_2 = formats::Nvfp4GlobalScale(g);
    Blocks blocks(FloatType::kBF16);
    for (uint8_t byte : kScaleBytes) {
      const float m = BlockMax(byte, scale_2, FloatType::kBF16);
      if (!formats::IsFinite(m) || !(m > 0.0f)) continue;
      const float d = Divisor(m, scale_2);
      std::vector<float> rest;
      for (uint32_t b = formats::FloatToBf16(d * 0.0625f); b <= formats::FloatToBf16(m); ++b) {
        const float x = formats::Bf16ToFloat(static_cast<uint16_t>(b));
        if (!(x <= m)) continue;
        rest.push_back(x);
        rest.push_back(-x);
      }
      blocks.AddAll(m, rest);
    }
    ExpectSameQuantize(blocks, g);
  }
}

// Zero and subnormal elements, alone and among normal ones, in blocks whose d is below 2, exactly
// 2, and far above it; where d >= 2 a subnormal's code hangs on 2k > d for x = -k * 2^-149.
TEST_P(Nvfp4SpeedPathsTest, ZeroAndSubnormalElements) {
  const float tiny = 0x1p-149f;
  for (FloatType type : {FloatType::kF32, FloatType::kBF16}) {
    for (float g :
         {2688.0f, 70.3125f, 2688.0f * 0x1p14f, 2688.0f * 0x1p20f, 0.0f, 2688.0f * 0x1p-120f}) {
      const float scale_2 = formats::Nvfp4GlobalScale(g);
      Blocks blocks(type);
      for (uint8_t byte : kScaleBytes) {
        const float m = BlockMax(byte, scale_2, type);
        if (!formats::IsFinite(m) || !(m > 0.0f)) continue;
        const float d = Divisor(m, scale_2);
        std::vector<float> rest = {0.0f,
                                   -0.0f,
                                   tiny,
                                   -tiny,
                                   -2 * tiny,
                                   0x1p-126f - tiny,
                                   -(0x1p-126f - tiny),
                                   0x1p-133f,
                                   -0x1p-133f,
                                   -0x1p-127f,
                                   0.3f * d,
                                   -2.6f * d};
        // Around the tie 2k = d (as far as k < 2^23 reaches).
        for (float k : {d / 2 - 2, d / 2 - 1, d / 2, d / 2 + 1, d / 2 + 2, d, 2 * d}) {
          if (k >= 1.0f && k < 0x1p23f) {
            for (float sign : {1.0f, -1.0f}) rest.push_back(sign * k * tiny);
          }
        }
        for (float& x : rest) {
          if (!Representable(type, x)) x = -0.0f;
        }
        blocks.AddAll(m, rest);
        blocks.AddAll(-m, rest);
        // A run of blocks long enough to fill a group with this d alone.
        for (int i = 0; i < 40; ++i) blocks.Add(m, {-tiny, tiny, -2 * tiny, -0.0f, 0x1p-133f});
      }
      // Blocks of nothing but zeros and subnormals (scale 2^-9, or 1 where m / D is 0).
      blocks.Add(0.0f, {});
      blocks.Add(-0.0f, {-0.0f, -0.0f});
      blocks.Add(-tiny, {tiny, 0.0f, -0.0f});
      blocks.Add(-0x1p-133f, {0x1p-140f, -0x1p-145f, -0x1p-130f, 0x1p-127f});
      for (int k = 1; k <= 40; ++k) {
        if (Representable(type, k * tiny)) blocks.Add(-k * tiny, {-tiny, tiny, -0.0f});
      }
      ExpectSameQuantize(blocks, g);
    }
  }
}

// Block maxima whose quotient m / D lies up to 10 bit steps either side of every E4M3 rounding
// midpoint, of the clamp bounds 2^-9 and 448, and of each scale value itself; plus maxima whose
// quotient is 0 (D >= 2 and m = k * 2^-149 <= D * 2^-150) or overflows.
TEST_P(Nvfp4SpeedPathsTest, BlockMaximaAroundEveryScaleBoundary) {
  for (float g : {2688.0f, 70.3125f, 0.37f, 2688.0f * 0x1p-99f, 2688.0f * 0x1p99f}) {
    const float scale_2 = formats::Nvfp4GlobalScale(g);
    const float scale_div = 6.0f * scale_2;
    Blocks blocks(FloatType::kF32);
    std::vector<float> quotients = {0x1p-9f, 448.0f, 464.0f};
    for (int c = 1; c < 0x7E; ++c) {
      const float lo = formats::E4m3ToFloat(c), hi = formats::E4m3ToFloat(c + 1);
      quotients.push_back(lo);
      quotients.push_back((lo + hi) / 2);
    }
    for (float quotient : quotients) {
      for (int k = -10; k <= 10; ++k) {
        const float m = Steps(quotient * scale_div, k);
        if (!formats::IsFinite(m)) continue;
        blocks.Add(m, {-m, 0.5f * m, -0.26f * m, 0.126f * m});
      }
    }
    for (int k = 1; k <= 16; ++k) blocks.Add(k * 0x1p-149f, {-0x1p-149f});
    blocks.Add(3.0e38f, {-3.0e38f, 1.0f, -1.0e-30f, 0.0f});
    ExpectSameQuantize(blocks, g);
  }
}

// Realistic tensors (outlier columns, zero, subnormal and near-empty blocks) of both types, with
// their own amax and with a shared one 3x larger, cut into uneven thread ranges.
TEST_P(Nvfp4SpeedPathsTest, RandomWeights) {
  for (FloatType type : {FloatType::kBF16, FloatType::kF32}) {
    const Dense t = test_vectors::RandomWeights(type, 67, kCols, 11);
    float amax = 0.0f;
    for (int64_t i = 0; i < t.rows * t.cols; ++i) {
      amax = std::max(amax, formats::AbsF(t.Get(i / t.cols, i % t.cols)));
    }
    for (float g : {amax, 3.0f * amax}) {
      const Encoded got = Quantize(*backend_, t, g);
      const Encoded want = Quantize(*scalar_, t, g);
      EXPECT_EQ(got.scale_2, want.scale_2);
      EXPECT_EQ(got.scales, want.scales);
      EXPECT_EQ(got.data, want.data);
    }
  }
}

// Every scale byte but the two NaNs, under each code, through decoding to BF16 and F32, with
// weight_scale_2 making products normal, subnormal, and overflow to inf; 33 blocks a row leaves
// an odd block at the end of each thread's range.
TEST_P(Nvfp4SpeedPathsTest, DecodeEveryScaleAndCode) {
  const int64_t cols = 16 * 33;
  const int64_t rows = 64;
  std::vector<uint8_t> data(rows * cols / 2), scales(rows * cols / 16);
  for (size_t b = 0; b < scales.size(); ++b) {
    scales[b] = static_cast<uint8_t>(b % 256);
    if (formats::E4m3IsNan(scales[b])) scales[b] = static_cast<uint8_t>(b / 256);
  }
  for (size_t i = 0; i < data.size(); ++i) {
    data[i] = static_cast<uint8_t>((2 * i + i / 8) % 16 | ((2 * i + 1 + i / 8) % 16) << 4);
  }
  for (float scale_2 : {1.0f, 0.0137f, 0x1p-130f, 3.0e-39f, 0x1p-149f, 1.0e36f, 3.4e38f}) {
    const Nvfp4Tensor src = {data.data(), scales.data(), scale_2, rows, cols};
    for (FloatType type : {FloatType::kBF16, FloatType::kF32}) {
      const size_t size = rows * cols * (type == FloatType::kF32 ? 4 : 2);
      std::vector<uint8_t> got(size, 0xAA), want(size, 0x55);
      ASSERT_TRUE(backend_->Nvfp4Dequant(src, {got.data(), type}).ok());
      ASSERT_TRUE(scalar_->Nvfp4Dequant(src, {want.data(), type}).ok());
      for (size_t i = 0; i < size; ++i) {
        ASSERT_EQ(got[i], want[i]) << "scale_2 " << scale_2 << ", byte " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, Nvfp4SpeedPathsTest, ::testing::ValuesIn(SimdLevels()),
                         [](const ::testing::TestParamInfo<LevelParam>& info) {
                           return info.param.label;
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Nvfp4SpeedPathsTest);

}  // namespace
}  // namespace quantd::kernels
