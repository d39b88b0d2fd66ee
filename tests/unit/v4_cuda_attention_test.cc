// The CUDA attention-path blocks of the DeepSeek-V4 forward (kernels/cuda/v4_attention_blocks.h)
// against their CPU blocks (server/model/) on the same inputs: the indexer's Hadamard transform,
// FP4 simulation and scores bit-exact; the picks equal to the CPU's where no scores tie and in
// the device's stated total order where they do; the sparse attention within a tolerance
// derived below. Skips without a CUDA device (builds without CUDA have no such blocks and skip
// as well).
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/formats.h"
#include "kernels/gemm.h"
#include "server/model/v4_attention_sparse.h"
#include "server/model/v4_indexer.h"
#include "server/model/v4_linear.h"
#include "server/model/v4_numerics.h"
#include "server/model/v4_parallel.h"

#if QUANTD_HAVE_CUDA_HEADERS
#include <cuda_runtime_api.h>

#include "kernels/cuda/v4_attention_blocks.h"
#include "tests/unit/v4_cuda_test_util.h"
#endif

namespace quantd::model {
namespace {

#if QUANTD_HAVE_CUDA_HEADERS

using kernels::cuda::kNoBad;
using kernels::cuda::Launch;
using testing_util::DeviceVector;
using testing_util::ExpectSameBits;
using testing_util::RandomFloats;

// The attention's block layouts at DeepSeek-V4 sizes for a 227 KiB per-block limit (sm_90,
// sm_100): host arithmetic, so this runs without a device. Two CSA blocks fit on one SM (228
// KiB, 1 KiB reserved per block).
TEST(V4CudaAttentionPlanTest, LayoutsAtV4Sizes) {
  using kernels::cuda::PlanSparseAttention;
  const int64_t limit = 227 * 1024;
  const int32_t no_pick = -1;  // the plan reads only whether there are picks
  kernels::SparseAttentionArgs pro;
  pro.seq_len = 8192;
  pro.heads = 128;
  pro.head_dim = 512;
  pro.window = 128;
  pro.ratio = 4;
  pro.entries = 2048;
  pro.picks = &no_pick;
  pro.picks_per_query = 1024;
  struct Want {
    int64_t heads_per_block, groups, shared_bytes;
  };
  const auto expect = [](const kernels::cuda::SparseAttentionPlan& got, const Want& want) {
    EXPECT_EQ(got.heads_per_block, want.heads_per_block);
    EXPECT_EQ(got.groups, want.groups);
    EXPECT_EQ(got.shared_bytes, want.shared_bytes);
  };
  // Pro CSA: 1152 slots, 18 softmax blocks; 4 * (1152 + 13 * (512 + 1152 + 1 + 54)).
  expect(PlanSparseAttention(pro, true, limit), {13, 10, 93996});
  expect(PlanSparseAttention(pro, false, limit), {13, 10, 91188});
  EXPECT_LE(2 * (93996 + 1024), 228 * 1024);
  // Below the 100 KiB target the limit decides: 8 heads of 1719 floats.
  expect(PlanSparseAttention(pro, true, 64 * 1024), {8, 16, 59616});
  // Flash CSA: 64 heads, 512 picks.
  kernels::SparseAttentionArgs flash = pro;
  flash.heads = 64;
  flash.picks_per_query = 512;
  expect(PlanSparseAttention(flash, true, limit), {16, 4, 78272});
  // Pro HCA at 8192 tokens (64 entries), and at 2^20 tokens (8192 entries: one head per block).
  kernels::SparseAttentionArgs hca = pro;
  hca.ratio = 128;
  hca.entries = 64;
  hca.picks = nullptr;
  hca.picks_per_query = 0;
  expect(PlanSparseAttention(hca, true, limit), {16, 8, 46464});
  hca.seq_len = int64_t{1} << 20;
  hca.entries = 8192;
  expect(PlanSparseAttention(hca, true, limit), {1, 128, 70172});
  // One head's q alone beyond the limit.
  hca.head_dim = int64_t{1} << 20;
  EXPECT_EQ(PlanSparseAttention(hca, true, limit).heads_per_block, 0);
}

class V4CudaAttentionTest : public testing_util::CudaDeviceTest {
 protected:
  ForwardContext Context(Numerics numerics) {
    ForwardContext ctx;
    ctx.gemm = gemm_.get();
    ctx.numerics = numerics;
    return ctx;
  }
  // LaunchSelectTopEntries over host scores [queries, entries], with the scratch it asks for.
  std::vector<int32_t> DevicePicks(const std::vector<float>& scores, int64_t first_position,
                                   int64_t queries, int64_t entries, int64_t ratio, int64_t k) {
    const int64_t scratch_bytes = kernels::cuda::TopEntriesScratchBytes(queries, entries);
    EXPECT_GT(scratch_bytes, 0);
    DeviceVector<float> dscores(scores);
    DeviceVector<int32_t> dpicks(std::vector<int32_t>(queries * k, -7));
    DeviceVector<uint8_t> scratch(
        std::vector<uint8_t>(static_cast<size_t>(std::max<int64_t>(scratch_bytes, 1))));
    EXPECT_EQ(kernels::cuda::LaunchSelectTopEntries(dscores.get(), first_position, queries,
                                                    entries, ratio, k, scratch.get(),
                                                    dpicks.get(), launch_),
              cudaSuccess);
    Sync();
    return dpicks.ToHost();
  }

