// The DeepSeek-V4 attention path's blocks that no library does, on CUDA: the sparse attention
// with sinks and the lightning indexer's pieces (its top-k around CUB's sort). Each is a launcher over device buffers
// (row-major, on the current device) with the arithmetic of its CPU block in server/model/
// (named below), compiled with the library's CUDA flags (-fmad=false, IEEE division and square
// root; see v4_blocks.h), so that blocks without a transcendental function give the CPU's bits.
// Launchers only enqueue work on launch.stream and return the launch error (launch.h);
// cudaErrorInvalidValue for arguments the kernels cannot serve. The caller waits on the stream.
#ifndef QUANTD_KERNELS_CUDA_V4_ATTENTION_BLOCKS_H_
#define QUANTD_KERNELS_CUDA_V4_ATTENTION_BLOCKS_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"
#include "kernels/sparse_attention_args.h"

namespace quantd::kernels::cuda {

// SparseAttention (v4_attention_sparse.h) -> o [seq_len, heads, head_dim], `official` selecting
// the official numerics over math. The same key lists and the same operations in the same
// order as the CPU block, except the two dot-product sums (q . k and P . V, which the CPU hands
// to its GEMM) and expf against the host's exp: within a tolerance of the CPU, not bit-exact
// (v4_cuda_attention_test derives it). One block of 256 threads per token and group of up to
// 16 heads; dynamic shared memory 4 * (slots + heads_per_block * (head_dim + slots + 1 +
// official * 3 * ceil(slots / 64))) bytes, slots = min(seq_len, window) + (picks_per_query or
// entries); heads per block shrink until it fits in 100 KiB (two blocks per SM), or failing
// that in the device's per-block limit (cudaErrorInvalidValue when one head does not fit).
// V4 Pro CSA (128 heads of 512, window 128, 1024 picks): 10 groups of 13 heads, 94 KB official.
cudaError_t LaunchSparseAttention(const SparseAttentionArgs& args, bool official, float* o,
                                  const Launch& launch);

// How LaunchSparseAttention lays out valid `args` on a device whose per-block shared memory
// limit (with opt-in) is `shared_limit` bytes; heads_per_block 0 when one head does not fit.
struct SparseAttentionPlan {
  int64_t heads_per_block = 0;  // query heads sharing one block's key loads
  int64_t groups = 0;           // blocks per token: ceil(heads / heads_per_block)
  int64_t shared_bytes = 0;     // dynamic shared memory per block
};
SparseAttentionPlan PlanSparseAttention(const SparseAttentionArgs& args, bool official,
                                        int64_t shared_limit);

// HadamardRows (v4_indexer.h) in place on x [rows, n], n a power of two up to 8192; with
// `round_bf16` the result is rounded to BF16 (as SimulateIndexerFp4 does before its FP4 step).
// The same butterflies in the same order: bit-exact.
cudaError_t LaunchHadamardRows(float* x, int64_t rows, int64_t n, bool round_bf16,
                               const Launch& launch);

// SimulateIndexerFp4 (v4_indexer.h) in place on x [rows, n], n a power of two and a multiple
// of 32 (whole FP4 blocks) up to 8192: LaunchHadamardRows with BF16 rounding, then
// LaunchSimulateFp4Act (v4_blocks.h). Bit-exact. results->first_bad: the smallest r * n + c of
// a non-finite value after the transform (kNoBad: none), where the CPU block fails.
cudaError_t LaunchSimulateIndexerFp4(float* x, int64_t rows, int64_t n, DeviceResults* results,
                                     const Launch& launch);

// IndexerScores (v4_indexer.h): scores [queries, entries] from dots [queries, heads, entries]
// and weights [queries, heads], only the visible entries s < (first_position + i + 1) / ratio
// written, `official` selecting the official numerics. The sum over heads in head order, as the
// CPU sums it: bit-exact.
cudaError_t LaunchIndexerScores(bool official, const float* dots, const float* weights,
                                int64_t queries, int64_t heads, int64_t dim, int64_t entries,
                                int64_t first_position, int64_t ratio, float* scores,
                                const Launch& launch);

// SelectTopEntries (v4_indexer.h) by a sort: picks [queries, k] from scores [queries, entries]
// hold, for the query at position t = first_position + i, its visible entries
// (s < (t + 1) / ratio) best first, then -1 for the slots no visible entry fills; future
// entries are never picked and their scores never read.
// Tie order. The device ranks a query's entries by a total order: higher score first, equal
// scores (a == b as floats, so -0.0 equals +0.0) by lower entry id first, a NaN score equal to
// -inf. That is a stable descending sort of the visible (score, entry) pairs in entry order
// (cub::DeviceSegmentedRadixSort: stable, -0.0 and +0.0 equal; NaN turned into -inf first), cut
// after k. It is also the order of all entries with the future ones at -inf, as the CPU ranks
// them: those come after every visible entry, a visible -inf included (its id is lower).
// Against the CPU: the picks are the CPU's wherever no scores tie; where they tie, the CPU
// follows libstdc++'s selection (torch.topk's order on the CPU) and the device this total
// order: the same scores in the same order, possibly other entries among equal scores. With a
// NaN score the CPU's comparator (a.score > b.score) is no order (NaN is neither better nor
// worse than any score) and its picks are unspecified; the device's are as stated.
// The launcher chunks: rows go to the sort in passes of min(queries, max(1, 2^22 / entries))
// queries (kTopEntriesPassItems in the .cu), so the scratch is bounded whatever `queries`.
// `scratch` (device memory aligned as cudaMalloc's) holds TopEntriesScratchBytes(queries,
// entries) bytes: 16 per entry of a pass's rows (the sort's key and id buffers, both given to
// CUB so that its own temporary storage holds no copy of them, a few hundred bytes), 8 per row
// (its segment): at most 64 MiB + 1 MiB, or 16 bytes per entry of one longer row.
// TopEntriesScratchBytes asks CUB for its size on the current device: -1 when CUB cannot
// answer (no usable device) or entries > INT32_MAX, 0 for no work. Needs k <= entries < 2^31
// (k = 0 or queries <= 0: nothing to do). Enqueues only (CUB's sort included): no host
// synchronization; launch.max_blocks bounds this launcher's own kernels, not CUB's.
int64_t TopEntriesScratchBytes(int64_t queries, int64_t entries);
cudaError_t LaunchSelectTopEntries(const float* scores, int64_t first_position, int64_t queries,
                                   int64_t entries, int64_t ratio, int64_t k, void* scratch,
                                   int32_t* picks, const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_V4_ATTENTION_BLOCKS_H_
