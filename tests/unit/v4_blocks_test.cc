// DeepSeek-V4 forward blocks against scalar references written from the official code's
// formulas (inference/kernel.py, model.py): activation FP8/FP4 simulation with hand-derived
// exact values, Sinkhorn mixing, routing and the clamped SwiGLU; and the row split of the host
// threads (v4_parallel.h).
#include <cmath>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/model/v4_act_quant.h"
#include "server/model/v4_mhc.h"
#include "server/model/v4_moe.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

TEST(V4ActQuantTest, Fp8SimulationMatchesHandDerivedValues) {
  // Three 128-column blocks of one row.
  std::vector<float> x(3 * 128, 0.0f);
  // Block 0: amax 300 -> s = 2^ceil(log2(300/448)) = 1. E4M3 steps: 32 in [256,512), 0.125 in
  // [1,2), 2^-5 in [0.25,0.5). 1.0625 is the tie between 1 and 1.125: even mantissa -> 1.
  x[0] = 300.0f;   // -> 288
  x[1] = -1.2f;    // -> -1.25
  x[2] = 0.3f;     // -> 0.3125
  x[3] = 1.0625f;  // -> 1
  // Block 1: all 1000 -> s = 2^ceil(log2(2.23)) = 4; 250 -> 256 (step 16) -> 1024.
  for (int c = 128; c < 256; ++c) x[c] = 1000.0f;
  // Block 2: amax 1e-5 floored to 1e-4 -> s = 2^ceil(log2(2.2e-7)) = 2^-22;
  // 1e-5 / 2^-22 = 41.94 -> 40 (step 4) -> 40 * 2^-22.
  x[256] = 1e-5f;
  ASSERT_TRUE(SimulateFp8Act(x.data(), 1, 384, 384, kActQuantBlock).ok());
  EXPECT_EQ(x[0], 288.0f);
  EXPECT_EQ(x[1], -1.25f);
  EXPECT_EQ(x[2], 0.3125f);
  EXPECT_EQ(x[3], 1.0f);
  EXPECT_EQ(x[4], 0.0f);
  for (int c = 128; c < 256; ++c) ASSERT_EQ(x[c], 1024.0f);
  EXPECT_EQ(x[256], std::ldexp(40.0f, -22));
}

TEST(V4ActQuantTest, Fp8SimulationClampsAtTheScaleBoundaryAndRespectsBlocks) {
  // amax exactly 448: s = 1 and 448 stays; the 64-column KV block sees only its own amax.
  std::vector<float> x(128, 0.0f);
  x[0] = 448.0f;
  x[64] = 0.3f;  // block of 64 with amax 0.3: s = 2^ceil(log2(0.3/448)) = 2^-10 -> 307.2 -> 320
  ASSERT_TRUE(SimulateFp8Act(x.data(), 1, 128, 128, kKvQuantBlock).ok());
  EXPECT_EQ(x[0], 448.0f);
  EXPECT_EQ(x[64], std::ldexp(320.0f, -10));
  EXPECT_EQ(SimulateFp8Act(x.data(), 1, 100, 128, kActQuantBlock).code(),
            absl::StatusCode::kInvalidArgument);
  x[5] = NAN;
  const absl::Status s = SimulateFp8Act(x.data(), 1, 128, 128, kActQuantBlock);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[0, 5]"), std::string::npos);
}

TEST(V4ActQuantTest, Fp4SimulationMatchesHandDerivedValues) {
  std::vector<float> x(64, 0.0f);
  // Block 0: amax 6 -> s = 1. E2M1 ties go to the even code: 0.25 -> 0, 0.75 -> 1, 5 -> 4.
  x[0] = 6.0f;
  x[1] = 0.25f;
  x[2] = 0.75f;
  x[3] = 2.6f;   // -> 3
  x[4] = -5.0f;  // -> -4
  // Block 1: amax 12 -> s = 2: 5 / 2 = 2.5 -> 2 -> 4; 1 / 2 = 0.5 -> 1.
  x[32] = 12.0f;
  x[33] = 5.0f;
  x[34] = 1.0f;
  ASSERT_TRUE(SimulateFp4Act(x.data(), 1, 64, 64).ok());
  EXPECT_EQ(x[0], 6.0f);
  EXPECT_EQ(x[1], 0.0f);
  EXPECT_EQ(x[2], 1.0f);
  EXPECT_EQ(x[3], 3.0f);
  EXPECT_EQ(x[4], -4.0f);
  EXPECT_EQ(x[32], 12.0f);
  EXPECT_EQ(x[33], 4.0f);
  EXPECT_EQ(x[34], 1.0f);
}