  // A small grid (4 blocks) so that the block loops take several turns.
  const Launch launch_{nullptr, 4};
  std::unique_ptr<kernels::Gemm> gemm_ = kernels::MakeOpenBlasGemm(1);
};

// ---- Sparse attention -------------------------------------------------------------------------

struct AttentionCase {
  const char* name;
  int64_t seq_len, heads, head_dim, window, ratio;
  int64_t picks_per_query;  // CSA; 0: every visible entry (HCA), or no entries (ratio 0)
};

// Host inputs of one case: q and keys are multiples of 1/4 in [-2, 2] (scores of standard
// deviation ~1.5 at head_dim 512), so that every product q_i k_i is a multiple of 2^-4 below 4
// and every partial sum of up to 512 of them is exact in float32: both sides' q . k are exact
// whatever their order, and the scores are the same bits. Sinks around 3, so that the sink's
// term is a sizeable part of the denominator next to ~128 keys. CSA picks a shuffled subset of
// the visible entries with every fifth slot and the slots beyond the visible ones unused (-1).
std::vector<float> RandomQuarters(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> quarters(-8, 8);
  std::vector<float> v(n);
  for (float& x : v) x = 0.25f * static_cast<float>(quarters(rng));
  return v;
}

struct AttentionInputs {
  std::vector<float> q, kv, compressed, sink;
  std::vector<int32_t> picks;
  kernels::SparseAttentionArgs in;
};

AttentionInputs MakeAttentionInputs(const AttentionCase& c, uint32_t seed) {
  AttentionInputs a;
  std::mt19937 rng(seed);
  const int64_t entries = c.ratio == 0 ? 0 : c.seq_len / c.ratio;
  a.q = RandomQuarters(c.seq_len * c.heads * c.head_dim, seed + 1);
  a.kv = RandomQuarters(c.seq_len * c.head_dim, seed + 2);
  a.compressed = RandomQuarters(std::max<int64_t>(entries, 1) * c.head_dim, seed + 3);
  a.sink = RandomFloats(c.heads, 1.0f, seed + 4);
  for (float& s : a.sink) s += 3.0f;
  if (c.picks_per_query > 0) {
    a.picks.assign(c.seq_len * c.picks_per_query, -1);
    for (int64_t t = 0; t < c.seq_len; ++t) {
      std::vector<int32_t> visible(std::min(entries, (t + 1) / c.ratio));
      std::iota(visible.begin(), visible.end(), 0);
      std::shuffle(visible.begin(), visible.end(), rng);
      for (int64_t i = 0; i < std::min<int64_t>(c.picks_per_query, visible.size()); ++i) {
        if (i % 5 != 2) a.picks[t * c.picks_per_query + i] = visible[i];
      }
    }
  }
  a.in.q = a.q.data();
  a.in.kv = a.kv.data();
  a.in.compressed = entries > 0 ? a.compressed.data() : nullptr;
  a.in.entries = entries;
  a.in.picks = c.picks_per_query > 0 ? a.picks.data() : nullptr;
  a.in.picks_per_query = c.picks_per_query;
  a.in.sink = a.sink.data();
  a.in.seq_len = c.seq_len;
  a.in.heads = c.heads;
  a.in.head_dim = c.head_dim;
  a.in.window = c.window;
  a.in.ratio = c.ratio;
  return a;
}

// How far the device's o[t, h, :] may be from the CPU's, per column, from the worst-case
// float32 error of each step (u = 2^-24, n = keys read + 1 for the sink), given exact scores
// (AttentionInputs):
//   e = exp(s - m) from the same s and m: expf is within 2 ulp, the host's exp within 1 (an ulp
//     is at most 2u relative): de/e <= 6u.
//   the sum of e in the same order on both sides, each within n u of its exact sum; p = e / sum
//     rounds once more: dp/p <= 2 de/e + 2 n u + 2u.
//   P . V in different orders (the CPU's GEMM): each within n u sum p |k| of the exact one.
// so math: |do| <= c M with c = (4n + 14) u and M = sum p |k| (p in double).
// official adds the BF16 rounding of each e (values de/e apart may round to neighbours, one
// BF16 ulp = 2^-7 relative apart), the per-block factors and chained sum (at most 2 expf and 2
// roundings per softmax block on each side: 16 u per block), and the BF16 rounding of o itself
// (results c M apart round at most one BF16 ulp, 2^-7 |o|, further apart).
struct AttentionBound {
  double math = 0.0;      // c
  double official = 0.0;  // c plus the BF16 terms of P, without the output rounding
  std::vector<double> m;  // M per column
};

AttentionBound BoundFor(const kernels::SparseAttentionArgs& in, int64_t t, int64_t h) {
  const int64_t d = in.head_dim;
  const double u = 0x1p-24;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const float* q = in.q + (t * in.heads + h) * d;
  std::vector<const float*> keys;
  for (int64_t k = std::max<int64_t>(0, t - in.window + 1); k <= t; ++k) keys.push_back(in.kv + k * d);
  int64_t compressed_slots = 0;
  if (in.ratio > 0 && in.picks != nullptr) {
    compressed_slots = in.picks_per_query;
    for (int64_t i = 0; i < in.picks_per_query; ++i) {
      const int32_t e = in.picks[t * in.picks_per_query + i];
      if (e >= 0) keys.push_back(in.compressed + e * d);
    }
  } else if (in.ratio > 0) {
    compressed_slots = in.entries;
    for (int64_t e = 0; e < std::min(in.entries, (t + 1) / in.ratio); ++e) {
      keys.push_back(in.compressed + e * d);
    }
  }
  std::vector<double> s;
  for (const float* k : keys) {
    double dot = 0.0;
    for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(q[i]) * k[i];
    s.push_back(dot * scale);
  }
  double m = in.sink[h];
  for (double v : s) m = std::max(m, v);
  double sum = std::exp(in.sink[h] - m);
  for (double v : s) sum += std::exp(v - m);
  AttentionBound b;
  b.m.assign(static_cast<size_t>(d), 0.0);
  for (size_t j = 0; j < keys.size(); ++j) {
    const double p = std::exp(s[j] - m) / sum;
    for (int64_t i = 0; i < d; ++i) b.m[i] += p * std::fabs(keys[j][i]);
  }
  const double n = static_cast<double>(keys.size() + 1);
  const int64_t slots = std::min(in.seq_len, in.window) + compressed_slots;
  const double softmax_blocks = static_cast<double>((slots + 63) / 64);
  b.math = (4.0 * n + 14.0) * u;
  b.official = b.math + 0x1p-7 + 16.0 * softmax_blocks * u;
  return b;
}

// Runs one case on both sides in both numerics and compares. official: besides the bound, at
// least 90% of the elements must be bit-identical. A difference needs the two unrounded values
// on both sides of a BF16 rounding boundary; they are typically ~1e-6 relative apart (expf, a
// rare BF16 flip among ~100 P weights, GEMM order), a 256 * 1e-6 chance per element, so a 10%
// mismatch means different operations (P or o not rounded, a different block split).
void ExpectAttentionMatches(const AttentionCase& c, const Launch& launch,
                            const ForwardContext& math_ctx, const ForwardContext& official_ctx) {
  SCOPED_TRACE(c.name);
  AttentionInputs a = MakeAttentionInputs(c, 100);
  const int64_t out_size = c.seq_len * c.heads * c.head_dim;
  DeviceVector<float> dq(a.q), dkv(a.kv), dcompressed(a.compressed), dsink(a.sink);
  DeviceVector<int32_t> dpicks(a.picks.empty() ? std::vector<int32_t>{-1} : a.picks);
  kernels::SparseAttentionArgs args;
  args.q = dq.get();
  args.kv = dkv.get();
  args.compressed = a.in.compressed != nullptr ? dcompressed.get() : nullptr;
  args.entries = a.in.entries;
  args.picks = a.in.picks != nullptr ? dpicks.get() : nullptr;
  args.picks_per_query = a.in.picks_per_query;
  args.sink = dsink.get();
  args.seq_len = c.seq_len;
  args.heads = c.heads;
  args.head_dim = c.head_dim;
  args.window = c.window;
  args.ratio = c.ratio;

  std::vector<AttentionBound> bounds;
  for (int64_t t = 0; t < c.seq_len; ++t) {
    for (int64_t h = 0; h < c.heads; ++h) bounds.push_back(BoundFor(a.in, t, h));
  }
  for (const bool official : {false, true}) {
    SCOPED_TRACE(official ? "official" : "math");
    std::vector<float> want(out_size);
    ASSERT_TRUE(SparseAttention(official ? official_ctx : math_ctx, a.in, want.data()).ok());
    DeviceVector<float> dout(std::vector<float>(out_size, 0.0f));
    ASSERT_EQ(kernels::cuda::LaunchSparseAttention(args, official, dout.get(), launch),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = dout.ToHost();
    int64_t same_bits = 0;
    for (int64_t r = 0; r < c.seq_len * c.heads; ++r) {
      const AttentionBound& b = bounds[r];
      for (int64_t i = 0; i < c.head_dim; ++i) {
        const int64_t at = r * c.head_dim + i;
        double tol = (official ? b.official : b.math) * b.m[i];
        if (official) tol += 0x1p-7 * (std::fabs(want[at]) + tol);
        ASSERT_NEAR(got[at], want[at], tol + 1e-30)
            << "token " << r / c.heads << " head " << r % c.heads << " column " << i;
        same_bits += memcmp(&got[at], &want[at], 4) == 0;
      }
    }
    if (official) {
      EXPECT_GE(same_bits, out_size * 9 / 10) << "of " << out_size;
    }
  }
}

TEST_F(V4CudaAttentionTest, SparseAttentionIsWithinTheDerivedBoundOfTheCpu) {
  const AttentionCase cases[] = {
      // name, seq_len, heads, head_dim, window, ratio, picks_per_query
      {"HCA, window 128 shorter than seq_len", 300, 20, 512, 128, 8, 0},
      {"CSA, unused picks", 300, 20, 512, 128, 4, 70},
      {"HCA, window longer than seq_len", 45, 3, 64, 128, 4, 0},
      {"window only", 70, 5, 32, 16, 0, 0},
      // V4 Pro's shape: 128 heads of 512, window 128, 1024 picks (most unused at this length).
      {"CSA at V4 Pro sizes", 100, 128, 512, 128, 4, 1024},
  };
  for (const AttentionCase& c : cases) {
    ExpectAttentionMatches(c, launch_, Context(Numerics::kMath), Context(Numerics::kOfficial));
  }
}

TEST_F(V4CudaAttentionTest, SparseAttentionRejectsWhatItCannotServe) {
  kernels::SparseAttentionArgs args;
  args.seq_len = 4;
  args.heads = 1;
  args.head_dim = 8;
  args.window = 0;
  EXPECT_EQ(kernels::cuda::LaunchSparseAttention(args, true, nullptr, launch_),
            cudaErrorInvalidValue);
  // One head's q, scores and key rows beyond any device's shared memory.
  args.window = 1;
  args.head_dim = int64_t{1} << 20;
  EXPECT_EQ(kernels::cuda::LaunchSparseAttention(args, true, nullptr, launch_),
            cudaErrorInvalidValue);
}

// ---- Indexer ----------------------------------------------------------------------------------

TEST_F(V4CudaAttentionTest, HadamardRowsIsBitExact) {
  for (int64_t n : {1, 2, 64, 128, 512}) {
    const int64_t rows = 37;
    std::vector<float> want = RandomFloats(rows * n, 2.0f, 30);
    DeviceVector<float> dx(want);
    HadamardRows(want.data(), rows, n);
    ASSERT_EQ(kernels::cuda::LaunchHadamardRows(dx.get(), rows, n, /*round_bf16=*/false, launch_),
              cudaSuccess);
    Sync();
    SCOPED_TRACE(n);
    ExpectSameBits(dx.ToHost(), want);
  }
  float x = 0.0f;
  EXPECT_EQ(kernels::cuda::LaunchHadamardRows(&x, 1, 96, false, launch_), cudaErrorInvalidValue);
}

TEST_F(V4CudaAttentionTest, SimulateIndexerFp4IsBitExactAndReportsTheFirstNonFinite) {
  const int64_t rows = 64 * 5, n = 128;  // 5 tokens of V4's 64 indexer heads of 128
  std::vector<float> x = RandomFloats(rows * n, 1.5f, 31);
  for (int64_t c = 0; c < n; ++c) x[9 * n + c] *= 1e-30f;  // a row below the FP4 amax floor
  std::vector<float> want = x;
  ASSERT_TRUE(SimulateIndexerFp4(want.data(), rows, n, HostThreads{}).ok());
  DeviceVector<float> dx(x);
  ASSERT_EQ(kernels::cuda::LaunchSimulateIndexerFp4(dx.get(), rows, n, results_, launch_),
            cudaSuccess);
  Sync();
  EXPECT_EQ(FirstBad(), kNoBad);
  ExpectSameBits(dx.ToHost(), want);

  // An infinity in row 7 makes the whole transformed row infinite: its first column is named,
  // where the CPU block fails.
  x[7 * n + 3] = INFINITY;
  std::vector<float> cpu = x;
  EXPECT_FALSE(SimulateIndexerFp4(cpu.data(), rows, n, HostThreads{}).ok());
  DeviceVector<float> bad(x);
  ASSERT_EQ(kernels::cuda::LaunchSimulateIndexerFp4(bad.get(), rows, n, results_, launch_),
            cudaSuccess);
  Sync();
  EXPECT_EQ(FirstBad(), static_cast<unsigned long long>(7 * n));
  // A row of 16: no whole FP4 block.
  EXPECT_EQ(kernels::cuda::LaunchSimulateIndexerFp4(bad.get(), 1, 16, results_, launch_),
            cudaErrorInvalidValue);
}

TEST_F(V4CudaAttentionTest, IndexerScoresAreBitExactAndWriteOnlyVisibleEntries) {
  const int64_t queries = 37, heads = 64, dim = 128, entries = 50, ratio = 4;
  const int64_t first_position = 150;  // the queries see 37 .. 46 entries of 50
  const std::vector<float> dots = RandomFloats(queries * heads * entries, 3.0f, 32);
  std::vector<float> weights = RandomFloats(queries * heads, 1.0f, 33);
  const float unwritten = 12345.0f;
  for (const Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
    const bool official = numerics == Numerics::kOfficial;
    std::vector<float> w = weights;
    if (official) {  // RunIndexer's BF16 weights
      for (float& v : w) v = formats::RoundToBf16(v * 0.0110485f);
    }
    std::vector<float> want(queries * entries, unwritten);
    IndexerScores(numerics, dots.data(), w.data(), queries, heads, dim, entries, first_position,
                  ratio, want.data());
    DeviceVector<float> ddots(dots), dw(w), dscores(std::vector<float>(want.size(), unwritten));
    ASSERT_EQ(kernels::cuda::LaunchIndexerScores(official, ddots.get(), dw.get(), queries, heads,
                                                 dim, entries, first_position, ratio,
                                                 dscores.get(), launch_),
              cudaSuccess);
    Sync();
    SCOPED_TRACE(NumericsName(numerics));
    ExpectSameBits(dscores.ToHost(), want);
  }
}

// ---- Indexer picks -----------------------------------------------------------------------------

int64_t VisibleEntries(int64_t first_position, int64_t i, int64_t entries, int64_t ratio) {
  return std::min(entries, (first_position + i + 1) / ratio);
}

// Rows of pairwise distinct scores: each row a shuffled permutation of (v - entries / 2) / 8.
std::vector<float> DistinctScores(std::mt19937& rng, int64_t queries, int64_t entries) {
  std::vector<float> v(static_cast<size_t>(queries * entries));
  for (int64_t i = 0; i < queries; ++i) {
    float* row = v.data() + i * entries;
    for (int64_t s = 0; s < entries; ++s) row[s] = static_cast<float>(s - entries / 2) / 8.0f;
    std::shuffle(row, row + entries, rng);
  }
  return v;
}

// Scores taking only `levels` distinct values, so that most of them tie; with `signed_zeros`
// every zero is -0.0 or +0.0 at random (equal scores to both sides' comparisons).
std::vector<float> TiedScores(std::mt19937& rng, int64_t n, int levels, bool signed_zeros) {
  std::uniform_int_distribution<int> level(0, levels - 1);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    x = 0.25f * static_cast<float>(level(rng));
    if (signed_zeros && x == 0.0f && negative(rng)) x = -0.0f;
  }
  return v;
}

// The device's stated order, computed here: per query, its visible entries in id order, sorted
// by score descending with NaN as -inf by std::stable_sort (equal scores keep id order), the
// first k of them, then -1.
std::vector<int32_t> TotalOrderPicks(const std::vector<float>& scores, int64_t first_position,
                                     int64_t queries, int64_t entries, int64_t ratio, int64_t k) {
  std::vector<int32_t> picks(static_cast<size_t>(queries * k), -1);
  std::vector<int32_t> order;
  for (int64_t i = 0; i < queries; ++i) {
    const float* row = scores.data() + i * entries;
    const auto key = [row](int32_t s) {
      return std::isnan(row[s]) ? -std::numeric_limits<float>::infinity() : row[s];
    };
    order.resize(static_cast<size_t>(VisibleEntries(first_position, i, entries, ratio)));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&key](int32_t a, int32_t b) { return key(a) > key(b); });
    const int64_t n = std::min<int64_t>(k, static_cast<int64_t>(order.size()));
    std::copy(order.begin(), order.begin() + n, picks.begin() + i * k);
  }
  return picks;
}

