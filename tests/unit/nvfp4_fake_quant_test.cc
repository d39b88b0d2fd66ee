// kernels/nvfp4_fake_quant.h against values computed by hand from the runtime's formula, and
// against the weight path (reference::Nvfp4QuantizeRows, the ModelOpt export bytes) on blocks
// where the two formulas coincide: block scales in [2^-9, 448].
#include "kernels/nvfp4_fake_quant.h"

#include <gtest/gtest.h>
#include <stdint.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/formats.h"
#include "kernels/reference.h"
#include "kernels/tensor_views.h"

namespace quantd::kernels {
namespace {

std::vector<float> FakeQuant(std::vector<float> x, float input_scale) {
  const absl::Status s = Nvfp4FakeQuantRows(x.data(), 1, static_cast<int64_t>(x.size()),
                                            static_cast<int64_t>(x.size()), input_scale);
  EXPECT_TRUE(s.ok()) << s;
  return x;
}

TEST(Nvfp4FakeQuant, RoundsEachValueOnItsBlockScale) {
  // input_scale 1, block amax 12: s = 12 / 6 = 2 (E4M3 exact), d = 2. x / d = 6, 3, 1.5, -0.75
  // (tie -> 1), 0.35, 0.4, 0.1, 0.13, 4.5 (-> 4), 2.25 (-> 2), 0.25 (tie -> 0), 1.25 (tie -> 1),
  // 1.75 (tie -> 2), -5.5 (-> -6), 2.75 (-> 3), 0. Times d.
  const std::vector<float> x = {12, 6, 3, -1.5, 0.7, 0.8, 0.2, 0.26, 9, 4.5, 0.5, 2.5, 3.5, -11,
                                5.5, 0};
  const std::vector<float> want = {12, 6, 3, -2, 1, 1, 0, 0, 8, 4, 0, 2, 4, -12, 6, 0};
  EXPECT_EQ(FakeQuant(x, 1.0f), want);
}

TEST(Nvfp4FakeQuant, GlobalScaleDividesTheBlockScale) {
  // input_scale 0.5: s = 12 / (6 * 0.5) = 4, d = 4 * 0.5 = 2: the same codes as above.
  std::vector<float> x(16, 0.0f);
  x[0] = 12;
  x[1] = -3;
  x[2] = 1.4f;  // 0.7 -> 0.5
  std::vector<float> want(16, 0.0f);
  want[0] = 12;
  want[1] = -3;
  want[2] = 1;
  EXPECT_EQ(FakeQuant(x, 0.5f), want);
}

TEST(Nvfp4FakeQuant, ScaleSaturatesAt448) {
  // input_scale 1, amax 6000: s = 1000 -> 448, d = 448; 6000 / 448 = 13.4 -> 6 -> 2688;
  // 448 / 448 = 1 -> 448; 100 / 448 = 0.22 -> 0.
  std::vector<float> x(16, 0.0f);
  x[0] = 6000;
  x[1] = -448;
  x[2] = 100;
  std::vector<float> want(16, 0.0f);
  want[0] = 2688;
  want[1] = -448;
  EXPECT_EQ(FakeQuant(x, 1.0f), want);
}

TEST(Nvfp4FakeQuant, BlockWhoseScaleRoundsToZeroBecomesZeros) {
  // input_scale 1, amax 0.005: s = 0.000833 < 2^-10 rounds to E4M3 0: zeros (the weight path
  // would clamp s to 2^-9 and keep the values).
  std::vector<float> x(16, 0.001f);
  x[3] = -0.005f;
  EXPECT_EQ(FakeQuant(x, 1.0f), std::vector<float>(16, 0.0f));
  // amax 0.006: s = 0.001 rounds to the subnormal 2^-9 (0.001 / 2^-9 = 0.512 -> 1), d = 2^-9:
  // 0.006 / d = 3.07 -> 3, 0.001 / d = 0.512 -> 0.5.
  std::vector<float> y(16, 0.001f);
  y[3] = -0.006f;
  std::vector<float> want(16, 0.5f * std::ldexp(1.0f, -9));
  want[3] = -3 * std::ldexp(1.0f, -9);
  EXPECT_EQ(FakeQuant(y, 1.0f), want);
}

TEST(Nvfp4FakeQuant, RowStrideLeavesThePaddingAlone) {
  // Two rows of 16 with stride 20: the four values after each row are not touched.
  std::vector<float> x(40, 7.0f);
  for (int r = 0; r < 2; ++r) x[r * 20] = 12.0f;  // amax 12, d = 2: 7 / 2 = 3.5 (tie) -> 4 -> 8
  ASSERT_TRUE(Nvfp4FakeQuantRows(x.data(), 2, 16, 20, 1.0f).ok());
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(x[r * 20], 12.0f);
    for (int c = 1; c < 16; ++c) EXPECT_EQ(x[r * 20 + c], 8.0f) << r << "," << c;
    for (int c = 16; c < 20; ++c) EXPECT_EQ(x[r * 20 + c], 7.0f) << r << "," << c;
  }
}

TEST(Nvfp4FakeQuant, AgreesWithTheWeightPathWhereTheScalesAreInRange) {
  // Random rows whose block scales all lie in [2^-9, 448]: the codes and block scales equal the
  // ModelOpt weight quantization with weight_scale_2 = input_scale, so the fake-quantized value
  // is e2m1 * (S * input_scale), the weight path's decode up to the order of the two products
  // (one float32 rounding: 2^-24 relative).
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = 64, cols = 256;
  const float input_scale = 3.0f / 2688.0f;  // amax 3
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (float& v : x) v = std::fmax(-3.0f, std::fmin(3.0f, normal(rng)));
  std::vector<uint8_t> packed(x.size() / 2), scales(x.size() / 16);
  const DenseTensor src{x.data(), FloatType::kF32, rows, cols};
  const Nvfp4Out dst{packed.data(), scales.data(), nullptr};
  ASSERT_EQ(reference::Nvfp4QuantizeRows(src, input_scale, dst, 0, rows), -1);
  std::vector<float> y = x;
  ASSERT_TRUE(Nvfp4FakeQuantRows(y.data(), rows, cols, cols, input_scale).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    const uint8_t s = scales[i / 16];
    ASSERT_GE(formats::E4m3ToFloat(s), std::ldexp(1.0f, -9));
    const uint8_t code = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
    const float want = formats::E2m1ToFloat(code) * (formats::E4m3ToFloat(s) * input_scale);
    ASSERT_EQ(y[i], want) << i;
    ASSERT_NEAR(y[i], formats::Nvfp4Decode(code, s, input_scale), std::fabs(want) * 0x1p-23f) << i;
  }
}

TEST(Nvfp4FakeQuant, RejectsBadArguments) {
  std::vector<float> x(32, 1.0f);
  EXPECT_EQ(Nvfp4FakeQuantRows(x.data(), 1, 20, 20, 1.0f).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Nvfp4FakeQuantRows(x.data(), 1, 16, 16, 0.0f).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Nvfp4FakeQuantRows(x.data(), 1, 16, 16, std::numeric_limits<float>::infinity()).code(),
            absl::StatusCode::kInvalidArgument);
  x[17] = std::numeric_limits<float>::quiet_NaN();
  const absl::Status s = Nvfp4FakeQuantRows(x.data(), 2, 16, 16, 1.0f);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[1, 1]"), std::string::npos) << s;
}

}  // namespace
}  // namespace quantd::kernels
