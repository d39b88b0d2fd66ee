// DeepSeek-V4 attention sub-blocks against scalar references written from the official formulas
// (inference/model.py precompute_freqs_cis, Compressor, Indexer, sparse_attn) in double
// precision, and whole-sub-block properties (causality, independence of sequences, what the
// observer sees, shape validation).
//
// Tolerances: float32 results against double references of sums of n products of O(1) values
// differ by at most ~n * 2^-24 relative; the bounds below are that with margin. Official
// numerics round P and the output to BF16 (relative 2^-9 each), so against the float32
// reference they are bounded by 2^-8 * max|v| plus the float32 term.
#include "server/model/v4_attention.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "kernels/gemm.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/safetensors_reader.h"
#include "server/model/v4_attention_sparse.h"
#include "server/model/v4_compressor.h"
#include "server/model/v4_indexer.h"
#include "server/model/v4_rope.h"

namespace quantd::model {
namespace {

// ---- RoPE -------------------------------------------------------------------------------------

TEST(V4RopeTest, PlainFrequenciesAreThetaPowers) {
  const std::vector<float> f = RopeInvFreq(64, 10000.0, /*yarn=*/false, 16.0, 65536, 32, 1);
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    const double expected = std::pow(10000.0, -2.0 * i / 64.0);
    EXPECT_NEAR(f[i], expected, 4e-7 * expected) << i;
  }
}

TEST(V4RopeTest, YarnBlendsBetweenTheCorrectionDims) {
  // DeepSeek-V4 compressed layers: theta 160000, factor 16, original 65536, beta 32 / 1.
  // corr(32) = 64 ln(65536 / (64 pi)) / (2 ln 160000) = 15.45 -> low 15;
  // corr(1) = 64 ln(65536 / (2 pi)) / (2 ln 160000) = 24.71 -> high 25.
  const std::vector<float> plain = RopeInvFreq(64, 160000.0, false, 16.0, 65536, 32, 1);
  const std::vector<float> yarn = RopeInvFreq(64, 160000.0, true, 16.0, 65536, 32, 1);
  for (int i = 0; i <= 15; ++i) EXPECT_EQ(yarn[i], plain[i]) << i;          // extrapolated
  for (int i = 25; i < 32; ++i) EXPECT_EQ(yarn[i], plain[i] / 16.0f) << i;  // interpolated
  for (int i = 16; i < 25; ++i) {
    const double ramp = (i - 15) / 10.0;
    const double expected = plain[i] / 16.0 * ramp + plain[i] * (1.0 - ramp);
    EXPECT_NEAR(yarn[i], expected, 4e-7 * expected) << i;
  }
}

TEST(V4RopeTest, LayerFrequenciesFollowTheCompressRatio) {
  V4Config config;
  config.qk_rope_head_dim = 64;
  config.rope_theta = 10000.0;
  config.compress_rope_theta = 160000.0;
  config.rope_factor = 16.0;
  config.original_max_position_embeddings = 65536;
  config.beta_fast = 32;
  config.beta_slow = 1;
  config.num_hidden_layers = 3;
  config.compress_ratios = {0, 4, 128, 0};
  EXPECT_EQ(LayerRopeInvFreq(config, 0), RopeInvFreq(64, 10000.0, false, 1, 0, 0, 0));
  EXPECT_EQ(LayerRopeInvFreq(config, 1), RopeInvFreq(64, 160000.0, true, 16, 65536, 32, 1));
  EXPECT_EQ(LayerRopeInvFreq(config, 2), LayerRopeInvFreq(config, 1));
  EXPECT_EQ(LayerRopeInvFreq(config, 3), LayerRopeInvFreq(config, 0));  // MTP: ratio 0
}

TEST(V4RopeTest, RotatesInterleavedPairsOfTheLastDimsAndInverts) {
  const std::vector<float> inv_freq = {1.0f, 0.25f};  // rope dims 4 of a head of 6
  const RopeTable table(inv_freq, 8);
  std::vector<float> x = {1, 2, 3, 4, 5, 6, -1, -2, -3, -4, -5, -6};  // 2 heads of 6
  const std::vector<float> original = x;
  const int64_t position = 5;
  ApplyRope(table, &position, /*inverse=*/false, x.data(), 1, 2, 6);
  for (int h = 0; h < 2; ++h) {
    const float* in = original.data() + 6 * h;
    const float* out = x.data() + 6 * h;
    EXPECT_EQ(out[0], in[0]);  // nope dims untouched
    EXPECT_EQ(out[1], in[1]);
    for (int i = 0; i < 2; ++i) {
      const double angle = position * static_cast<double>(inv_freq[i]);
      const double a = in[2 + 2 * i], b = in[3 + 2 * i];
      EXPECT_NEAR(out[2 + 2 * i], a * std::cos(angle) - b * std::sin(angle), 1e-5);
      EXPECT_NEAR(out[3 + 2 * i], a * std::sin(angle) + b * std::cos(angle), 1e-5);
    }
  }
  ApplyRope(table, &position, /*inverse=*/true, x.data(), 1, 2, 6);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], original[i], 1e-5) << i;
}

// ---- Compressor pooling -----------------------------------------------------------------------