// The picks' scores slot by slot, kNoPick for a -1 slot: two equal sequences hold the same
// multiset of scores per query in the same order (-0.0 == +0.0).
constexpr double kNoPick = -1e300;
std::vector<double> PickedScores(const std::vector<float>& scores,
                                 const std::vector<int32_t>& picks, int64_t entries, int64_t k) {
  std::vector<double> v(picks.size());
  for (size_t j = 0; j < picks.size(); ++j) {
    const int64_t query = static_cast<int64_t>(j) / k;
    v[j] = picks[j] < 0 ? kNoPick : scores[query * entries + picks[j]];
  }
  return v;
}

struct PicksCase {
  int64_t queries, entries, ratio, first_position;
  std::vector<int64_t> ks;
};

// Queries that see all, part or none of the entries; entries 997 (prime), 7 and 1; k = 1, the
// CPU's partial_sort path (k * 64 <= entries), its nth_element path, and k = entries.
const std::vector<PicksCase>& PicksCases() {
  static const auto* cases = new std::vector<PicksCase>{
      {70, 300, 4, 1150, {1, 4, 200, 300}},  // the queries see 287 .. 300 entries
      {40, 997, 1, 0, {1, 15, 37, 997}},     // 1 .. 40 entries: most slots -1
      {40, 7, 4, 0, {1, 7}},                 // 0 .. 7 entries: the first 3 queries none
      {10, 1, 4, 2, {1}},                    // 0 or 1 entry
  };
  return *cases;
}

