// The non-attention CUDA blocks of the DeepSeek-V4 forward that v4_blocks.h does not have
// (kernels/cuda/v4_moe_blocks.h, v4_mhc_blocks.h, v4_compressor_blocks.h,
// v4_embedding_blocks.h) against their CPU functions on the same random inputs, at small sizes
// with a 4-block grid (grid-stride loops take several turns) and at DeepSeek-V4-Pro-like sizes
// (hidden 7168, 384 experts top-6, hc 4, compressor widths 512 and 128) with an H200-like grid
// (132 SMs x 8 blocks). Bit-exact where no transcendental function is involved (expert
// grouping, gather, weight scaling, scatter-add, mixes scaling, collapse, embedding, hash ids);
// within tolerances derived from expf/log1pf's error otherwise (router scores and weights,
// compressor pooling, Sinkhorn-weighted collapse, hc_head). Skips without a CUDA device; builds
// without CUDA have no such blocks and skip as well.
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/gemm.h"
#include "server/model/v4_compressor.h"
#include "server/model/v4_layer.h"
#include "server/model/v4_linear.h"
#include "server/model/v4_mhc.h"
#include "server/model/v4_moe.h"

#if QUANTD_HAVE_CUDA_HEADERS
#include <cuda_runtime_api.h>

#include "kernels/cuda/v4_blocks.h"
#include "kernels/cuda/v4_compressor_blocks.h"
#include "kernels/cuda/v4_embedding_blocks.h"
#include "kernels/cuda/v4_mhc_blocks.h"
#include "kernels/cuda/v4_moe_blocks.h"
#include "tests/unit/v4_cuda_test_util.h"
#endif

namespace quantd::model {
namespace {

#if QUANTD_HAVE_CUDA_HEADERS

using kernels::cuda::DeviceResults;
using kernels::cuda::kNoBad;
using kernels::cuda::Launch;
using testing_util::DeviceVector;
using testing_util::ExpectSameBits;
using testing_util::RandomFloats;

// The unit roundoff of float32: one ulp is at most 2 * kEps relative.
constexpr double kEps = 0x1p-24;

class V4CudaMoeTest : public testing_util::CudaDeviceTest {
 protected:
  static ForwardContext Context(Numerics numerics, kernels::Gemm* gemm = nullptr) {
    ForwardContext ctx;
    ctx.numerics = numerics;
    ctx.gemm = gemm;
    return ctx;
  }