std::vector<float> RandomVector(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// The official Compressor at start_pos 0 in double: windows of `ratio` tokens, `score + ape`,
// and (ratio 4) overlap_transform: slots [0, ratio) = previous window's first-half channels
// (-inf gate for window 0), slots [ratio, 2 ratio) = this window's second-half channels.
std::vector<double> ReferencePool(const std::vector<float>& kv, const std::vector<float>& score,
                                  const std::vector<float>& ape, int64_t seq_len, int64_t ratio,
                                  int64_t width) {
  const bool overlap = ratio == 4;
  const int64_t stride = overlap ? 2 * width : width;
  const int64_t windows = seq_len / ratio;
  const int64_t slots = overlap ? 2 * ratio : ratio;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::vector<double> out(static_cast<size_t>(windows * width));
  for (int64_t w = 0; w < windows; ++w) {
    for (int64_t c = 0; c < width; ++c) {
      std::vector<double> k(slots, 0.0), s(slots, neg_inf);
      for (int64_t j = 0; j < ratio; ++j) {
        const int64_t cur = overlap ? width + c : c;
        const int64_t slot = overlap ? ratio + j : j;
        k[slot] = kv[(w * ratio + j) * stride + cur];
        s[slot] =
            static_cast<double>(score[(w * ratio + j) * stride + cur]) + ape[j * stride + cur];
        if (overlap && w > 0) {
          k[j] = kv[((w - 1) * ratio + j) * stride + c];
          s[j] =
              static_cast<double>(score[((w - 1) * ratio + j) * stride + c]) + ape[j * stride + c];
        }
      }
      const double m = *std::max_element(s.begin(), s.end());
      double sum = 0.0, acc = 0.0;
      for (int64_t i = 0; i < slots; ++i) sum += std::exp(s[i] - m);
      for (int64_t i = 0; i < slots; ++i) acc += k[i] * std::exp(s[i] - m) / sum;
      out[w * width + c] = acc;
    }
  }
  return out;
}

TEST(V4CompressorTest, PoolingMatchesTheOfficialWindowsWithAndWithoutOverlap) {
  std::mt19937 rng(7);
  for (const int64_t ratio : {4, 128}) {
    const int64_t width = 8, seq_len = ratio == 4 ? 23 : 300;  // remainders 3 and 44 emit nothing
    const int64_t stride = ratio == 4 ? 2 * width : width;
    const std::vector<float> kv = RandomVector(rng, seq_len * stride, 1.0f);
    const std::vector<float> score = RandomVector(rng, seq_len * stride, 2.0f);
    const std::vector<float> ape = RandomVector(rng, ratio * stride, 1.0f);
    const int64_t windows = seq_len / ratio;
    std::vector<float> out(windows * width);
    PoolCompressorWindows(kv.data(), score.data(), ape.data(), seq_len, ratio, width, out.data());
    const std::vector<double> ref = ReferencePool(kv, score, ape, seq_len, ratio, width);
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 2e-6) << ratio << " " << i;
  }
}

TEST(V4CompressorTest, EqualGatesAverageAndTheFirstCsaWindowHasNoOverlap) {
  // Ratio 4, width 1: kv = token index in the current half, 100 + index in the overlap half;
  // all gates 0 -> each entry averages its slots. Window 0: mean(0..3) = 1.5 (overlap slots at
  // -inf); window 1: mean(100..103, 4..7) = 53.5.
  const int64_t width = 1, ratio = 4, seq_len = 8;
  std::vector<float> kv(seq_len * 2), score(seq_len * 2, 0.0f), ape(ratio * 2, 0.0f);
  for (int t = 0; t < seq_len; ++t) {
    kv[2 * t] = 100.0f + t;
    kv[2 * t + 1] = static_cast<float>(t);
  }
  std::vector<float> out(2);
  PoolCompressorWindows(kv.data(), score.data(), ape.data(), seq_len, ratio, width, out.data());
  EXPECT_FLOAT_EQ(out[0], 1.5f);
  EXPECT_FLOAT_EQ(out[1], 53.5f);
  // A dominant position bias on slot 2 of the current half picks token 4w+2 alone.
  ape[2 * 2 + 1] = 200.0f;
  PoolCompressorWindows(kv.data(), score.data(), ape.data(), seq_len, ratio, width, out.data());
  EXPECT_EQ(out[0], 2.0f);
  EXPECT_EQ(out[1], 6.0f);
}

// ---- Indexer ----------------------------------------------------------------------------------

TEST(V4IndexerTest, HadamardIsTheScaledSylvesterMatrix) {
  std::mt19937 rng(3);
  const int64_t n = 128;
  std::vector<float> x = RandomVector(rng, 2 * n, 1.0f);
  const std::vector<float> original = x;
  HadamardRows(x.data(), 2, n);
  for (int64_t r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      double expected = 0.0;
      for (int64_t j = 0; j < n; ++j) {
        const double sign = (__builtin_popcountll(i & j) % 2) ? -1.0 : 1.0;
        expected += sign * original[r * n + j];
      }
      EXPECT_NEAR(x[r * n + i], expected / std::sqrt(128.0), 1e-5) << r << " " << i;
    }
  }
  HadamardRows(x.data(), 2, n);  // orthonormal and symmetric: its own inverse
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], original[i], 1e-5) << i;
}