// Scores without ties: the device picks the CPU's integers.
TEST_F(V4CudaAttentionTest, SelectTopEntriesEqualsTheCpuWithoutTies) {
  std::mt19937 rng(34);
  for (const PicksCase& c : PicksCases()) {
    const std::vector<float> scores = DistinctScores(rng, c.queries, c.entries);
    for (const int64_t k : c.ks) {
      SCOPED_TRACE(testing::Message() << "entries " << c.entries << " k " << k);
      std::vector<int32_t> want(c.queries * k);
      SelectTopEntries(scores.data(), c.first_position, c.queries, c.entries, c.ratio, k,
                       want.data());
      EXPECT_EQ(DevicePicks(scores, c.first_position, c.queries, c.entries, c.ratio, k), want);
    }
  }
}

// Scores with many exact ties (one to forty levels, signed zeros): the device's picks are the
// total order's, slot by slot, and their scores are the CPU picks' scores in the same order.
TEST_F(V4CudaAttentionTest, SelectTopEntriesOrdersTiesByEntryIdWithTheCpuScores) {
  std::mt19937 rng(35);
  for (const PicksCase& c : PicksCases()) {
    for (const int levels : {1, 2, 3, 40}) {
      const std::vector<float> scores =
          TiedScores(rng, c.queries * c.entries, levels, /*signed_zeros=*/levels <= 3);
      for (const int64_t k : c.ks) {
        SCOPED_TRACE(testing::Message()
                     << "entries " << c.entries << " k " << k << " levels " << levels);
        std::vector<int32_t> cpu(c.queries * k);
        SelectTopEntries(scores.data(), c.first_position, c.queries, c.entries, c.ratio, k,
                         cpu.data());
        const std::vector<int32_t> got =
            DevicePicks(scores, c.first_position, c.queries, c.entries, c.ratio, k);
        EXPECT_EQ(got, TotalOrderPicks(scores, c.first_position, c.queries, c.entries, c.ratio, k));
        EXPECT_EQ(PickedScores(scores, got, c.entries, k),
                  PickedScores(scores, cpu, c.entries, k));
      }
    }
  }
}