TEST(V4ActQuantTest, PowerOfTwoScaleUsesTheReciprocalProduct) {
  EXPECT_EQ(PowerOfTwoScale(448.0f, 448.0f), 1.0f);
  EXPECT_EQ(PowerOfTwoScale(448.00003f, 448.0f), 2.0f);
  EXPECT_EQ(PowerOfTwoScale(224.0f, 448.0f), 0.5f);
  EXPECT_EQ(PowerOfTwoScale(6.0f, 6.0f), 1.0f);
}

// hc_split_sinkhorn in double, straight from kernel.py.
void SinkhornReference(const float* mixes, const float* scale, const float* base, int hc, int iters,
                       double eps, double* pre, double* post, double* comb) {
  auto sigmoid = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  for (int j = 0; j < hc; ++j) {
    pre[j] = sigmoid(double(mixes[j]) * scale[0] + base[j]) + eps;
    post[j] = 2.0 * sigmoid(double(mixes[hc + j]) * scale[1] + base[hc + j]);
  }
  for (int j = 0; j < hc; ++j) {
    double sum = 0.0;
    for (int k = 0; k < hc; ++k) {
      comb[j * hc + k] =
          std::exp(double(mixes[2 * hc + j * hc + k]) * scale[2] + base[2 * hc + j * hc + k]);
      sum += comb[j * hc + k];
    }
    for (int k = 0; k < hc; ++k) comb[j * hc + k] = comb[j * hc + k] / sum + eps;
  }
  auto cols = [&] {
    for (int k = 0; k < hc; ++k) {
      double s = 0.0;
      for (int j = 0; j < hc; ++j) s += comb[j * hc + k];
      for (int j = 0; j < hc; ++j) comb[j * hc + k] /= s + eps;
    }
  };
  cols();
  for (int i = 1; i < iters; ++i) {
    for (int j = 0; j < hc; ++j) {
      double s = 0.0;
      for (int k = 0; k < hc; ++k) s += comb[j * hc + k];
      for (int k = 0; k < hc; ++k) comb[j * hc + k] /= s + eps;
    }
    cols();
  }
}

TEST(V4MhcTest, SinkhornMatchesTheReferenceAndIsDoublyStochastic) {
  const int hc = 4, iters = 20;
  const float eps = 1e-6f;
  std::vector<float> mixes(24), base(24);
  for (int i = 0; i < 24; ++i) {
    mixes[i] = std::sin(1.7f * i) * 2.0f;
    base[i] = std::cos(0.9f * i);
  }
  const float scale[3] = {0.7f, 1.3f, 2.1f};
  float pre[4], post[4], comb[16];
  double rpre[4], rpost[4], rcomb[16];
  SplitSinkhorn(mixes.data(), scale, base.data(), hc, iters, eps, pre, post, comb);
  SinkhornReference(mixes.data(), scale, base.data(), hc, iters, eps, rpre, rpost, rcomb);
  // float32 against double: each of the ~2 * 20 normalizations adds a few ulps (2^-24) of
  // relative error per entry; 1e-5 bounds 40 x 4 rounding steps with margin.
  for (int j = 0; j < hc; ++j) {
    EXPECT_NEAR(pre[j], rpre[j], 1e-6 * rpre[j]);
    EXPECT_NEAR(post[j], rpost[j], 1e-6 * rpost[j]);
  }
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(comb[i], rcomb[i], 1e-5 * rcomb[i]) << i;
  for (int k = 0; k < hc; ++k) {
    double col = 0.0, row = 0.0;
    for (int j = 0; j < hc; ++j) {
      col += comb[j * hc + k];
      row += comb[k * hc + j];
    }
    EXPECT_NEAR(col, 1.0, 1e-5);
    EXPECT_NEAR(row, 1.0, 1e-3);  // 20 iterations converge the rows to ~1e-3 or better
  }
}

