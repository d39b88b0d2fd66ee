#include "server/model/v4_indexer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/formats.h"
#include "server/base/status_macros.h"
#include "server/model/v4_act_quant.h"
#include "server/model/v4_compressor.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {

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
  const ForwardOps& ops = OpsOf(ctx);
  const bool official = ctx.numerics == Numerics::kOfficial;
  const int64_t seq_len = batch.seq_len;
  const int64_t tokens = batch.sequences * seq_len;
  const int64_t heads = config.index_n_heads;
  const int64_t dim = config.index_head_dim;

  ASSIGN_OR_RETURN(OpArray<float> q,
                   AllocateArray<float>(ops, tokens * heads * dim, w.wq_b.module + " output"));
  RETURN_IF_ERROR(ops.Linear(ctx, w.wq_b, qr, tokens, q.data(), LinearOutput::kModelDtype, {}));
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t r = 0; r < tokens; ++r) positions[r] = r % seq_len;
  RETURN_IF_ERROR(ops.Rope(ctx, rope, positions, /*inverse=*/false, q.data(), tokens, heads, dim));
  RETURN_IF_ERROR(ops.ToModelDtype(ctx, q.data(), q.size()));

  ASSIGN_OR_RETURN(OpArray<float> keys,
                   RunCompressor(ctx, w.compressor, ratio, dim, config.rms_norm_eps, rope, batch));
  const int64_t entries = seq_len / ratio;
  if (official) {
    RETURN_IF_ERROR(
        ops.SimulateIndexerFp4(ctx, q.data(), tokens * heads, dim, w.wq_b.module + " output"));
    if (batch.sequences * entries > 0) {
      RETURN_IF_ERROR(ops.SimulateIndexerFp4(ctx, keys.data(), batch.sequences * entries, dim,
                                             w.compressor.wkv.module + " entries"));
    }
  }

  ASSIGN_OR_RETURN(OpArray<float> weights,
                   AllocateArray<float>(ops, tokens * heads, w.weights_proj.module + " output"));
  RETURN_IF_ERROR(ops.Linear(ctx, w.weights_proj, batch.x, tokens, weights.data(),
                             LinearOutput::kModelDtype, {}));
  IndexerPicks picks;
  picks.k = std::min(config.index_topk, entries);
  ASSIGN_OR_RETURN(picks.entries,
                   AllocateArray<int32_t>(ops, tokens * picks.k, w.wq_b.module + " picks"));
  RETURN_IF_ERROR(ops.IndexerTopK(ctx, config, q.data(), keys.data(), weights.data(),
                                  batch.sequences, seq_len, ratio, picks.k, w.wq_b.module,
                                  picks.entries.data()));
  return picks;
}

}  // namespace quantd::model