// Future entries are never read or picked, whatever their scores (+inf, NaN, huge); slot j of
// the query at t holds -1 exactly when j >= its visible entries; visible -inf and NaN scores
// rank last among the visible ones, NaN as -inf.
TEST_F(V4CudaAttentionTest, SelectTopEntriesPicksOnlyVisibleEntries) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // One query seeing entries 0..4 of 6: 2, then the zeros by id (-0.0 at 3, +0.0 at 4), then
  // NaN (0) and -inf (1) as equals by id, then -1 for the future entry 5.
  const std::vector<float> row = {nan, -inf, 2.0f, -0.0f, 0.0f, 9.0f};
  EXPECT_EQ(DevicePicks(row, /*first_position=*/4, 1, 6, /*ratio=*/1, 6),
            (std::vector<int32_t>{2, 3, 4, 0, 1, -1}));
  EXPECT_EQ(DevicePicks(row, 4, 1, 6, 1, 1), (std::vector<int32_t>{2}));

  std::mt19937 rng(36);
  const int64_t queries = 50, entries = 37, ratio = 4, first_position = 100;  // 25 .. 37 visible
  std::vector<float> scores = TiedScores(rng, queries * entries, 5, /*signed_zeros=*/true);
  const float specials[] = {inf, nan, 1e30f, -inf};
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t visible = VisibleEntries(first_position, i, entries, ratio);
    for (int64_t s = 0; s < entries; ++s) {
      float& x = scores[i * entries + s];
      if (s >= visible) x = specials[s % 3];  // future: better than any visible score, or NaN
      if (s < visible && s % 7 == 3) x = specials[1 + 2 * (s % 2)];  // visible NaN or -inf
    }
  }
  for (const int64_t k : {int64_t{1}, int64_t{30}, entries}) {
    SCOPED_TRACE(k);
    const std::vector<int32_t> got =
        DevicePicks(scores, first_position, queries, entries, ratio, k);
    EXPECT_EQ(got, TotalOrderPicks(scores, first_position, queries, entries, ratio, k));
    for (int64_t i = 0; i < queries; ++i) {
      const int64_t visible = VisibleEntries(first_position, i, entries, ratio);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = got[i * k + j];
        if (j < visible) {
          EXPECT_TRUE(e >= 0 && e < visible) << "query " << i << " slot " << j << " entry " << e;
        } else {
          EXPECT_EQ(e, -1) << "query " << i << " slot " << j;
        }
      }
    }
  }
}

