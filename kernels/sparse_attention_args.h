// The inputs of DeepSeek-V4's sparse attention over one sequence, shared by the CPU block
// (server/model/v4_attention_sparse.h, which says what is read and how) and its CUDA twin
// (kernels/cuda/v4_attention_blocks.h). Every pointer lies in the memory of the device that runs
// the attention.
#ifndef QUANTD_KERNELS_SPARSE_ATTENTION_ARGS_H_
#define QUANTD_KERNELS_SPARSE_ATTENTION_ARGS_H_

#include <stdint.h>

namespace quantd::kernels {

struct SparseAttentionArgs {
  const float* q = nullptr;           // [seq_len, heads, head_dim]
  const float* kv = nullptr;          // [seq_len, head_dim], the window keys (= values)
  const float* compressed = nullptr;  // [entries, head_dim] (nullptr when entries == 0)
  int64_t entries = 0;
  // CSA: [seq_len, picks_per_query] indexer picks (-1 unused); nullptr: every visible entry
  // (HCA). The CUDA twin counts a pick outside [0, entries) as unused; the indexer never makes
  // one.
  const int32_t* picks = nullptr;
  int64_t picks_per_query = 0;
  const float* sink = nullptr;  // [heads]
  int64_t seq_len = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  int64_t window = 0;  // >= 1
  int64_t ratio = 0;   // 0: no compressed entries
};

}  // namespace quantd::kernels

#endif  // QUANTD_KERNELS_SPARSE_ATTENTION_ARGS_H_
