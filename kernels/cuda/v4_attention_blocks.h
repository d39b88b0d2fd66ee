// The DeepSeek-V4 attention path's blocks that no library does, on CUDA: the sparse attention
// with sinks and the lightning indexer's pieces. Each is a launcher over device buffers
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
#include "kernels/cuda/libstdcxx_selection.h"

namespace quantd::kernels::cuda {

// The inputs of LaunchSparseAttention, as SparseAttentionInput (v4_attention_sparse.h) names
// them; every pointer is a device pointer.
struct SparseAttentionArgs {
  const float* q = nullptr;           // [seq_len, heads, head_dim]
  const float* kv = nullptr;          // [seq_len, head_dim], the window keys (= values)
  const float* compressed = nullptr;  // [entries, head_dim] (nullptr when entries == 0)
  int64_t entries = 0;
  // CSA: [seq_len, picks_per_query] indexer picks, -1 unused; nullptr: every visible entry
  // (HCA). A pick outside [0, entries) counts as unused (the CPU block never gets one).
  const int32_t* picks = nullptr;
  int64_t picks_per_query = 0;
  const float* sink = nullptr;  // [heads]
  int64_t seq_len = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  int64_t window = 0;  // >= 1
  int64_t ratio = 0;   // 0: no compressed entries
};

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

// SelectTopEntries (v4_indexer.h): picks [queries, k] from scores [queries, entries], one
// thread per query (blocks of 32) running libstdc++'s selection (libstdcxx_selection.h) over
// its row of `scratch`, so that equal scores resolve as on the CPU: bit-exact. Sequential per
// query: O(entries + k log k) steps on global memory. `scratch` holds
// TopEntriesScratchBytes(queries, entries) bytes of device memory. Needs k <= entries < 2^31
// (k = 0: nothing to do).
inline int64_t TopEntriesScratchBytes(int64_t queries, int64_t entries) {
  return queries * entries * static_cast<int64_t>(sizeof(ScoredEntry));
}
cudaError_t LaunchSelectTopEntries(const float* scores, int64_t first_position, int64_t queries,
                                   int64_t entries, int64_t ratio, int64_t k, void* scratch,
                                   int32_t* picks, const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_V4_ATTENTION_BLOCKS_H_