// More rows than one sort pass holds (2^22 entries: 838 rows of 5000), and one row longer than a
// pass: the same order as in one pass.
TEST_F(V4CudaAttentionTest, SelectTopEntriesAcrossSortPasses) {
  std::mt19937 rng(37);
  struct Case {
    int64_t queries, entries, first_position, k;
  };
  for (const Case& c : {Case{900, 5000, 4500, 64}, Case{2, (int64_t{1} << 22) + 3, 1 << 22, 5}}) {
    SCOPED_TRACE(c.entries);
    const std::vector<float> scores = TiedScores(rng, c.queries * c.entries, 1000, false);
    std::vector<int32_t> cpu(c.queries * c.k);
    SelectTopEntries(scores.data(), c.first_position, c.queries, c.entries, 1, c.k, cpu.data());
    const std::vector<int32_t> got =
        DevicePicks(scores, c.first_position, c.queries, c.entries, 1, c.k);
    EXPECT_EQ(got, TotalOrderPicks(scores, c.first_position, c.queries, c.entries, 1, c.k));
    EXPECT_EQ(PickedScores(scores, got, c.entries, c.k),
              PickedScores(scores, cpu, c.entries, c.k));
  }
}

// The scratch covers one pass: as many rows as fill 2^22 entries (16 bytes each: two buffers of
// keys and of ids) plus two int32 offsets per row and CUB's temporary storage, which with both
// buffers given holds no copy of the items (a few hundred bytes; 1 MiB allowed).
TEST_F(V4CudaAttentionTest, TopEntriesScratchCoversOnePass) {
  using kernels::cuda::TopEntriesScratchBytes;
  const int64_t pass_rows = (int64_t{1} << 22) / 2048;
  EXPECT_EQ(TopEntriesScratchBytes(1000000, 2048), TopEntriesScratchBytes(pass_rows, 2048));
  EXPECT_GE(TopEntriesScratchBytes(pass_rows, 2048), 16 * (int64_t{1} << 22) + 8 * pass_rows);
  EXPECT_LE(TopEntriesScratchBytes(pass_rows, 2048), 16 * (int64_t{1} << 22) + (1 << 20));
  EXPECT_GE(TopEntriesScratchBytes(3, int64_t{1} << 23), 16 * (int64_t{1} << 23));
  EXPECT_LT(TopEntriesScratchBytes(3, 100), 16 * 300 + (1 << 20));
}