  const Launch small_{nullptr, 4};       // several turns of every grid-stride loop
  const Launch h200_{nullptr, 132 * 8};  // the backend's grid cap on an H200
};

// ---- router ------------------------------------------------------------------------------------

struct RouterShape {
  int64_t tokens, experts, topk;
  float route_scale;
};

V4Config RouterConfig(const RouterShape& s, int64_t vocab = 0) {
  V4Config c;
  c.n_routed_experts = s.experts;
  c.num_experts_per_tok = s.topk;
  c.routed_scaling_factor = s.route_scale;
  c.vocab_size = vocab;
  return c;
}

// A score's difference between the device and the host: expf differs by at most 2 + 1 ulp
// (CUDA, glibc), so softplus's argument by 6 kEps relative; log1p of a positive y has a
// condition number y / ((1 + y) log1p(y)) <= 1 and its own error is 1 ulp (CUDA) plus at most
// 2 (glibc), so softplus differs by 12 kEps; the square root halves that and rounds once on each
// side: 8 kEps. Twice that covers it: 2^-20 relative (for logits above -87, where exp is normal).
constexpr double kScoreRel = 16 * kEps;

// The routing weights: each score within kScoreRel, their sum (topk positive terms, rounded
// topk - 1 times on each side) within kScoreRel + (topk - 1) * 2 kEps, the division and the
// route scale one ulp each.
double WeightRel(int64_t topk) { return 2 * kScoreRel + static_cast<double>(topk + 1) * 2 * kEps; }

// Whether token t's choice and order cannot differ between device and host: in the CPU's full
// ranking, every chosen expert is either an exact tie with the experts after it (the same logit
// and bias: the same biased score on both sides, ties broken by id on both) or above them by
// more than twice the largest biased-score error of the token (score error plus one rounding of
// the bias addition on each side).
bool SelectionIsDetermined(const float* logits, const std::vector<float>& bias, int64_t topk) {
  const int64_t experts = static_cast<int64_t>(bias.size());
  std::vector<double> biased(static_cast<size_t>(experts));
  double err = 0.0;
  for (int64_t e = 0; e < experts; ++e) {
    const float s = SqrtSoftplus(logits[e]);
    biased[e] = s + bias[e];
    err = std::max(err, kScoreRel * s + 2 * kEps * std::fabs(biased[e]));
  }
  std::vector<int64_t> order(static_cast<size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return biased[a] > biased[b] || (biased[a] == biased[b] && a < b);
  });
  for (int64_t r = 0; r < topk; ++r) {
    const int64_t a = order[r];
    for (int64_t q = r + 1; q < experts; ++q) {
      const int64_t b = order[q];
      if (logits[a] == logits[b] && bias[a] == bias[b]) continue;  // an exact tie
      if (biased[a] - biased[b] <= 2 * err) return false;
      break;  // the rest rank lower still
    }
  }
  return true;
}

// Runs LaunchRouteByScore on the logits and checks it against Route: the ids of every token whose
// selection is determined (at least `min_determined` of them), the weights of those within
// WeightRel.
void CheckScoreRouting(const RouterShape& s, const std::vector<float>& logits,
                       const std::vector<float>& bias, int64_t min_determined,
                       const Launch& launch, DeviceResults* results) {
  MoeWeights w;
  w.bias = bias;
  const Routing want = Route(RouterConfig(s), w, logits.data(), s.tokens, nullptr);
  DeviceVector<float> dlogits(logits), dbias(bias);
  DeviceVector<int32_t> dids{std::vector<int32_t>(s.tokens * s.topk, -1)};
  DeviceVector<float> dweights{std::vector<float>(s.tokens * s.topk)};
  ASSERT_EQ(kernels::cuda::LaunchRouteByScore(dlogits.get(), s.tokens, s.experts, dbias.get(),
                                              s.topk, s.route_scale, dids.get(), dweights.get(),
                                              results, launch),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  DeviceResults r{};
  ASSERT_EQ(cudaMemcpy(&r, results, sizeof(r), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(r.first_bad, kNoBad);
  const std::vector<int32_t> ids = dids.ToHost();
  const std::vector<float> weights = dweights.ToHost();
  int64_t determined = 0;
  for (int64_t t = 0; t < s.tokens; ++t) {
    if (!SelectionIsDetermined(logits.data() + t * s.experts, bias, s.topk)) continue;
    ++determined;
    for (int64_t k = 0; k < s.topk; ++k) {
      const int64_t i = t * s.topk + k;
      ASSERT_EQ(ids[i], want.experts[i]) << "token " << t << " rank " << k;
      EXPECT_NEAR(weights[i], want.weights[i], WeightRel(s.topk) * want.weights[i]) << i;
    }
  }
  EXPECT_GE(determined, min_determined);
}

TEST_F(V4CudaMoeTest, ScoreRoutingChoosesAsTheCpuWithinScoreErrors) {
  // Random logits: a determined selection for nearly every token (a near-tie within 1e-5 of
  // two adjacent ranks is rare, but possible).
  for (const auto& [s, launch] : {std::pair{RouterShape{37, 16, 3, 1.0f}, small_},
                                  std::pair{RouterShape{301, 384, 6, 2.5f}, h200_}}) {
    const std::vector<float> logits = RandomFloats(s.tokens * s.experts, 2.0f, 21);
    const std::vector<float> bias = RandomFloats(s.experts, 0.5f, 22);
    CheckScoreRouting(s, logits, bias, s.tokens - s.tokens / 50, launch, results_);
  }
}

TEST_F(V4CudaMoeTest, ScoreRoutingBreaksExactTiesByIdAsTheCpu) {
  // Logits on a grid of 9 values and biases of 2: every expert ties exactly with many others,
  // and distinct (logit, bias) pairs are far apart, so every token is determined.
  const RouterShape s{64, 384, 6, 2.5f};
  std::mt19937 rng(23);
  std::uniform_int_distribution<int> step(-4, 4), half(0, 1);
  std::vector<float> logits(s.tokens * s.experts), bias(s.experts);
  for (float& l : logits) l = 0.5f * static_cast<float>(step(rng));
  for (float& b : bias) b = 0.25f * static_cast<float>(half(rng));
  CheckScoreRouting(s, logits, bias, s.tokens, h200_, results_);
}

TEST_F(V4CudaMoeTest, ScoreRoutingReportsTheFirstNonFiniteLogit) {
  const RouterShape s{9, 16, 2, 1.0f};
  std::vector<float> logits = RandomFloats(s.tokens * s.experts, 2.0f, 24);
  logits[5 * s.experts + 11] = NAN;
  logits[2 * s.experts + 3] = INFINITY;
  const std::vector<float> bias(s.experts, 0.0f);
  DeviceVector<float> dlogits(logits), dbias(bias);
  DeviceVector<int32_t> dids{std::vector<int32_t>(s.tokens * s.topk, -1)};
  DeviceVector<float> dweights{std::vector<float>(s.tokens * s.topk)};
  ASSERT_EQ(kernels::cuda::LaunchRouteByScore(dlogits.get(), s.tokens, s.experts, dbias.get(),
                                              s.topk, s.route_scale, dids.get(), dweights.get(),
                                              results_, small_),
            cudaSuccess);
  Sync();
  EXPECT_EQ(FirstBad(), static_cast<unsigned long long>(2 * s.experts + 3));
  // Even there, every id names an expert.
  for (int32_t id : dids.ToHost()) EXPECT_TRUE(id >= 0 && id < s.experts) << id;
  EXPECT_EQ(kernels::cuda::LaunchRouteByScore(dlogits.get(), s.tokens, s.experts, dbias.get(),
                                              s.experts + 1, s.route_scale, dids.get(),
                                              dweights.get(), results_, small_),
            cudaErrorInvalidValue);
}

// tid2eid [vocab, topk]: distinct experts per row, as LoadExpertIds requires.
std::vector<int32_t> RandomTid2eid(int64_t vocab, int64_t topk, int64_t experts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> all(static_cast<size_t>(experts));
  std::iota(all.begin(), all.end(), 0);
  std::vector<int32_t> table;
  for (int64_t v = 0; v < vocab; ++v) {
    std::shuffle(all.begin(), all.end(), rng);
    table.insert(table.end(), all.begin(), all.begin() + topk);
  }
  return table;
}

TEST_F(V4CudaMoeTest, HashRoutingTakesTheTableAndReportsTheFirstBadTokenId) {
  for (const auto& [s, launch] : {std::pair{RouterShape{37, 16, 3, 1.0f}, small_},
                                  std::pair{RouterShape{301, 384, 6, 2.5f}, h200_}}) {
    const int64_t vocab = 1000;
    MoeWeights w;
    w.tid2eid = RandomTid2eid(vocab, s.topk, s.experts, 25);
    const std::vector<float> logits = RandomFloats(s.tokens * s.experts, 2.0f, 26);
    std::vector<int32_t> tokens(s.tokens);
    std::mt19937 rng(27);
    for (int32_t& id : tokens) id = std::uniform_int_distribution<int32_t>(0, vocab - 1)(rng);
    tokens[0] = 0;
    tokens[1] = vocab - 1;
    const Routing want = Route(RouterConfig(s, vocab), w, logits.data(), s.tokens, tokens.data());

    // Two bad ids after the checks: the first is reported, the other tokens routed as before.
    std::vector<int32_t> with_bad = tokens;
    with_bad[7] = vocab;
    with_bad[4] = -1;
    for (const std::vector<int32_t>* ids_in : {&tokens, &with_bad}) {
      DeviceVector<float> dlogits(logits);
      DeviceVector<int32_t> dtable(w.tid2eid), dtokens(*ids_in);
      DeviceVector<int32_t> dids{std::vector<int32_t>(s.tokens * s.topk, -1)};
      DeviceVector<float> dweights{std::vector<float>(s.tokens * s.topk)};
      ASSERT_EQ(kernels::cuda::LaunchRouteByHash(dlogits.get(), s.tokens, s.experts,
                                                 dtokens.get(), dtable.get(), vocab, s.topk,
                                                 s.route_scale, dids.get(), dweights.get(),
                                                 results_, launch),
                cudaSuccess);
      Sync();
      const bool bad = ids_in == &with_bad;
      EXPECT_EQ(FirstBad(), bad ? 4ull : kNoBad);
      const std::vector<int32_t> ids = dids.ToHost();
      const std::vector<float> weights = dweights.ToHost();
      for (int64_t t = 0; t < s.tokens; ++t) {
        for (int64_t k = 0; k < s.topk; ++k) {
          const int64_t i = t * s.topk + k;
          if (bad && (t == 4 || t == 7)) {
            EXPECT_EQ(ids[i], -1) << "a bad token's row is not written";
            continue;
          }
          ASSERT_EQ(ids[i], want.experts[i]) << i;
          EXPECT_NEAR(weights[i], want.weights[i], WeightRel(s.topk) * want.weights[i]) << i;
        }
      }
    }
  }
}

// ---- MoE grouping and combine ------------------------------------------------------------------

// A score routing of random logits on the CPU (the grouping and combine tests' input).
Routing RandomRouting(const RouterShape& s, uint32_t seed) {
  MoeWeights w;
  w.bias = RandomFloats(s.experts, 0.5f, seed + 1);
  const std::vector<float> logits = RandomFloats(s.tokens * s.experts, 2.0f, seed);
  return Route(RouterConfig(s), w, logits.data(), s.tokens, nullptr);
}

// LaunchGroupByExpert over `routing` (s.tokens x s.topk), its outputs in fresh device arrays
// filled with -1 first (row weights with 0); `launched` is the launcher's return value.
struct DeviceGrouping {
  DeviceGrouping(const Routing& routing, const RouterShape& s, DeviceResults* results,
                 const Launch& launch)
      : ids(routing.experts),
        weights(routing.weights),
        offsets(std::vector<int64_t>(s.experts + 1, -1)),
        rows(std::vector<int64_t>(s.tokens * s.topk, -1)),
        row_weights(std::vector<float>(s.tokens * s.topk)),
        launched(kernels::cuda::LaunchGroupByExpert(ids.get(), weights.get(), s.tokens, s.topk,
                                                    s.experts, offsets.get(), rows.get(),
                                                    row_weights.get(), results, launch)) {}

  DeviceVector<int32_t> ids;
  DeviceVector<float> weights;
  DeviceVector<int64_t> offsets;    // [experts + 1]
  DeviceVector<int64_t> rows;       // [tokens * topk]
  DeviceVector<float> row_weights;  // [tokens * topk]
  cudaError_t launched;
};

TEST_F(V4CudaMoeTest, GroupByExpertIsTheCpusGroupingFlattened) {
  for (const auto& [s, launch] : {std::pair{RouterShape{37, 16, 4, 1.0f}, small_},
                                  std::pair{RouterShape{2048, 384, 6, 2.5f}, h200_}}) {
    const Routing routing = RandomRouting(s, 31);
    const ExpertRows want = GroupByExpert(routing, s.tokens, s.topk, s.experts);
    std::vector<int64_t> want_offsets{0}, want_rows;
    std::vector<float> want_weights;
    for (int64_t e = 0; e < s.experts; ++e) {
      want_rows.insert(want_rows.end(), want.tokens[e].begin(), want.tokens[e].end());
      want_weights.insert(want_weights.end(), want.weights[e].begin(), want.weights[e].end());
      want_offsets.push_back(static_cast<int64_t>(want_rows.size()));
    }
    const DeviceGrouping grouped(routing, s, results_, launch);
    ASSERT_EQ(grouped.launched, cudaSuccess);
    Sync();
    EXPECT_EQ(FirstBad(), kNoBad);
    EXPECT_EQ(grouped.offsets.ToHost(), want_offsets);
    EXPECT_EQ(grouped.rows.ToHost(), want_rows);
    ExpectSameBits(grouped.row_weights.ToHost(), want_weights);
  }
}

TEST_F(V4CudaMoeTest, GroupByExpertReportsTheFirstIdOutOfRangeAndLeavesItOut) {
  const RouterShape s{37, 16, 4, 1.0f};
  Routing routing = RandomRouting(s, 32);
  routing.experts[20 * s.topk + 3] = -1;
  routing.experts[5 * s.topk + 2] = static_cast<int32_t>(s.experts);
  const int64_t entries = s.tokens * s.topk;
  const DeviceGrouping grouped(routing, s, results_, small_);
  ASSERT_EQ(grouped.launched, cudaSuccess);
  Sync();
  EXPECT_EQ(FirstBad(), static_cast<unsigned long long>(5 * s.topk + 2));
  EXPECT_EQ(grouped.offsets.ToHost()[s.experts], entries - 2);
}

// MoeForward's routed combine with the expert GEMMs left out (each expert's output is its
// gathered input, as for an identity expert): gather, routing weight (W4A4's placement, on the
// output, then the model dtype), scatter-add in ascending expert order, plus the shared expert's
// output. Every step bit-exact, so the sum and the result are the CPU's bits.
TEST_F(V4CudaMoeTest, RoutedCombineIsBitExactInBothNumerics) {
  for (const auto& [s, d, launch] :
       {std::tuple{RouterShape{37, 16, 4, 1.0f}, int64_t{96}, small_},
        std::tuple{RouterShape{64, 384, 6, 2.5f}, int64_t{7168}, h200_}}) {
    const Routing routing = RandomRouting(s, 33);
    const ExpertRows groups = GroupByExpert(routing, s.tokens, s.topk, s.experts);
    const std::vector<float> x = RandomFloats(s.tokens * d, 1.0f, 34);
    const std::vector<float> shared = RandomFloats(s.tokens * d, 0.5f, 35);
    for (Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
      const ForwardContext ctx = Context(numerics);
      const bool round = numerics == Numerics::kOfficial;
      // The CPU: MoeForward's loop over experts, then its last step.
      std::vector<float> sum(s.tokens * d, 0.0f), xe;
      std::vector<std::vector<float>> want_outputs(s.experts);
      for (int64_t e = 0; e < s.experts; ++e) {
        const int64_t n = static_cast<int64_t>(groups.tokens[e].size());
        xe.resize(n * d);
        GatherRows(x.data(), d, groups.tokens[e].data(), n, xe.data(), ctx.threads);
        ScaleRows(groups.weights[e].data(), n, d, xe.data(), ctx.threads);
        ToModelDtype(ctx, xe.data(), n * d);
        AddRows(xe.data(), groups.tokens[e].data(), n, d, sum.data(), ctx.threads);
        want_outputs[e] = xe;
      }
      std::vector<float> want_y(shared.size());
      for (size_t i = 0; i < want_y.size(); ++i) want_y[i] = sum[i] + shared[i];
      ToModelDtype(ctx, want_y.data(), static_cast<int64_t>(want_y.size()));

      // The device.
      const DeviceGrouping grouped(routing, s, results_, launch);
      ASSERT_EQ(grouped.launched, cudaSuccess);
      Sync();
      ASSERT_EQ(FirstBad(), kNoBad);
      const std::vector<int64_t> offsets = grouped.offsets.ToHost();
      DeviceVector<float> dx(x), dsum{std::vector<float>(s.tokens * d, 0.0f)}, dy(shared);
      DeviceVector<float> dxe{std::vector<float>(s.tokens * d)};
      for (int64_t e = 0; e < s.experts; ++e) {
        const int64_t n = offsets[e + 1] - offsets[e];
        if (n == 0) continue;
        const int64_t* rows = grouped.rows.get() + offsets[e];
        ASSERT_EQ(kernels::cuda::LaunchGatherRows(dx.get(), d, rows, n, dxe.get(), launch),
                  cudaSuccess);
        const float* weights = grouped.row_weights.get() + offsets[e];
        ASSERT_EQ(kernels::cuda::LaunchScaleRows(weights, n, d, round, dxe.get(), launch),
                  cudaSuccess);
        Sync();
        std::vector<float> got(n * d);
        ASSERT_EQ(cudaMemcpy(got.data(), dxe.get(), got.size() * 4, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ExpectSameBits(got, want_outputs[e]);
        ASSERT_EQ(kernels::cuda::LaunchAddRows(dxe.get(), rows, n, d, dsum.get(), launch),
                  cudaSuccess);
      }
      Sync();
      ExpectSameBits(dsum.ToHost(), sum);
      ASSERT_EQ(kernels::cuda::LaunchAddRoutedSum(dsum.get(), s.tokens * d, round, dy.get(),
                                                  launch),
                cudaSuccess);
      Sync();
      ExpectSameBits(dy.ToHost(), want_y);
    }
  }
}

// ---- compressor pooling ------------------------------------------------------------------------

// A pooled output against the CPU's: the slot scores are the same bits on both sides, each
// exponential within 2 + 1 ulp (6 kEps), the sum of `slots` positive terms within
// (6 + 2 * slots) kEps (each addition rounds differently by at most 2 kEps of the total), each
// softmax weight within (14 + 2 * slots) kEps after the division, each product within
// (16 + 2 * slots) kEps, and the weighted sum's roundings add 2 * slots kEps of
// sum_s |kv_s| p_s: in all (16 + 4 * slots) kEps * sum_s |kv_s| p_s, and sum_s |kv_s| p_s is at
// most max |kv| times sum_s p_s (1 within slots * kEps; 1.01 bounds it).
void CheckPooling(int64_t sequences, int64_t seq_len, int64_t ratio, int64_t width,
                  const Launch& launch) {
  const int64_t coff = ratio == 4 ? 2 : 1;
  const int64_t stride = coff * width, windows = seq_len / ratio;
  const std::vector<float> kv = RandomFloats(sequences * seq_len * stride, 1.0f, 41);
  const std::vector<float> score = RandomFloats(kv.size(), 2.0f, 42);
  const std::vector<float> ape = RandomFloats(ratio * stride, 0.5f, 43);
  std::vector<float> want(sequences * windows * width);
  for (int64_t b = 0; b < sequences; ++b) {
    PoolCompressorWindows(kv.data() + b * seq_len * stride, score.data() + b * seq_len * stride,
                          ape.data(), seq_len, ratio, width, want.data() + b * windows * width);
  }
  DeviceVector<float> dkv(kv), dscore(score), dape(ape), dout{std::vector<float>(want.size())};
  ASSERT_EQ(kernels::cuda::LaunchPoolCompressorWindows(dkv.get(), dscore.get(), dape.get(),
                                                       sequences, seq_len, ratio, width,
                                                       dout.get(), launch),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  float kv_max = 0.0f;
  for (float v : kv) kv_max = std::max(kv_max, std::fabs(v));
  const int64_t slots = coff * ratio;
  const double tol = static_cast<double>(16 + 4 * slots) * kEps * 1.01 * kv_max;
  const std::vector<float> got = dout.ToHost();
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol) << "ratio " << ratio << " width " << width << " at " << i;
  }
}

TEST_F(V4CudaMoeTest, CompressorPoolingIsWithinExpfErrorOfTheCpu) {
  // Small: CSA with a partial last window, HCA over two sequences.
  CheckPooling(2, 37, 4, 32, small_);
  CheckPooling(2, 300, 128, 16, small_);
  // V4 Pro: the CSA compressor (512), the indexer's compressor (128), the HCA compressor (512).
  CheckPooling(2, 301, 4, 512, h200_);
  CheckPooling(2, 301, 4, 128, h200_);
  CheckPooling(2, 301, 128, 512, h200_);
}

// ---- mHC pre and head --------------------------------------------------------------------------

V4Config MhcConfig(int64_t d) {
  V4Config c;
  c.hc_mult = 4;
  c.hidden_size = d;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6f;
  c.rms_norm_eps = 1e-6f;
  return c;
}

// fn [rows, width] with entries of deviation 1 / sqrt(width) (mixes of order 1), base [rows].
HyperConnectionWeights RandomHc(int64_t rows, int64_t width, std::vector<float> scale,
                                uint32_t seed) {
  HyperConnectionWeights w;
  w.fn = RandomFloats(rows * width, 1.0f / std::sqrt(static_cast<float>(width)), seed);
  w.base = RandomFloats(rows, 1.0f, seed + 1);
  w.scale = std::move(scale);
  return w;
}

// The GEMM of Mixes (v4_mhc.cc) on the same Gemm: the same call gives the same bits.
std::vector<float> RawMixes(kernels::Gemm& gemm, const std::vector<float>& streams,
                            const std::vector<float>& fn, int64_t tokens, int64_t width) {
  const int64_t rows = static_cast<int64_t>(fn.size()) / width;
  std::vector<float> mixes(tokens * rows, 0.0f);
  const kernels::DenseTensor x{streams.data(), kernels::FloatType::kF32, tokens, width};
  const kernels::DenseTensor w{fn.data(), kernels::FloatType::kF32, rows, width};
  EXPECT_TRUE(gemm.MatMulNT(x, w, mixes.data(), false).ok());
  return mixes;
}

// sum_j |pre_j| |streams_j| per output element: what the collapse's errors scale with.
std::vector<double> CollapseMagnitudes(const float* pre, const std::vector<float>& streams,
                                       int64_t tokens, int64_t hc, int64_t d) {
  std::vector<double> m(tokens * d, 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < hc; ++j) {
      const double p = pre != nullptr ? std::fabs(pre[t * hc + j]) : 1.0;
      for (int64_t c = 0; c < d; ++c) m[t * d + c] += p * std::fabs(streams[(t * hc + j) * d + c]);
    }
  }
  return m;
}

TEST_F(V4CudaMoeTest, HcPreMatchesTheCpu) {
  std::unique_ptr<kernels::Gemm> gemm = kernels::MakeOpenBlasGemm(1);
  for (const auto& [d, tokens, launch] : {std::tuple{int64_t{64}, int64_t{9}, small_},
                                          std::tuple{int64_t{7168}, int64_t{37}, h200_}}) {
    const V4Config c = MhcConfig(d);
    const int64_t hc = c.hc_mult, width = hc * d, mix_width = (2 + hc) * hc;
    const HyperConnectionWeights w = RandomHc(mix_width, width, {0.7f, 1.3f, 2.1f}, 51);
    const std::vector<float> streams = RandomFloats(tokens * width, 1.0f, 53);
    const std::vector<float> raw = RawMixes(*gemm, streams, w.fn, tokens, width);
    DeviceVector<float> dstreams(streams), dscale(w.scale), dbase(w.base);
    for (Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
      const bool round = numerics == Numerics::kOfficial;
      std::vector<float> want(tokens * d);
      HcMix mix;
      ASSERT_TRUE(HcPre(Context(numerics, gemm.get()), c, w, streams.data(), tokens, want.data(),
                        &mix)
                      .ok());

      // Scaled mixes: the CPU's Sinkhorn on them gives HcPre's pre, post and comb bit for bit.
      DeviceVector<float> dmixes(raw);
      ASSERT_EQ(kernels::cuda::LaunchHcScaleMixes(dstreams.get(), tokens, width, c.rms_norm_eps,
                                                  dmixes.get(), mix_width, launch),
                cudaSuccess);
      Sync();
      const std::vector<float> mixes = dmixes.ToHost();
      std::vector<float> pre(tokens * hc), post(tokens * hc), comb(tokens * hc * hc);
      for (int64_t t = 0; t < tokens; ++t) {
        SplitSinkhorn(mixes.data() + t * mix_width, w.scale.data(), w.base.data(), hc,
                      c.hc_sinkhorn_iters, c.hc_eps, pre.data() + t * hc, post.data() + t * hc,
                      comb.data() + t * hc * hc);
      }
      ExpectSameBits(pre, mix.pre);
      ExpectSameBits(post, mix.post);
      ExpectSameBits(comb, mix.comb);

      // The collapse with the CPU's pre: bit-exact.
      DeviceVector<float> dpre(mix.pre), dy{std::vector<float>(tokens * d)};
      ASSERT_EQ(kernels::cuda::LaunchHcCollapse(dpre.get(), dstreams.get(), tokens, hc, d, round,
                                                dy.get(), launch),
                cudaSuccess);
      Sync();
      ExpectSameBits(dy.ToHost(), want);
      if (round) continue;

      // All on the device (math numerics): pre from LaunchSplitSinkhorn is within 1e-6
      // relative of the CPU's (v4_cuda_blocks_test); the collapse's hc products and additions
      // add at most 2 kEps each of sum_j |pre_j s_j| on each side: (1e-6 + 16 kEps) of it.
      DeviceVector<float> dpost(post), dcomb(comb);
      ASSERT_EQ(kernels::cuda::LaunchSplitSinkhorn(dmixes.get(), dscale.get(), dbase.get(), tokens,
                                                   hc, c.hc_sinkhorn_iters, c.hc_eps, dpre.get(),
                                                   dpost.get(), dcomb.get(), launch),
                cudaSuccess);
      ASSERT_EQ(kernels::cuda::LaunchHcCollapse(dpre.get(), dstreams.get(), tokens, hc, d, false,
                                                dy.get(), launch),
                cudaSuccess);
      Sync();
      const std::vector<float> got = dy.ToHost();
      const std::vector<double> mag = CollapseMagnitudes(mix.pre.data(), streams, tokens, hc, d);
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], (1e-6 + 16 * kEps) * mag[i]) << "d " << d << " at " << i;
      }
    }
  }
}

// hc_head in math numerics: the scaled mixes are the CPU's bits (HcPreMatchesTheCpu), each
// weight sigmoid + eps within 12 kEps relative (LaunchHcHeadPre), the collapse adds 16 kEps of
// sum_j |pre_j s_j|; pre_j < 1 + eps, so 32 kEps * (1 + 1e-5) * sum_j |s_j| bounds the
// difference.
TEST_F(V4CudaMoeTest, HcHeadMatchesTheCpuWithinSigmoidError) {
  std::unique_ptr<kernels::Gemm> gemm = kernels::MakeOpenBlasGemm(1);
  for (const auto& [d, tokens, launch] : {std::tuple{int64_t{64}, int64_t{9}, small_},
                                          std::tuple{int64_t{7168}, int64_t{37}, h200_}}) {
    const V4Config c = MhcConfig(d);
    const int64_t hc = c.hc_mult, width = hc * d;
    const HyperConnectionWeights w = RandomHc(hc, width, {0.9f}, 61);
    const std::vector<float> streams = RandomFloats(tokens * width, 1.0f, 63);
    std::vector<float> want(tokens * d);
    ASSERT_TRUE(
        HcHead(Context(Numerics::kMath, gemm.get()), c, w, streams.data(), tokens, want.data())
            .ok());
    DeviceVector<float> dstreams(streams), dscale(w.scale), dbase(w.base);
    DeviceVector<float> dmixes(RawMixes(*gemm, streams, w.fn, tokens, width));
    DeviceVector<float> dpre{std::vector<float>(tokens * hc)}, dy{std::vector<float>(tokens * d)};
    ASSERT_EQ(kernels::cuda::LaunchHcScaleMixes(dstreams.get(), tokens, width, c.rms_norm_eps,
                                                dmixes.get(), hc, launch),
              cudaSuccess);
    ASSERT_EQ(kernels::cuda::LaunchHcHeadPre(dmixes.get(), dscale.get(), dbase.get(), tokens, hc,
                                             c.hc_eps, dpre.get(), launch),
              cudaSuccess);
    ASSERT_EQ(kernels::cuda::LaunchHcCollapse(dpre.get(), dstreams.get(), tokens, hc, d, false,
                                              dy.get(), launch),
              cudaSuccess);
    Sync();
    const std::vector<float> got = dy.ToHost();
    const std::vector<double> mag = CollapseMagnitudes(nullptr, streams, tokens, hc, d);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 32 * kEps * (1 + 1e-5) * mag[i]) << "d " << d << " at " << i;
    }
  }
}