TEST(V4IndexerTest, TopEntriesAreTheBestVisibleOnesBestFirst) {
  // 12 queries, ratio 4 -> 3 entries; query t sees entries s < (t + 1) / 4.
  const int64_t seq_len = 12, entries = 3, ratio = 4, k = 2;
  std::vector<float> scores(seq_len * entries);
  for (int64_t t = 0; t < seq_len; ++t) {
    scores[t * entries + 0] = 1.0f;
    scores[t * entries + 1] = 3.0f;
    scores[t * entries + 2] = 1000.0f;  // in the future for every query but t = 11
  }
  scores[7 * entries + 1] = 1.0f;  // tie with entry 0 at t = 7
  std::vector<int32_t> picks(seq_len * k);
  SelectTopEntries(scores.data(), 0, seq_len, entries, ratio, k, picks.data());
  auto at = [&](int64_t t) {
    return std::vector<int32_t>(picks.begin() + t * k, picks.begin() + (t + 1) * k);
  };
  EXPECT_EQ(at(0), (std::vector<int32_t>{-1, -1}));  // nothing visible yet
  EXPECT_EQ(at(2), (std::vector<int32_t>{-1, -1}));
  EXPECT_EQ(at(3), (std::vector<int32_t>{0, -1}));  // entry 0 complete at t = 3
  EXPECT_EQ(at(6), (std::vector<int32_t>{0, -1}));
  EXPECT_EQ(at(7), (std::vector<int32_t>{0, 1}));  // tie at 1.0
  EXPECT_EQ(at(8), (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(at(10), (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(at(11), (std::vector<int32_t>{2, 1}));
  // A chunk of queries starting later picks what the whole sequence picks for those rows.
  std::vector<int32_t> chunk(4 * k);
  SelectTopEntries(scores.data() + 8 * entries, 8, 4, entries, ratio, k, chunk.data());
  EXPECT_TRUE(std::equal(chunk.begin(), chunk.end(), picks.begin() + 8 * k));
}

TEST(V4IndexerTest, EqualScoresResolveAsTorchTopkOnTheCpu) {
  // Exact zeros (every head's relu is 0) tie often; transformers keeps whichever torch.topk
  // returns. Expected picks printed by torch 2.15 on the CPU: topk([0,3,0,0,2,0], 4) -> [1,4,0,5]
  // (nth_element path, k * 64 > n) and topk of 200 zeros with a 1 at 5, k = 3 -> [5,1,0]
  // (partial_sort path). One query that sees every entry (ratio 1, last position).
  const auto last_row_picks = [](const std::vector<float>& row, int64_t k) {
    const int64_t n = static_cast<int64_t>(row.size());
    std::vector<float> scores(n * n, 0.0f);
    std::copy(row.begin(), row.end(), scores.begin() + (n - 1) * n);
    std::vector<int32_t> picks(n * k);
    SelectTopEntries(scores.data(), 0, n, n, /*ratio=*/1, k, picks.data());
    return std::vector<int32_t>(picks.end() - k, picks.end());
  };
  EXPECT_EQ(last_row_picks({0, 3, 0, 0, 2, 0}, 4), (std::vector<int32_t>{1, 4, 0, 5}));
  std::vector<float> zeros(200, 0.0f);
  zeros[5] = 1.0f;
  EXPECT_EQ(last_row_picks(zeros, 3), (std::vector<int32_t>{5, 1, 0}));
}

// ---- Sparse attention -------------------------------------------------------------------------

// The attention of one (query, head) in double from the formula: the window keys, then the
// visible entries (HCA) or the picks (CSA), softmax with the sink in the denominator.
std::vector<double> ReferenceAttention(const kernels::SparseAttentionArgs& in, int64_t t, int64_t h) {
  const int64_t d = in.head_dim;
  const float* q = in.q + (t * in.heads + h) * d;
  std::vector<const float*> keys;
  for (int64_t k = std::max<int64_t>(0, t - in.window + 1); k <= t; ++k)
    keys.push_back(in.kv + k * d);
  if (in.ratio > 0 && in.picks == nullptr) {
    for (int64_t e = 0; e < std::min(in.entries, (t + 1) / in.ratio); ++e) {
      keys.push_back(in.compressed + e * d);
    }
  } else if (in.picks != nullptr) {
    for (int64_t i = 0; i < in.picks_per_query; ++i) {
      const int32_t e = in.picks[t * in.picks_per_query + i];
      if (e >= 0) keys.push_back(in.compressed + e * d);
    }
  }
  std::vector<double> s;
  for (const float* k : keys) {
    double dot = 0.0;
    for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(q[i]) * k[i];
    s.push_back(dot / std::sqrt(static_cast<double>(d)));
  }
  double m = in.sink[h];
  for (double v : s) m = std::max(m, v);
  double sum = std::exp(in.sink[h] - m);
  for (double v : s) sum += std::exp(v - m);
  std::vector<double> o(d, 0.0);
  for (size_t j = 0; j < keys.size(); ++j) {
    for (int64_t i = 0; i < d; ++i) o[i] += std::exp(s[j] - m) / sum * keys[j][i];
  }
  return o;
}

struct SparseCase {
  std::vector<float> q, kv, compressed, sink;
  std::vector<int32_t> picks;
  kernels::SparseAttentionArgs in;
};

SparseCase MakeSparseCase(std::mt19937& rng, int64_t seq_len, int64_t ratio, int64_t topk) {
  SparseCase c;
  const int64_t heads = 3, dim = 16;
  c.q = RandomVector(rng, seq_len * heads * dim, 1.0f);
  c.kv = RandomVector(rng, seq_len * dim, 1.0f);
  c.sink = RandomVector(rng, heads, 1.0f);
  const int64_t entries = ratio ? seq_len / ratio : 0;
  c.compressed = RandomVector(rng, std::max<int64_t>(entries, 1) * dim, 1.0f);
  c.in.q = c.q.data();
  c.in.kv = c.kv.data();
  c.in.compressed = entries ? c.compressed.data() : nullptr;
  c.in.entries = entries;
  c.in.sink = c.sink.data();
  c.in.seq_len = seq_len;
  c.in.heads = heads;
  c.in.head_dim = dim;
  c.in.window = 8;
  c.in.ratio = ratio;
  if (topk > 0) {  // picks: a shuffled subset of the visible entries, then -1
    const int64_t k = std::min(topk, entries);
    c.picks.assign(seq_len * k, -1);
    for (int64_t t = 0; t < seq_len; ++t) {
      std::vector<int32_t> visible(std::min(entries, (t + 1) / ratio));
      for (size_t i = 0; i < visible.size(); ++i) visible[i] = static_cast<int32_t>(i);
      std::shuffle(visible.begin(), visible.end(), rng);
      for (int64_t i = 0; i < std::min<int64_t>(k, visible.size()); ++i)
        c.picks[t * k + i] = visible[i];
    }
    c.in.picks = c.picks.data();
    c.in.picks_per_query = k;
  }
  return c;
}

class V4SparseAttentionTest : public ::testing::Test {
 protected:
  std::unique_ptr<kernels::Gemm> gemm_ = kernels::MakeOpenBlasGemm(1);
  ForwardContext Context(Numerics numerics) {
    ForwardContext ctx;
    ctx.gemm = gemm_.get();
    ctx.numerics = numerics;
    return ctx;
  }
};

TEST_F(V4SparseAttentionTest, MatchesTheFormulaForWindowHcaAndCsaKeys) {
  std::mt19937 rng(11);
  struct Variant {
    int64_t ratio, topk;
  };
  for (const Variant v : {Variant{0, 0}, Variant{4, 0}, Variant{4, 3}, Variant{128, 0}}) {
    const int64_t seq_len = v.ratio == 128 ? 300 : 37;
    SparseCase c = MakeSparseCase(rng, seq_len, v.ratio, v.topk);
    for (const Numerics numerics : {Numerics::kMath, Numerics::kOfficial}) {
      std::vector<float> o(seq_len * c.in.heads * c.in.head_dim);
      ASSERT_TRUE(SparseAttention(Context(numerics), c.in, o.data()).ok());
      // |v| <= 5 here (unit normals); math: float32 sums of <= 160 terms; official: BF16 P and
      // output, 2^-8 * max|v|.
      const double tol = numerics == Numerics::kMath ? 2e-5 : 5.0 / 256 + 2e-5;
      for (int64_t t = 0; t < seq_len; ++t) {
        for (int64_t h = 0; h < c.in.heads; ++h) {
          const std::vector<double> ref = ReferenceAttention(c.in, t, h);
          for (int64_t i = 0; i < c.in.head_dim; ++i) {
            ASSERT_NEAR(o[(t * c.in.heads + h) * c.in.head_dim + i], ref[i], tol)
                << "ratio " << v.ratio << " topk " << v.topk << " " << NumericsName(numerics)
                << " t " << t << " h " << h << " i " << i;
          }
        }
      }
    }
  }
}

TEST_F(V4SparseAttentionTest, KeysOutsideTheWindowDoNotMatter) {
  std::mt19937 rng(5);
  SparseCase c = MakeSparseCase(rng, 20, 0, 0);  // window 8
  std::vector<float> before(20 * 3 * 16), after(before.size());
  ASSERT_TRUE(SparseAttention(Context(Numerics::kMath), c.in, before.data()).ok());
  for (int i = 0; i < 16; ++i) c.kv[4 * 16 + i] += 50.0f;  // key 4: inside the window of t <= 11
  ASSERT_TRUE(SparseAttention(Context(Numerics::kMath), c.in, after.data()).ok());
  for (int64_t t = 0; t < 20; ++t) {
    const bool sees = t >= 4 && t <= 11;
    const float* b = before.data() + t * 48;
    const float* a = after.data() + t * 48;
    EXPECT_EQ(std::equal(b, b + 48, a), !sees) << t;
  }
}

TEST_F(V4SparseAttentionTest, SinkOnlyEntersTheDenominator) {
  // One key per query (window 1): o = v * e^s / (e^s + e^sink) = v * sigmoid(s - sink).
  std::mt19937 rng(9);
  SparseCase c = MakeSparseCase(rng, 4, 0, 0);
  c.in.window = 1;
  for (const float sink : {-1e30f, 0.5f, 60.0f}) {
    std::fill(c.sink.begin(), c.sink.end(), sink);
    for (const Numerics numerics : {Numerics::kMath, Numerics::kOfficial}) {
      std::vector<float> o(4 * 48);
      ASSERT_TRUE(SparseAttention(Context(numerics), c.in, o.data()).ok());
      for (int64_t t = 0; t < 4; ++t) {
        for (int64_t h = 0; h < 3; ++h) {
          double s = 0.0;
          for (int i = 0; i < 16; ++i) s += double{c.q[(t * 3 + h) * 16 + i]} * c.kv[t * 16 + i];
          const double p = 1.0 / (1.0 + std::exp(double{sink} - s / 4.0));
          for (int i = 0; i < 16; ++i) {
            const double expected = p * c.kv[t * 16 + i];
            const double tol = numerics == Numerics::kMath ? 1e-6 + 1e-5 * std::abs(expected)
                                                           : 1e-30 + std::abs(expected) / 128;
            ASSERT_NEAR(o[(t * 3 + h) * 16 + i], expected, tol) << sink << " t " << t;
          }
        }
      }
    }
  }
}

// ---- The whole sub-block ----------------------------------------------------------------------

// Random BF16 weights of a small V4 attention, owned here.
class AttentionFixture {
 public:
  AttentionFixture(int64_t ratio, uint32_t seed) : rng_(seed) {
    config_.hidden_size = 128;
    config_.num_hidden_layers = 1;
    config_.num_attention_heads = 4;
    config_.head_dim = 128;
    config_.qk_rope_head_dim = 64;
    config_.q_lora_rank = 128;
    config_.o_groups = 2;
    config_.o_lora_rank = 128;
    config_.sliding_window = 16;
    config_.index_n_heads = 2;
    config_.index_head_dim = 64;
    config_.index_topk = 3;
    config_.compress_ratios = {ratio, 0};
    config_.rope_theta = 10000.0;
    config_.compress_rope_theta = 160000.0;
    config_.rope_factor = 16.0;
    config_.original_max_position_embeddings = 65536;
    config_.beta_fast = 32;
    config_.beta_slow = 1;
    config_.rms_norm_eps = 1e-6f;
    const int64_t d = 128, hd = 4 * 128;
    w_.wq_a = Linear("wq_a", 128, d, true);
    w_.q_norm = Norm(128);
    w_.wq_b = Linear("wq_b", hd, 128, true);
    w_.wkv = Linear("wkv", 128, d, true);
    w_.kv_norm = Norm(128);
    w_.wo_a = Linear("wo_a", 2 * 128, hd / 2, true);
    w_.wo_b = Linear("wo_b", d, 2 * 128, true);
    w_.attn_sink = RandomVector(rng_, 4, 1.0f);
    if (ratio != 0) w_.compressor = Compressor("compressor.", ratio, 128);
    if (ratio == 4) {
      V4IndexerWeights idx;
      idx.wq_b = Linear("indexer.wq_b", 2 * 64, 128, true);
      idx.weights_proj = Linear("indexer.weights_proj", 2, d, false);
      idx.compressor = Compressor("indexer.compressor.", ratio, 64);
      w_.indexer = std::move(idx);
    }
  }

  V4Config& config() { return config_; }
  V4AttentionWeights& weights() { return w_; }
  std::mt19937& rng() { return rng_; }

 private:
  LinearWeight Linear(const std::string& name, int64_t out, int64_t in, bool quantized) {
    std::vector<uint16_t>& store = storage_.emplace_back(out * in);
    std::normal_distribution<float> dist(0.0f, 1.0f / std::sqrt(static_cast<float>(in)));
    for (uint16_t& v : store) v = formats::FloatToBf16(dist(rng_));
    LinearWeight w;
    w.module = "layers.0.attn." + name;
    w.quantized_source = quantized;
    w.view = kernels::DenseTensor{store.data(), kernels::FloatType::kBF16, out, in};
    return w;
  }
  std::vector<float> Norm(int64_t n) {
    std::uniform_real_distribution<float> dist(0.5f, 1.5f);
    std::vector<float> v(n);
    for (float& x : v) x = formats::Bf16ToFloat(formats::FloatToBf16(dist(rng_)));
    return v;
  }
  V4CompressorWeights Compressor(const std::string& prefix, int64_t ratio, int64_t width) {
    const int64_t coff = ratio == 4 ? 2 : 1;
    V4CompressorWeights c;
    c.wkv = Linear(prefix + "wkv", coff * width, 128, false);
    c.wgate = Linear(prefix + "wgate", coff * width, 128, false);
    c.ape = RandomVector(rng_, ratio * coff * width, 0.5f);
    c.norm = Norm(width);
    return c;
  }

  std::mt19937 rng_;
  V4Config config_;
  V4AttentionWeights w_;
  std::deque<std::vector<uint16_t>> storage_;
};

// Records what the observer is shown: module -> [rows, cols].
class RecordingObserver : public Observer {
 public:
  void OnLinearInput(const LinearInput& input) override {
    shapes[*input.module] = {input.rows, input.cols};
  }
  void OnKvCache(const KvCacheInput& input) override {
    shapes[*input.module] = {input.rows, input.cols};
  }
  std::map<std::string, std::pair<int64_t, int64_t>> shapes;
};

class V4AttentionForwardTest : public ::testing::TestWithParam<int64_t> {
 protected:
  std::unique_ptr<kernels::Gemm> gemm_ = kernels::MakeOpenBlasGemm(1);

  std::vector<float> Run(AttentionFixture& f, Numerics numerics, const std::vector<float>& x,
                         int64_t sequences, int64_t seq_len, Observer* observer = nullptr) {
    ForwardContext ctx;
    ctx.gemm = gemm_.get();
    ctx.numerics = numerics;
    ctx.observer = observer;
    AttentionBatch batch{x.data(), sequences, seq_len};
    absl::StatusOr<std::vector<float>> out =
        AttentionForward(ctx, f.config(), 0, f.weights(), batch);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : std::vector<float>();
  }
};

std::vector<float> Bf16Inputs(std::mt19937& rng, size_t n) {
  std::vector<float> x = RandomVector(rng, n, 1.0f);
  for (float& v : x) v = formats::Bf16ToFloat(formats::FloatToBf16(v));
  return x;
}

TEST_P(V4AttentionForwardTest, IsCausalAndSequencesAreIndependent) {
  AttentionFixture f(GetParam(), 21);
  const int64_t seq_len = GetParam() == 128 ? 300 : 45, d = 128;
  for (const Numerics numerics : {Numerics::kMath, Numerics::kOfficial}) {
    std::vector<float> x = Bf16Inputs(f.rng(), 2 * seq_len * d);
    const std::vector<float> before = Run(f, numerics, x, 2, seq_len);
    // Change token t of sequence 1: sequence 0 and the earlier tokens of sequence 1 keep their
    // outputs bit for bit; token t's output changes.
    const int64_t t = seq_len - 20;
    for (int64_t c = 0; c < d; ++c) x[(seq_len + t) * d + c] += 1.0f;
    const std::vector<float> after = Run(f, numerics, x, 2, seq_len);
    ASSERT_EQ(before.size(), after.size());
    const auto row_equal = [&](int64_t row) {
      return std::equal(before.begin() + row * d, before.begin() + (row + 1) * d,
                        after.begin() + row * d);
    };
    for (int64_t r = 0; r < seq_len + t; ++r)
      ASSERT_TRUE(row_equal(r)) << NumericsName(numerics) << " row " << r;
    EXPECT_FALSE(row_equal(seq_len + t));
  }
}

TEST_P(V4AttentionForwardTest, ObserverSeesEveryLinearInputAndTheKvCache) {
  AttentionFixture f(GetParam(), 22);
  const int64_t seq_len = GetParam() == 128 ? 260 : 30, tokens = 2 * seq_len;
  const std::vector<float> x = Bf16Inputs(f.rng(), tokens * 128);
  RecordingObserver observer;
  Run(f, Numerics::kOfficial, x, 2, seq_len, &observer);
  std::map<std::string, std::pair<int64_t, int64_t>> expected = {
      {"layers.0.attn.wq_a", {tokens, 128}}, {"layers.0.attn.wkv", {tokens, 128}},
      {"layers.0.attn.wq_b", {tokens, 128}}, {"layers.0.attn.wo_a", {tokens, 512}},
      {"layers.0.attn.wo_b", {tokens, 256}}, {"layers.0.attn.kv", {tokens, 128}}};
  if (GetParam() != 0) {
    const int64_t entries = 2 * (seq_len / GetParam());
    expected["layers.0.attn.compressor.wkv"] = {tokens, 128};
    expected["layers.0.attn.compressor.wgate"] = {tokens, 128};
    expected["layers.0.attn.compressor"] = {entries, 128};
  }
  if (GetParam() == 4) {
    expected["layers.0.attn.indexer.wq_b"] = {tokens, 128};
    expected["layers.0.attn.indexer.weights_proj"] = {tokens, 128};
    expected["layers.0.attn.indexer.compressor.wkv"] = {tokens, 128};
    expected["layers.0.attn.indexer.compressor.wgate"] = {tokens, 128};
  }
  EXPECT_EQ(observer.shapes, expected);
}

TEST_P(V4AttentionForwardTest, OfficialIsBf16AndCloseToMath) {
  AttentionFixture f(GetParam(), 23);
  const int64_t seq_len = GetParam() == 128 ? 260 : 60;
  const std::vector<float> x = Bf16Inputs(f.rng(), seq_len * 128);
  const std::vector<float> math = Run(f, Numerics::kMath, x, 1, seq_len);
  const std::vector<float> official = Run(f, Numerics::kOfficial, x, 1, seq_len);
  ASSERT_EQ(math.size(), official.size());
  double signal = 0.0, noise = 0.0;
  for (size_t i = 0; i < math.size(); ++i) {
    ASSERT_EQ(official[i], formats::Bf16ToFloat(formats::FloatToBf16(official[i]))) << i;
    signal += double{math[i]} * math[i];
    noise += (double{official[i]} - math[i]) * (double{official[i]} - math[i]);
  }
  // E4M3 rounding with a power-of-two block scale is ~2^-4 relative RMS (~24 dB) per simulated
  // operand; four chained simulated products with BF16 steps lose a few dB more, and in CSA
  // layers the FP4-simulated indexer picks some other entries than the exact one: > 15 dB.
  const double sqnr_db = 10.0 * std::log10(signal / noise);
  EXPECT_GT(sqnr_db, 15.0);
  RecordProperty("sqnr_db", std::to_string(sqnr_db));
}

TEST_P(V4AttentionForwardTest, RejectsWeightsOfTheWrongShapeNamingThem) {
  AttentionFixture f(GetParam(), 24);
  f.weights().wq_b.view.rows -= 1;
  absl::Status s = ValidateAttentionWeights(f.config(), 0, f.weights());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layers.0.attn.wq_b"), std::string::npos) << s;
  f.weights().wq_b.view.rows += 1;
  f.weights().attn_sink.pop_back();
  s = ValidateAttentionWeights(f.config(), 0, f.weights());
  EXPECT_NE(s.message().find("layers.0.attn.attn_sink"), std::string::npos) << s;
  f.weights().attn_sink.push_back(0.0f);
  EXPECT_TRUE(ValidateAttentionWeights(f.config(), 0, f.weights()).ok());
  f.config().compress_ratios[0] = GetParam() == 0 ? 4 : 0;  // compressor presence mismatches
  s = ValidateAttentionWeights(f.config(), 0, f.weights());
  EXPECT_NE(s.message().find("compressor"), std::string::npos) << s;
}

// ---- A reference case from another implementation --------------------------------------------

// The attention of every layer of a case file written by tests/interop/test_v4_attention.py
// (transformers for `math`, DeepSeek's official model.py for `official`): safetensors with F32
// "x" [B, S, d], the BF16-exact weights under their official names and the reference output
// "layers.N.attn.out"; __metadata__ "config" (config.json) and "numerics".
class ReferenceCase {
 public:
  explicit ReferenceCase(const checkpoint::SafetensorsFile& file) : file_(file) {}

  std::vector<float> Floats(const std::string& name) {
    const checkpoint::TensorView* t = file_.Find(name);
    EXPECT_NE(t, nullptr) << name;
    if (t == nullptr || t->dtype != checkpoint::Dtype::kF32) return {};
    std::vector<float> v(static_cast<size_t>(t->numel()));
    std::memcpy(v.data(), t->data, v.size() * sizeof(float));
    return v;
  }
  LinearWeight Linear(const std::string& name, bool quantized) {
    const std::vector<float> f = Floats(name + ".weight");
    std::vector<uint16_t>& store = storage_.emplace_back(f.size());
    for (size_t i = 0; i < f.size(); ++i) store[i] = formats::FloatToBf16(f[i]);
    const checkpoint::TensorView* t = file_.Find(name + ".weight");
    LinearWeight w;
    w.module = name;
    w.quantized_source = quantized;
    w.view = kernels::DenseTensor{store.data(), kernels::FloatType::kBF16, t ? t->shape[0] : 0,
                                  t ? t->shape[1] : 0};
    return w;
  }
  V4CompressorWeights Compressor(const std::string& prefix) {
    V4CompressorWeights c;
    c.wkv = Linear(prefix + "wkv", false);
    c.wgate = Linear(prefix + "wgate", false);
    c.ape = Floats(prefix + "ape");
    c.norm = Floats(prefix + "norm.weight");
    return c;
  }
  V4AttentionWeights Attention(const V4Config& config, int64_t layer) {
    const std::string p = "layers." + std::to_string(layer) + ".attn.";
    V4AttentionWeights w;
    w.wq_a = Linear(p + "wq_a", true);
    w.q_norm = Floats(p + "q_norm.weight");
    w.wq_b = Linear(p + "wq_b", true);
    w.wkv = Linear(p + "wkv", true);
    w.kv_norm = Floats(p + "kv_norm.weight");
    w.wo_a = Linear(p + "wo_a", true);
    w.wo_b = Linear(p + "wo_b", true);
    w.attn_sink = Floats(p + "attn_sink");
    if (config.CompressRatio(layer) != 0) w.compressor = Compressor(p + "compressor.");
    if (config.CompressRatio(layer) == 4) {
      V4IndexerWeights idx;
      idx.wq_b = Linear(p + "indexer.wq_b", true);
      idx.weights_proj = Linear(p + "indexer.weights_proj", false);
      idx.compressor = Compressor(p + "indexer.compressor.");
      w.indexer = std::move(idx);
    }
    return w;
  }

 private:
  const checkpoint::SafetensorsFile& file_;
  std::deque<std::vector<uint16_t>> storage_;
};

// How closely `out` follows `ref`.
struct Agreement {
  double max_ref = 0.0;         // max |ref|
  double max_err = 0.0;         // max |out - ref|
  double sqnr_db = 0.0;         // 10 log10(sum ref^2 / sum (out - ref)^2)
  double equal_fraction = 0.0;  // values bitwise equal
};

Agreement Compare(const std::vector<float>& out, const std::vector<float>& ref) {
  Agreement a;
  double signal = 0.0, noise = 0.0;
  int64_t equal = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = double{out[i]} - ref[i];
    a.max_ref = std::max(a.max_ref, std::abs(double{ref[i]}));
    a.max_err = std::max(a.max_err, std::abs(e));
    signal += double{ref[i]} * ref[i];
    noise += e * e;
    equal += out[i] == ref[i];
  }
  a.sqnr_db = noise == 0.0 ? 999.0 : 10.0 * std::log10(signal / noise);
  a.equal_fraction = static_cast<double>(equal) / static_cast<double>(ref.size());
  return a;
}

TEST(V4AttentionCaseTest, MatchesTheReferenceImplementation) {
  const char* path = getenv("QUANTD_V4_ATTENTION_CASE");
  if (path == nullptr) {
    GTEST_SKIP() << "no QUANTD_V4_ATTENTION_CASE (tests/interop/test_v4_attention.py sets it)";
  }
  absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsFile>> file =
      checkpoint::SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const auto& meta = (*file)->metadata();
  ASSERT_TRUE(meta.count("config") && meta.count("numerics"));
  absl::StatusOr<V4Config> config =
      ParseV4Config(nlohmann::json::parse(meta.at("config")), "case config");
  ASSERT_TRUE(config.ok()) << config.status();
  const Numerics numerics =
      meta.at("numerics") == "official" ? Numerics::kOfficial : Numerics::kMath;
  ReferenceCase reference(**file);
  const checkpoint::TensorView* x_view = (*file)->Find("x");
  ASSERT_NE(x_view, nullptr);
  ASSERT_EQ(x_view->shape.size(), 3u);
  const std::vector<float> x = reference.Floats("x");
  std::unique_ptr<kernels::Gemm> gemm = kernels::MakeOpenBlasGemm(0);
  ForwardContext ctx;
  ctx.gemm = gemm.get();
  ctx.numerics = numerics;
  for (int64_t layer = 0; layer < config->num_hidden_layers; ++layer) {
    const V4AttentionWeights w = reference.Attention(*config, layer);
    absl::StatusOr<std::vector<float>> out = AttentionForward(
        ctx, *config, layer, w, AttentionBatch{x.data(), x_view->shape[0], x_view->shape[1]});
    ASSERT_TRUE(out.ok()) << out.status();
    const std::vector<float> ref =
        reference.Floats("layers." + std::to_string(layer) + ".attn.out");
    ASSERT_EQ(out->size(), ref.size());
    const Agreement a = Compare(*out, ref);
    std::printf(
        "layer %lld (ratio %lld, %s): max err %.3g of max|ref| %.4g, SQNR %.1f dB, "
        "%.2f%% bitwise equal\n",
        static_cast<long long>(layer), static_cast<long long>(config->CompressRatio(layer)),
        NumericsName(numerics), a.max_err, a.max_ref, a.sqnr_db, 100.0 * a.equal_fraction);
    if (numerics == Numerics::kOfficial) {  // what official numerics change against math
      ForwardContext math_ctx = ctx;
      math_ctx.numerics = Numerics::kMath;
      absl::StatusOr<std::vector<float>> math =
          AttentionForward(math_ctx, *config, layer, w,
                           AttentionBatch{x.data(), x_view->shape[0], x_view->shape[1]});
      ASSERT_TRUE(math.ok()) << math.status();
      std::printf("layer %lld: math numerics against the official reference: SQNR %.1f dB\n",
                  static_cast<long long>(layer), Compare(*math, ref).sqnr_db);
    }
    if (numerics == Numerics::kMath) {
      // float32 in another accumulation order: about ten chained reductions of length <= 512,
      // each within 512 * 2^-24 relative: 3e-4 of max|ref|.
      EXPECT_LE(a.max_err, 3e-4 * a.max_ref) << "layer " << layer;
    } else {
      // Both sides round the same BF16 tensors; they differ where float32 accumulation order
      // moves a value across a BF16 (or FP8) rounding boundary, ~1 BF16 ulp in a few percent of
      // the values: > 50 dB. A missing or extra rounding step costs far more (math against
      // official is 19-25 dB).
      EXPECT_GE(a.sqnr_db, 50.0) << "layer " << layer;
      EXPECT_GE(a.equal_fraction, 0.9) << "layer " << layer;
    }
  }
}

TEST_P(V4AttentionForwardTest, SequencesShorterThanAWindowHaveNoCompressedEntries) {
  AttentionFixture f(GetParam(), 25);
  for (const int64_t seq_len : {1, 3, 4}) {
    for (const Numerics numerics : {Numerics::kMath, Numerics::kOfficial}) {
      const std::vector<float> x = Bf16Inputs(f.rng(), 2 * seq_len * 128);
      RecordingObserver observer;
      const std::vector<float> out = Run(f, numerics, x, 2, seq_len, &observer);
      ASSERT_EQ(out.size(), x.size());
      for (float v : out) ASSERT_TRUE(std::isfinite(v)) << seq_len;
      // The compressed KV reaches the observer only when a full window exists.
      EXPECT_EQ(observer.shapes.count("layers.0.attn.compressor"),
                GetParam() == 4 && seq_len == 4 ? 1u : 0u)
          << seq_len;
    }
  }
}

TEST_P(V4AttentionForwardTest, OfficialNumericsRejectShapesTheSimulationCannotBlock) {
  AttentionFixture f(GetParam(), 26);
  const std::vector<float> x = Bf16Inputs(f.rng(), 8 * 128);
  ForwardContext ctx;
  ctx.gemm = gemm_.get();
  ctx.numerics = Numerics::kOfficial;
  f.config().qk_rope_head_dim = 32;  // nope dims 96: not whole KV FP8 blocks of 64
  absl::StatusOr<std::vector<float>> out =
      AttentionForward(ctx, f.config(), 0, f.weights(), AttentionBatch{x.data(), 1, 8});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("KV FP8 block"), std::string::npos) << out.status();
  ctx.numerics = Numerics::kMath;  // math has no blocks
  EXPECT_TRUE(
      AttentionForward(ctx, f.config(), 0, f.weights(), AttentionBatch{x.data(), 1, 8}).ok());
}

INSTANTIATE_TEST_SUITE_P(Ratios, V4AttentionForwardTest, ::testing::Values(0, 4, 128),
                         [](const auto& info) {
                           return info.param == 0 ? std::string("Sliding")
                                                  : (info.param == 4 ? "Csa" : "Hca");
                         });

}  // namespace
}  // namespace quantd::model