// Argument checks and empty work, before any device call.
TEST(V4CudaTopEntriesArgsTest, RejectsOrSkipsWithoutADevice) {
  using kernels::cuda::LaunchSelectTopEntries;
  using kernels::cuda::TopEntriesScratchBytes;
  const Launch launch{nullptr, 1};
  EXPECT_EQ(TopEntriesScratchBytes(0, 10), 0);
  EXPECT_EQ(TopEntriesScratchBytes(10, 0), 0);
  EXPECT_EQ(TopEntriesScratchBytes(1, int64_t{1} << 31), -1);
  EXPECT_EQ(LaunchSelectTopEntries(nullptr, 0, 4, 10, 4, 11, nullptr, nullptr, launch),
            cudaErrorInvalidValue);  // k > entries
  EXPECT_EQ(LaunchSelectTopEntries(nullptr, 0, 4, 10, 0, 1, nullptr, nullptr, launch),
            cudaErrorInvalidValue);  // ratio 0
  EXPECT_EQ(LaunchSelectTopEntries(nullptr, 0, 4, int64_t{1} << 31, 4, 1, nullptr, nullptr,
                                   launch),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSelectTopEntries(nullptr, 0, 4, 10, 4, 0, nullptr, nullptr, launch),
            cudaSuccess);  // k = 0
  EXPECT_EQ(LaunchSelectTopEntries(nullptr, 0, 0, 10, 4, 3, nullptr, nullptr, launch),
            cudaSuccess);  // no queries
}

