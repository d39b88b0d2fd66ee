#include "server/model/v4_attention_sparse.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/formats.h"
#include "server/base/status_macros.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

// Query rows (tokens x heads) per chunk, and score elements per chunk (64 MiB of float32 for the
// window and compressed blocks together): long CSA sequences get chunks of fewer tokens.
constexpr int64_t kRowsPerChunk = 4096;
constexpr int64_t kScoresPerChunk = int64_t{1} << 24;
// List slots per online-softmax block of the official kernel (`block` in sparse_attn_kernel).
constexpr int64_t kSoftmaxBlock = 64;

// One key a query reads: its score and where its P·V weight goes.
struct Visit {
  int64_t slot;  // position in the official key list
  float score;
  float* weight;  // in the P row of the window or of the compressed entries
};

// Per-row scratch that survives across rows.
struct RowScratch {
  std::vector<Visit> visits;
  std::vector<float> block_max;
  std::vector<float> block_sum;
  std::vector<float> block_factor;  // product of the later blocks' rescales
};

// Turns the visits' scores into P·V weights; returns the divisor of the P·V row (1 in math).
float SoftmaxWeights(Numerics numerics, float sink, int64_t slots, RowScratch& s) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (numerics == Numerics::kMath) {
    float max = sink;
    for (const Visit& v : s.visits) max = std::max(max, v.score);
    float sum = 0.0f;
    for (Visit& v : s.visits) {
      v.score = std::exp(v.score - max);
      sum += v.score;
    }
    sum += std::exp(sink - max);
    for (const Visit& v : s.visits) *v.weight = v.score / sum;
    return 1.0f;
  }
  const int64_t blocks = (slots + kSoftmaxBlock - 1) / kSoftmaxBlock;
  s.block_max.assign(static_cast<size_t>(blocks), neg_inf);
  s.block_sum.assign(static_cast<size_t>(blocks), 0.0f);
  s.block_factor.assign(static_cast<size_t>(blocks), 1.0f);
  for (const Visit& v : s.visits) {
    float& m = s.block_max[v.slot / kSoftmaxBlock];
    m = std::max(m, v.score);
  }
  for (int64_t b = 1; b < blocks; ++b)
    s.block_max[b] = std::max(s.block_max[b], s.block_max[b - 1]);
  // acc_o of block b is rescaled by e^(m_b - m_{b+1}) at every later block.
  for (int64_t b = blocks - 2; b >= 0; --b) {
    s.block_factor[b] = s.block_factor[b + 1] * std::exp(s.block_max[b] - s.block_max[b + 1]);
  }
  for (const Visit& v : s.visits) {
    const int64_t b = v.slot / kSoftmaxBlock;
    const float e = std::exp(v.score - s.block_max[b]);
    s.block_sum[b] += e;
    *v.weight = formats::RoundToBf16(e) * s.block_factor[b];
  }
  float sum = 0.0f;
  float prev_max = neg_inf;
  for (int64_t b = 0; b < blocks; ++b) {
    const float rescale = std::exp(prev_max - s.block_max[b]);
    sum = sum * rescale + s.block_sum[b];
    prev_max = s.block_max[b];
  }
  return sum + std::exp(sink - prev_max);
}

}  // namespace

