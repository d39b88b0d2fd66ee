#include "server/model/v4_indexer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "kernels/formats.h"
#include "server/base/status_macros.h"
#include "server/model/v4_act_quant.h"
#include "server/model/v4_compressor.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

// Queries per score GEMM: bounds the [queries * n_heads, entries] dot-product block.
constexpr int64_t kQueryChunk = 64;

}  // namespace

void HadamardRows(float* x, int64_t rows, int64_t n) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(n));
  for (int64_t r = 0; r < rows; ++r) {
    float* v = x + r * n;
    for (int64_t half = 1; half < n; half *= 2) {
      for (int64_t i = 0; i < n; i += 2 * half) {
        for (int64_t j = i; j < i + half; ++j) {
          const float a = v[j];
          const float b = v[j + half];
          v[j] = a + b;
          v[j + half] = a - b;
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) v[i] *= scale;
  }
}

absl::Status SimulateIndexerFp4(float* x, int64_t rows, int64_t n, const HostThreads& threads) {
  ParallelRows(threads, rows, 8 * n, [&](int, int64_t begin, int64_t end) {
    HadamardRows(x + begin * n, end - begin, n);
    RoundToBf16(x + begin * n, (end - begin) * n);  // fast_hadamard_transform returns BF16
  });
  return SimulateFp4Act(x, rows, n, n, threads);
}

void IndexerScores(Numerics numerics, const float* dots, const float* weights, int64_t queries,
                   int64_t heads, int64_t dim, int64_t entries, int64_t first_position,
                   int64_t ratio, float* scores) {
  const bool official = numerics == Numerics::kOfficial;
  const float dot_scale = 1.0f / std::sqrt(static_cast<float>(dim));
  for (int64_t i = 0; i < queries; ++i) {
    const float* w_t = weights + i * heads;
    float* out = scores + i * entries;
    const int64_t visible = std::min(entries, (first_position + i + 1) / ratio);
    for (int64_t s = 0; s < visible; ++s) {
      float sum = 0.0f;
      for (int64_t h = 0; h < heads; ++h) {
        const float dot = dots[(i * heads + h) * entries + s];
        sum += official ? formats::RoundToBf16(std::max(formats::RoundToBf16(dot), 0.0f) * w_t[h])
                        : std::max(dot, 0.0f) * dot_scale * w_t[h];
      }
      out[s] = official ? formats::RoundToBf16(sum) : sum;
    }
  }
}

void SelectTopEntries(const float* scores, int64_t first_position, int64_t queries, int64_t entries,
                      int64_t ratio, int64_t k, int32_t* picks) {
  using Candidate = std::pair<float, int32_t>;  // (score, entry), future entries at -inf
  const auto better = [](const Candidate& a, const Candidate& b) { return a.first > b.first; };
  std::vector<Candidate> queue(static_cast<size_t>(entries));
  for (int64_t i = 0; i < queries; ++i) {
    const float* row = scores + i * entries;
    const int64_t visible = std::min(entries, (first_position + i + 1) / ratio);
    for (int64_t s = 0; s < entries; ++s) {
      queue[s] = {s < visible ? row[s] : -std::numeric_limits<float>::infinity(),
                  static_cast<int32_t>(s)};
    }
    // torch.topk(largest, sorted) on the CPU (ATen TopKImpl.h), so that equal scores (exact
    // zeros, where every head's relu is 0) resolve as transformers resolves them.
    if (k * 64 <= entries) {
      std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), better);
    } else {
      std::nth_element(queue.begin(), queue.begin() + (k - 1), queue.end(), better);
      std::sort(queue.begin(), queue.begin() + (k - 1), better);
    }
    int32_t* out = picks + i * k;
    for (int64_t j = 0; j < k; ++j) out[j] = queue[j].second < visible ? queue[j].second : -1;
  }
}