// ---- embedding ---------------------------------------------------------------------------------

// A BF16 table [vocab, d] of random finite values.
std::vector<uint16_t> RandomBf16Table(int64_t vocab, int64_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> table(vocab * d);
  for (uint16_t& b : table) {
    b = static_cast<uint16_t>(rng());
    if ((b & 0x7F80u) == 0x7F80u) b &= 0xFF7Fu;  // an all-ones exponent: make it finite
  }
  return table;
}

TEST_F(V4CudaMoeTest, EmbeddingGatherIsBitExactAndReportsTheFirstBadId) {
  const int64_t hc = 4, tokens = 301;
  // Small; the whole V4 vocabulary (ids up to 129279) with a narrow row; V4 Pro's hidden 7168.
  for (const auto& [vocab, d, launch] : {std::tuple{int64_t{50}, int64_t{64}, small_},
                                         std::tuple{int64_t{129280}, int64_t{64}, h200_},
                                         std::tuple{int64_t{300}, int64_t{7168}, h200_}}) {
    const std::vector<uint16_t> table = RandomBf16Table(vocab, d, 71);
    std::vector<int32_t> ids(tokens);
    std::mt19937 rng(72);
    for (int32_t& id : ids) {
      id = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(vocab - 1))(rng);
    }
    ids[0] = 0;
    ids[1] = static_cast<int32_t>(vocab - 1);
    std::vector<float> want(tokens * hc * d);
    EmbeddingRows(reinterpret_cast<const uint8_t*>(table.data()), d, ids.data(), tokens, hc * d,
                  hc, want.data());
    DeviceVector<uint16_t> dtable(table);
    {
      DeviceVector<int32_t> dids(ids);
      DeviceVector<float> dout{std::vector<float>(want.size())};
      ASSERT_EQ(kernels::cuda::LaunchEmbeddingRows(dtable.get(), vocab, d, dids.get(), tokens,
                                                   hc * d, hc, dout.get(), results_, launch),
                cudaSuccess);
      Sync();
      EXPECT_EQ(FirstBad(), kNoBad);
      ExpectSameBits(dout.ToHost(), want);
    }
    // Two bad ids: the first position is reported, its rows and the other's stay untouched,
    // every other row is the CPU's.
    std::vector<int32_t> with_bad = ids;
    with_bad[9] = static_cast<int32_t>(vocab);
    with_bad[4] = -3;
    const float untouched = -7.0f;
    DeviceVector<int32_t> dids(with_bad);
    DeviceVector<float> dout{std::vector<float>(want.size(), untouched)};
    ASSERT_EQ(kernels::cuda::LaunchEmbeddingRows(dtable.get(), vocab, d, dids.get(), tokens,
                                                 hc * d, hc, dout.get(), results_, launch),
              cudaSuccess);
    Sync();
    EXPECT_EQ(FirstBad(), 4ull);
    const std::vector<float> got = dout.ToHost();
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < hc * d; ++i) {
        const float expected = (t == 4 || t == 9) ? untouched : want[t * hc * d + i];
        ASSERT_EQ(got[t * hc * d + i], expected) << "token " << t << " element " << i;
      }
    }
  }
}

#else  // no CUDA in this build

TEST(V4CudaMoeTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif  // QUANTD_HAVE_CUDA_HEADERS

}  // namespace
}  // namespace quantd::model