V4Config RoutingConfig() {
  V4Config c;
  c.n_routed_experts = 6;
  c.num_experts_per_tok = 2;
  c.routed_scaling_factor = 1.5f;
  c.vocab_size = 3;
  return c;
}

TEST(V4MoeTest, BiasSelectsButDoesNotWeigh) {
  const V4Config c = RoutingConfig();
  MoeWeights w;
  w.bias = {0.0f, 0.0f, 0.0f, 0.0f, 5.0f, 0.0f};  // pulls expert 4 in
  const float logits[6] = {1.0f, 3.0f, -2.0f, 2.0f, -1.0f, 25.0f};
  const Routing r = Route(c, w, logits, 1, nullptr);
  // scores: sqrt(softplus(l)); softplus(25) = 25 (threshold 20). With the bias, expert 4
  // (sqrt(softplus(-1)) + 5 = 5.56) beats expert 1 (1.74) but not expert 5 (5).
  EXPECT_EQ(r.experts, (std::vector<int32_t>{4, 5}));
  const double s4 = std::sqrt(std::log1p(std::exp(-1.0))), s5 = 5.0;
  EXPECT_NEAR(r.weights[0], 1.5 * s4 / (s4 + s5), 1e-6);
  EXPECT_NEAR(r.weights[1], 1.5 * s5 / (s4 + s5), 1e-6);
}

TEST(V4MoeTest, HashLayersRouteByTokenId) {
  const V4Config c = RoutingConfig();
  MoeWeights w;
  w.tid2eid = {0, 1, 5, 2, 3, 4};  // token 1 -> experts 5, 2
  const float logits[6] = {0.5f, 0.5f, 1.0f, 0.5f, 0.5f, -1.0f};
  const int32_t token = 1;
  const Routing r = Route(c, w, logits, 1, &token);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{5, 2}));
  const double s5 = std::sqrt(std::log1p(std::exp(-1.0)));
  const double s2 = std::sqrt(std::log1p(std::exp(1.0)));
  EXPECT_NEAR(r.weights[0], 1.5 * s5 / (s5 + s2), 1e-6);
  EXPECT_NEAR(r.weights[1], 1.5 * s2 / (s5 + s2), 1e-6);
}

TEST(V4MoeTest, SwigluClampsGateAboveAndUpBothWays) {
  auto silu = [](double g) { return g / (1.0 + std::exp(-g)); };
  EXPECT_NEAR(ClampedSwiglu(12.0f, -15.0f, 10.0f), silu(10.0) * -10.0, 1e-5);
  EXPECT_NEAR(ClampedSwiglu(-12.0f, 15.0f, 10.0f), silu(-12.0) * 10.0, 1e-9);  // gate: max only
  EXPECT_NEAR(ClampedSwiglu(12.0f, -15.0f, 0.0f), silu(12.0) * -15.0, 1e-4);   // no limit
  EXPECT_NEAR(ClampedSwiglu(0.5f, 2.0f, 10.0f), silu(0.5) * 2.0, 1e-7);
}

// Route splits tokens over threads: the same experts and weights as on one thread.
TEST(V4MoeTest, RoutingDoesNotDependOnTheThreadCount) {
  V4Config c = RoutingConfig();
  c.vocab_size = 7;
  const int64_t tokens = 37;
  std::vector<float> logits(static_cast<size_t>(tokens * c.n_routed_experts));
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(0.7f * i) * 4.0f;
  for (size_t t = 0; t < ids.size(); ++t) ids[t] = static_cast<int32_t>((5 * t) % c.vocab_size);
  kernels::cpu::ThreadPool pool(3);
  const HostThreads three{.count = 3, .min_work = 1, .pool = &pool};
  MoeWeights bias;
  bias.bias = {0.5f, -0.5f, 0.0f, 1.0f, 0.0f, -1.0f};
  MoeWeights hash;
  for (int64_t v = 0; v < c.vocab_size; ++v) {
    hash.tid2eid.push_back(static_cast<int32_t>(v % 6));
    hash.tid2eid.push_back(static_cast<int32_t>((v + 1) % 6));
  }
  for (const MoeWeights* w : {&bias, &hash}) {
    const Routing one = Route(c, *w, logits.data(), tokens, ids.data());
    const Routing split = Route(c, *w, logits.data(), tokens, ids.data(), three);
    EXPECT_EQ(split.experts, one.experts);
    EXPECT_EQ(split.weights, one.weights);
  }
}