kernels::SgemmArgs IndexerDotsProduct(const float* q, const float* keys, int64_t rows,
                                      int64_t entries, int64_t dim, float* dots) {
  kernels::SgemmArgs g;
  g.trans_b = true;
  g.m = rows;
  g.n = entries;
  g.k = dim;
  g.a = q;
  g.lda = dim;
  g.b = keys;
  g.ldb = dim;
  g.c = dots;
  g.ldc = entries;
  return g;
}

absl::StatusOr<IndexerPicks> RunIndexer(const ForwardContext& ctx, const V4Config& config,
                                        const V4IndexerWeights& w, int64_t ratio,
                                        const RopeTable& rope, const AttentionBatch& batch,
                                        const float* qr) {
  const bool official = ctx.numerics == Numerics::kOfficial;
  const int64_t seq_len = batch.seq_len;
  const int64_t tokens = batch.sequences * seq_len;
  const int64_t heads = config.index_n_heads;
  const int64_t dim = config.index_head_dim;

  std::vector<float> q(static_cast<size_t>(tokens * heads * dim));
  RETURN_IF_ERROR(ApplyLinear(ctx, w.wq_b, qr, tokens, q.data()));
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t r = 0; r < tokens; ++r) positions[r] = r % seq_len;
  ApplyRope(rope, positions.data(), /*inverse=*/false, q.data(), tokens, heads, dim, ctx.threads);
  ToModelDtype(ctx, q.data(), static_cast<int64_t>(q.size()));

  ASSIGN_OR_RETURN(std::vector<float> keys,
                   RunCompressor(ctx, w.compressor, ratio, dim, config.rms_norm_eps, rope, batch));
  const int64_t entries = seq_len / ratio;
  if (official) {
    RETURN_IF_ERROR(SimulateIndexerFp4(q.data(), tokens * heads, dim, ctx.threads));
    RETURN_IF_ERROR(SimulateIndexerFp4(keys.data(), batch.sequences * entries, dim, ctx.threads));
  }

  std::vector<float> weights(static_cast<size_t>(tokens * heads));
  RETURN_IF_ERROR(ApplyLinear(ctx, w.weights_proj, batch.x, tokens, weights.data()));
  const float head_scale = 1.0f / std::sqrt(static_cast<float>(heads));
  if (official) {
    const float scale = static_cast<float>(std::pow(static_cast<double>(dim), -0.5) *
                                           std::pow(static_cast<double>(heads), -0.5));
    for (float& v : weights) v = formats::RoundToBf16(v * scale);
  } else {
    for (float& v : weights) v *= head_scale;
  }

  IndexerPicks picks;
  picks.k = std::min(config.index_topk, entries);
  picks.entries.assign(static_cast<size_t>(tokens * picks.k), -1);
  if (picks.k == 0) return picks;

  std::vector<float> dots(static_cast<size_t>(kQueryChunk * heads * entries));
  std::vector<float> scores(static_cast<size_t>(kQueryChunk * entries));
  for (int64_t b = 0; b < batch.sequences; ++b) {
    const float* seq_keys = keys.data() + b * entries * dim;
    for (int64_t t0 = 0; t0 < seq_len; t0 += kQueryChunk) {
      const int64_t queries = std::min(kQueryChunk, seq_len - t0);
      const float* seq_q = q.data() + (b * seq_len + t0) * heads * dim;
      RETURN_IF_ERROR(ctx.gemm->Sgemm(
          IndexerDotsProduct(seq_q, seq_keys, queries * heads, entries, dim, dots.data())));
      // Queries are independent: each thread scores and selects its own.
      ParallelRows(ctx.threads, queries, 4 * heads * entries, [&](int, int64_t i0, int64_t i1) {
        IndexerScores(ctx.numerics, dots.data() + i0 * heads * entries,
                      weights.data() + (b * seq_len + t0 + i0) * heads, i1 - i0, heads, dim,
                      entries, t0 + i0, ratio, scores.data() + i0 * entries);
        SelectTopEntries(scores.data() + i0 * entries, t0 + i0, i1 - i0, entries, ratio, picks.k,
                         picks.entries.data() + (b * seq_len + t0 + i0) * picks.k);
      });
    }
  }
  return picks;
}

}  // namespace quantd::model