absl::Status SparseAttention(const ForwardContext& ctx, const kernels::SparseAttentionArgs& in,
                             float* o) {
  const int64_t heads = in.heads;
  const int64_t dim = in.head_dim;
  const int64_t window_slots = std::min(in.seq_len, in.window);
  const int64_t compressed_slots = in.ratio == 0 ? 0 : (in.picks ? in.picks_per_query : in.entries);
  const int64_t slots = window_slots + compressed_slots;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const int64_t keys_per_row = in.window + kRowsPerChunk / heads + in.entries;  // upper bound
  const int64_t chunk = std::max<int64_t>(
      1, std::min(kRowsPerChunk / heads, kScoresPerChunk / (heads * keys_per_row)));

  std::vector<float> p_window;
  std::vector<float> p_compressed;
  std::vector<float> divisor;
  std::vector<RowScratch> scratch;  // per worker
  for (int64_t t0 = 0; t0 < in.seq_len; t0 += chunk) {
    const int64_t t1 = std::min(in.seq_len, t0 + chunk);
    const int64_t rows = (t1 - t0) * heads;
    const int64_t k0 = std::max<int64_t>(0, t0 - in.window + 1);
    const int64_t n_window = t1 - k0;
    const int64_t n_compressed = in.ratio == 0 ? 0 : std::min(in.entries, t1 / in.ratio);
    const float* q = in.q + t0 * heads * dim;

    kernels::SgemmArgs g;
    g.trans_b = true;
    g.m = rows;
    g.k = dim;
    g.alpha = scale;
    g.a = q;
    g.lda = dim;
    g.ldb = dim;
    p_window.resize(static_cast<size_t>(rows * n_window));
    g.n = n_window;
    g.b = in.kv + k0 * dim;
    g.c = p_window.data();
    g.ldc = n_window;
    RETURN_IF_ERROR(ctx.gemm->Sgemm(g));
    p_compressed.resize(static_cast<size_t>(rows * n_compressed));
    if (n_compressed > 0) {
      g.n = n_compressed;
      g.b = in.compressed;
      g.c = p_compressed.data();
      g.ldc = n_compressed;
      RETURN_IF_ERROR(ctx.gemm->Sgemm(g));
    }

    // Scores -> weights, row by row: collect the row's visits, clear the row, write P.
    // Rows of different tokens and heads are independent: split over the threads by token.
    divisor.resize(static_cast<size_t>(rows));
    const int64_t work_per_token = heads * (n_window + n_compressed) * 8;
    scratch.resize(static_cast<size_t>(ParallelWorkers(ctx.threads, t1 - t0, work_per_token)));
    ParallelRows(ctx.threads, t1 - t0, work_per_token, [&](int worker, int64_t begin, int64_t end) {
      RowScratch& s = scratch[worker];
      for (int64_t t = t0 + begin; t < t0 + end; ++t) {
        const int64_t first = std::max<int64_t>(0, t - in.window + 1);
        const int64_t visible = in.ratio == 0 ? 0 : std::min(in.entries, (t + 1) / in.ratio);
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t row = (t - t0) * heads + h;
          float* pw = p_window.data() + row * n_window;
          float* pc = p_compressed.data() + row * n_compressed;
          s.visits.clear();
          for (int64_t key = first; key <= t; ++key) {
            s.visits.push_back({key - first, pw[key - k0], pw + (key - k0)});
          }
          if (in.picks != nullptr) {
            const int32_t* picks = in.picks + t * in.picks_per_query;
            for (int64_t i = 0; i < in.picks_per_query; ++i) {
              if (picks[i] < 0) continue;
              s.visits.push_back({window_slots + i, pc[picks[i]], pc + picks[i]});
            }
          } else {
            for (int64_t e = 0; e < visible; ++e) {
              s.visits.push_back({window_slots + e, pc[e], pc + e});
            }
          }
          std::fill(pw, pw + n_window, 0.0f);
          std::fill(pc, pc + n_compressed, 0.0f);
          divisor[row] = SoftmaxWeights(ctx.numerics, in.sink[h], slots, s);
        }
      }
    });

    // o = P_window · kv + P_compressed · compressed, then / divisor.
    float* out = o + t0 * heads * dim;
    kernels::SgemmArgs pv;
    pv.m = rows;
    pv.n = dim;
    pv.k = n_window;
    pv.a = p_window.data();
    pv.lda = n_window;
    pv.b = in.kv + k0 * dim;
    pv.ldb = dim;
    pv.c = out;
    pv.ldc = dim;
    RETURN_IF_ERROR(ctx.gemm->Sgemm(pv));
    if (n_compressed > 0) {
      pv.k = n_compressed;
      pv.a = p_compressed.data();
      pv.lda = n_compressed;
      pv.b = in.compressed;
      pv.beta = 1.0f;
      RETURN_IF_ERROR(ctx.gemm->Sgemm(pv));
    }
    if (ctx.numerics == Numerics::kOfficial) {
      ParallelRows(ctx.threads, rows, 4 * dim, [&](int, int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          for (int64_t c = 0; c < dim; ++c)
            out[r * dim + c] = formats::RoundToBf16(out[r * dim + c] / divisor[r]);
        }
      });
    }
  }
  return absl::OkStatus();
}

}  // namespace quantd::model
