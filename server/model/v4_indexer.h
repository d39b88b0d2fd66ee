// The lightning indexer of DeepSeek-V4's CSA layers (official `Indexer.forward` at start_pos 0;
// transformers `DeepseekV4Indexer` + `DeepseekV4IndexerScorer`): for every query token it picks
// the compressed entries its attention reads.
//
//   qI = indexer.wq_b(qr) viewed [n_heads, head_dim], RoPE of the last rope dims at the token's
//        position; kI = indexer.compressor entries (v4_compressor.h, width head_dim)
//   official: qI and kI get the Hadamard transform (HadamardRows) and then the FP4 simulation
//        (block 32); math omits both (the scaled Hadamard is orthonormal, so it changes q.k only
//        through the FP4 rounding, as transformers omits it)
//   weights = weights_proj(x)
//   score[t][s] = sum_h relu(qI[t,h] . kI[s]) * head_dim^-0.5 * weights[t,h] * n_heads^-0.5
//        official: weights * (head_dim^-0.5 * n_heads^-0.5) rounded to BF16 once, then
//        bf16(sum_h bf16(relu(bf16(qI.kI)) * w)): the official einsum, relu and head sum are BF16
//   entries s >= (t + 1) / 4 are in the future; of the k = min(index_topk, S/4) best scores the
//   future ones become -1.
#ifndef QUANTD_SERVER_MODEL_V4_INDEXER_H_
#define QUANTD_SERVER_MODEL_V4_INDEXER_H_

#include <stdint.h>

#include <vector>

#include "absl/status/statusor.h"
#include "server/model/v4_attention.h"
#include "server/model/v4_config.h"
#include "server/model/v4_forward_ops.h"
#include "server/model/v4_linear.h"
#include "server/model/v4_rope.h"

namespace quantd::model {

// The Sylvester-ordered Hadamard transform of each row of x [rows, n], scaled by n^-0.5, in
// place: y[i] = n^-0.5 * sum_j (-1)^popcount(i & j) x[j]. n must be a power of two.
void HadamardRows(float* x, int64_t rows, int64_t n);

// The official indexer's activation simulation of q or k rows [rows, n] (n a power of two and a
// multiple of 32), in place: the Hadamard transform (HadamardRows) rounded to BF16, as
// fast_hadamard_transform returns it, then the FP4 simulation (SimulateFp4Act, block 32). Rows
// split over up to `threads` threads. Errors from the FP4 simulation (a non-finite value).
absl::Status SimulateIndexerFp4(float* x, int64_t rows, int64_t n, const HostThreads& threads);

// The product behind the index scores: dots [rows, entries] = q [rows, dim] · keys [entries,
// dim]^T, rows being a sequence's queries times the indexer heads (row-major in the memory of
// the device whose Gemm runs it).
kernels::SgemmArgs IndexerDotsProduct(const float* q, const float* keys, int64_t rows,
                                      int64_t entries, int64_t dim, float* dots);

// The index scores of `queries` consecutive queries of one sequence, the first at position
// `first_position`: scores [queries, entries] from the dot products dots [queries, heads,
// entries] (qI . kI) and the head weights [queries, heads] as RunIndexer scales them (official:
// bf16(weights_proj(x) * head_dim^-0.5 * heads^-0.5); math: weights_proj(x) * heads^-0.5). Only
// the visible entries s < (t + 1) / ratio are written.
//   official: bf16(sum_h bf16(relu(bf16(dot)) * w[h])), the sum over heads in float32 in head
//             order (a BF16 tensor's sum on the CPU accumulates in float32 and rounds once)
//   math:     sum_h relu(dot) * head_dim^-0.5 * w[h], float32
void IndexerScores(Numerics numerics, const float* dots, const float* weights, int64_t queries,
                   int64_t heads, int64_t dim, int64_t entries, int64_t first_position,
                   int64_t ratio, float* scores);

// The picks of `queries` consecutive queries of one sequence, the first at position
// `first_position`, from their scores [queries, entries] (entries = seq_len / ratio): picks
// [queries, k] hold, for the query at position t, the visible entries (s < (t + 1) / ratio) with
// the k largest scores, best first, then -1 for the slots no visible entry fills. Future entries
// are never picked, whatever their score. Equal scores resolve exactly as torch.topk on the CPU
// resolves them (the same libstdc++ selection over (score, entry) pairs), so that `math` picks
// what transformers picks.
void SelectTopEntries(const float* scores, int64_t first_position, int64_t queries, int64_t entries,
                      int64_t ratio, int64_t k, int32_t* picks);

// The indexer's picks for every token of `batch`, over ctx's ops (batch.x, `qr` and the picks
// in their memory): [tokens, k] with k = min(index_topk, seq_len / ratio); entry ids index the
// token's own sequence. `qr` is the q_norm output [tokens, q_lora_rank]; `rope` covers positions
// up to seq_len.
struct IndexerPicks {
  int64_t k = 0;
  OpArray<int32_t> entries;  // [tokens, k], -1 for none
};
absl::StatusOr<IndexerPicks> RunIndexer(const ForwardContext& ctx, const V4Config& config,
                                        const V4IndexerWeights& w, int64_t ratio,
                                        const RopeTable& rope, const AttentionBatch& batch,
                                        const float* qr);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_INDEXER_H_