TEST(V4ParallelTest, RangesCoverEveryRowOnceInOrderAndSkipThreadsForSmallWork) {
  kernels::cpu::ThreadPool pool(8);
  std::vector<int> owner(10, -1);
  std::vector<std::pair<int64_t, int64_t>> ranges(3);
  ParallelRows({.count = 3, .min_work = 1, .pool = &pool}, 10, 1,
               [&](int worker, int64_t begin, int64_t end) {
    ranges[worker] = {begin, end};
    for (int64_t r = begin; r < end; ++r) owner[r] = worker;
  });
  EXPECT_EQ(ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 6}, {6, 10}}));
  EXPECT_EQ(owner, (std::vector<int>{0, 0, 0, 1, 1, 1, 2, 2, 2, 2}));
  // 10 rows of 100 operations are 1000: two threads at a minimum of 500 each, one below that.
  EXPECT_EQ(ParallelWorkers({.count = 8, .min_work = 500, .pool = &pool}, 10, 100), 2);
  EXPECT_EQ(ParallelWorkers({.count = 8, .min_work = 1001, .pool = &pool}, 10, 100), 1);
  EXPECT_EQ(ParallelWorkers({.count = 8, .min_work = 1, .pool = &pool}, 3, 100), 3);  // <= rows
  EXPECT_EQ(ParallelWorkers({}, 1 << 20, 1 << 20), 1);  // count 1 by default
  EXPECT_EQ(ParallelWorkers({.count = 8, .min_work = 1}, 100, 100), 1);  // no pool: the caller
  kernels::cpu::ThreadPool two(2);
  EXPECT_EQ(ParallelWorkers({.count = 8, .min_work = 1, .pool = &two}, 100, 100), 2);  // <= pool
}

// One pool serves many loops of different sizes (its threads are reused, not restarted), and
// loops from two caller threads at once run one after the other.
TEST(V4ParallelTest, APoolRunsManyLoopsAndConcurrentCallers) {
  kernels::cpu::ThreadPool pool(3);
  ASSERT_EQ(pool.size(), 3);
  auto sum_of_loops = [&pool](int64_t first) {
    int64_t total = 0;
    for (int64_t n = first; n < first + 200; ++n) {
      std::vector<int64_t> part(3, 0);
      pool.Run(3, n, [&](int w, int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) part[w] += i;
      });
      total += part[0] + part[1] + part[2];
    }
    return total;
  };
  auto expected = [](int64_t first) {
    int64_t total = 0;
    for (int64_t n = first; n < first + 200; ++n) total += n * (n - 1) / 2;
    return total;
  };
  int64_t other = 0;
  std::thread caller([&] { other = sum_of_loops(1000); });
  EXPECT_EQ(sum_of_loops(0), expected(0));
  caller.join();
  EXPECT_EQ(other, expected(1000));
}

TEST(V4ParallelTest, ReportsTheErrorOfTheLowestFailingRange) {
  kernels::cpu::ThreadPool pool(4);
  const absl::Status s = ParallelRowsOrError(
      {.count = 4, .min_work = 1, .pool = &pool}, 8, 1, [](int64_t begin, int64_t) {
        return begin >= 2 ? absl::InvalidArgumentError(absl::StrCat("row ", begin))
                          : absl::OkStatus();
      });
  EXPECT_EQ(s, absl::InvalidArgumentError("row 2"));
  // The FP8 simulation names the first non-finite value as one thread would.
  std::vector<float> x(4 * 128, 1.0f);
  x[2 * 128 + 5] = NAN;
  x[3 * 128 + 1] = INFINITY;
  const absl::Status fp8 = SimulateFp8Act(x.data(), 4, 128, 128, kActQuantBlock,
                                          {.count = 4, .min_work = 1, .pool = &pool});
  EXPECT_NE(fp8.message().find("[2, 5]"), std::string::npos) << fp8;
}

}  // namespace
}  // namespace quantd::model