// The indexer's official path on the device end to end from the dot products: scores with
// exact-zero and BF16 ties bit-exact, then the picks in the total order with the CPU's scores.
TEST_F(V4CudaAttentionTest, IndexerScoresThenPicksFollowTheCpu) {
  const int64_t queries = 64, heads = 64, dim = 128, entries = 128, ratio = 4, k = 100;
  const int64_t first_position = 400;  // the queries see 100 .. 116 entries
  std::vector<float> dots = RandomFloats(queries * heads * entries, 1.0f, 35);
  for (float& d : dots) d -= 1.0f;  // mostly negative: many all-zero (tied) scores
  std::vector<float> weights = RandomFloats(queries * heads, 1.0f, 36);
  for (float& v : weights) v = formats::RoundToBf16(v * 0.0110485f);
  std::vector<float> scores(queries * entries, 0.0f);
  IndexerScores(Numerics::kOfficial, dots.data(), weights.data(), queries, heads, dim, entries,
                first_position, ratio, scores.data());
  std::vector<int32_t> cpu(queries * k);
  SelectTopEntries(scores.data(), first_position, queries, entries, ratio, k, cpu.data());

  DeviceVector<float> ddots(dots), dw(weights), dscores(std::vector<float>(scores.size(), 0.0f));
  DeviceVector<int32_t> dpicks(std::vector<int32_t>(cpu.size(), -7));
  DeviceVector<uint8_t> scratch(std::vector<uint8_t>(
      static_cast<size_t>(kernels::cuda::TopEntriesScratchBytes(queries, entries))));
  ASSERT_EQ(kernels::cuda::LaunchIndexerScores(true, ddots.get(), dw.get(), queries, heads, dim,
                                               entries, first_position, ratio, dscores.get(),
                                               launch_),
            cudaSuccess);
  ASSERT_EQ(kernels::cuda::LaunchSelectTopEntries(dscores.get(), first_position, queries, entries,
                                                  ratio, k, scratch.get(), dpicks.get(),
                                                  launch_),
            cudaSuccess);
  Sync();
  ExpectSameBits(dscores.ToHost(), scores);
  const std::vector<int32_t> got = dpicks.ToHost();
  EXPECT_EQ(got, TotalOrderPicks(scores, first_position, queries, entries, ratio, k));
  EXPECT_EQ(PickedScores(scores, got, entries, k), PickedScores(scores, cpu, entries, k));
}

#else  // no CUDA in this build

TEST(V4CudaAttentionTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif  // QUANTD_HAVE_CUDA_HEADERS

}  // namespace
}  // namespace quantd::model
