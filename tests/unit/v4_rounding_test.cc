// The official numerics' BF16 roundings and FP4 simulation that only `official` has, with exact
// values derived by hand from the official code's dtypes (inference/model.py on BF16 tensors,
// fast_hadamard_transform, kernel.py fp4_quant): the q_norm output (an RMSNorm in float32 rounded
// once to BF16; the indexer reads it too), the per-head q normalisation, the indexer's score sums,
// and the indexer's Hadamard transform + FP4 simulation. Each input is chosen so that the
// rounding changes the result against `math`. tests/interop/test_v4_official_roundings.py checks
// the same values against torch BF16 and the CPU stand-ins of DeepSeek's kernels.
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "server/model/v4_attention.h"
#include "server/model/v4_indexer.h"
#include "server/model/v4_mhc.h"

namespace quantd::model {
namespace {

constexpr float kEps = 1e-6f;

ForwardContext Context(Numerics numerics) {
  ForwardContext ctx;
  ctx.numerics = numerics;
  return ctx;
}

TEST(V4RoundingTest, QNormOutputIsRoundedOnceToBf16) {
  // x = [1, -1, 1, -1]: mean square 1, s = 1 / sqrt(1 + 1e-6) = 1 - 2^-21 in float32 (0.99999952).
  // weight * x * s in float32, then BF16 (step 2^-7 in [1, 2), 2^-9 in [0.25, 0.5)):
  //   (1 + 3 * 2^-9) * s = 1.0058589 = 128.75 steps -> 129 * 2^-7 = 1.0078125
  //   2 * -s = -1.999999 -> -2;  0.5 * s = 0.49999976 -> 0.5
  //   (1 + 2^-8) * -s = -1.0039058 = 128.49994 steps: just below the tie -> -1
  const std::vector<float> x = {1.0f, -1.0f, 1.0f, -1.0f};
  const std::vector<float> weight = {1.0f + 3 * 0x1p-9f, 2.0f, 0.5f, 1.0f + 0x1p-8f};
  std::vector<float> out(4);
  RmsNorm(Context(Numerics::kOfficial), x.data(), 1, 4, weight, kEps, out.data());
  EXPECT_EQ(out, (std::vector<float>{1.0078125f, -2.0f, 0.5f, -1.0f}));
  // Math keeps float32: weight * x * (1 - 2^-21), exact to the float32 ulp of each product.
  RmsNorm(Context(Numerics::kMath), x.data(), 1, 4, weight, kEps, out.data());
  const float s = 1.0f - 0x1p-21f;
  ASSERT_EQ(1.0f / std::sqrt(1.0f + kEps), s);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(out[c], weight[c] * (x[c] * s)) << c;
  EXPECT_NE(out[0], 1.0078125f);
}

TEST(V4RoundingTest, QNormRoundsEveryStepToBf16) {
  // Row 0 [1, 1 + 2^-7]: squares 1 and 1 + 2^-6 + 2^-14 -> bf16 1 + 2^-6; mean 1 + 2^-7 (exact);
  // + eps -> bf16 1 + 2^-7; rsqrt 0.9961165 -> bf16 (step 2^-8 below 1) 255/256; products
  // 255/256 (exact) and 1.0038757 -> bf16 (step 2^-7) 1.
  // Row 1 [3, -0.5]: squares 9, 0.25; mean 4.625 (exact); rsqrt 0.4649906 -> bf16 (step 2^-9)
  // 238 * 2^-9 = 0.46484375; 3 * that = 1.39453125 is the tie between 178 and 179 * 2^-7 ->
  // even: 1.390625; -0.5 * that = -0.232421875 (exact).
  const std::vector<float> in = {1.0f, 1.0f + 0x1p-7f, 3.0f, -0.5f};
  std::vector<float> q = in;
  NormalizeHeads(Context(Numerics::kOfficial), kEps, q.data(), 2, 2);
  EXPECT_EQ(q, (std::vector<float>{255.0f / 256.0f, 1.0f, 1.390625f, -0.232421875f}));

  // Math: float32 throughout, within 2 float32 ulps of the double-precision value.
  q = in;
  NormalizeHeads(Context(Numerics::kMath), kEps, q.data(), 2, 2);
  for (int r = 0; r < 2; ++r) {
    const double a = in[2 * r], b = in[2 * r + 1];
    const double scale = 1.0 / std::sqrt((a * a + b * b) / 2.0 + kEps);
    EXPECT_NEAR(q[2 * r], a * scale, 2 * std::fabs(a * scale) * 0x1p-24) << r;
    EXPECT_NEAR(q[2 * r + 1], b * scale, 2 * std::fabs(b * scale) * 0x1p-24) << r;
  }
  EXPECT_NE(q[0], 255.0f / 256.0f);  // official rounding visibly changes the result
  EXPECT_NE(q[1], 1.0f);
}

TEST(V4RoundingTest, IndexerScoresRoundEachHeadTermAndTheSumToBf16) {
  // One query at position 1, ratio 1: entries 0 and 1 are visible. Three heads, head_dim 4
  // (math's dot scale 0.5). Head weights as RunIndexer passes them: [1, 1, 1 + 2^-7].
  const int64_t heads = 3, entries = 2;
  const std::vector<float> dots = {
      1.0f + 0x1p-9f, 1.0f,   // head 0: bf16(1 + 2^-9) = 1 (step 2^-7)
      -3.0f, 0x1p-7f,         // head 1: relu zeroes entry 0
      1.0f + 0x1p-7f, 0.25f,  // head 2
  };
  const std::vector<float> weights = {1.0f, 1.0f, 1.0f + 0x1p-7f};
  std::vector<float> scores(entries, -1.0f);
  // Official, entry 0: 1 + 0 + bf16((1 + 2^-7)^2 = 1 + 2^-6 + 2^-14) = 1 + 1.015625 = 2.015625
  // (bf16-exact). Entry 1: 1 + 2^-7 + 0.25 * (1 + 2^-7) = 1.259765625 -> bf16 (step 2^-7)
  // 161 * 2^-7 = 1.2578125.
  IndexerScores(Numerics::kOfficial, dots.data(), weights.data(), 1, heads, 4, entries, 1, 1,
                scores.data());
  EXPECT_EQ(scores, (std::vector<float>{2.015625f, 1.2578125f}));
  // Math: 0.5 * sum_h relu(dot) * w, every term and sum exact in float32:
  // 0.5 * (1 + 2^-9 + 1 + 2^-6 + 2^-14) and 0.5 * (1 + 2^-7 + 0.25 + 2^-9).
  IndexerScores(Numerics::kMath, dots.data(), weights.data(), 1, heads, 4, entries, 1, 1,
                scores.data());
  EXPECT_EQ(scores, (std::vector<float>{1.008819580078125f, 0.6298828125f}));

  // A query at position 0 sees only entry 0 (s < (0 + 1) / 1): entry 1 stays unwritten.
  std::vector<float> first(entries, -1.0f);
  IndexerScores(Numerics::kOfficial, dots.data(), weights.data(), 1, heads, 4, entries, 0, 1,
                first.data());
  EXPECT_EQ(first, (std::vector<float>{2.015625f, -1.0f}));
}

TEST(V4RoundingTest, IndexerHadamardThenFp4MatchesHandDerivedValues) {
  // Rows of 32 (one FP4 block). H x / sqrt(32) of e0 is 0.1767767 everywhere; of e0 + e1 is
  // 0.3535534 at even i and 0 at odd i; of 3 e0 + e1 is 0.7071068 (even) and 0.3535534 (odd).
  // BF16 (fast_hadamard_transform's output dtype): 181 steps in each binade: 0.1767578125,
  // 0.353515625, 0.70703125. FP4 scale 2^ceil(log2(amax / 6)): 2^-5, 2^-4, 2^-3; the codes
  // 0.1767578125 / 2^-5 = 5.65625 -> 6 (above the 4|6 midpoint 5), 2.828125 -> 3 (above 2.5).
  const int64_t n = 32;
  std::vector<float> x(3 * n, 0.0f);
  x[0] = 1.0f;
  x[n] = 1.0f;
  x[n + 1] = 1.0f;
  x[2 * n] = 3.0f;
  x[2 * n + 1] = 1.0f;
  ASSERT_TRUE(SimulateIndexerFp4(x.data(), 3, n, HostThreads{}).ok());
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(x[i], 0.1875f) << i;                              // 6 * 2^-5
    EXPECT_EQ(x[n + i], i % 2 == 0 ? 0.375f : 0.0f) << i;       // 6 * 2^-4
    EXPECT_EQ(x[2 * n + i], i % 2 == 0 ? 0.75f : 0.375f) << i;  // 6 * 2^-3, 3 * 2^-3
  }
  // Without the simulation (math) the rotated values stay 0.1767767, ...: the FP4 codes moved
  // them by 6%.
  std::vector<float> plain(n, 0.0f);
  plain[0] = 1.0f;
  HadamardRows(plain.data(), 1, n);
  EXPECT_NEAR(plain[5], 1.0 / std::sqrt(32.0), 1e-7);
}

}  // namespace
}  // namespace quantd::model
