// DeepSeek-V4's sparse attention over one sequence (official `sparse_attn` kernel with the key
// lists of `get_window_topk_idxs` / `get_compress_topk_idxs` / the indexer at start_pos 0;
// transformers `eager_attention_forward` with the sliding-window mask and the compressor's
// block bias). K = V: one shared head serves every query head.
//
// Query t reads, in this order (the official key list):
//   - the window: positions max(0, t - window + 1) .. t (a list of min(seq_len, window) slots,
//     the unused ones at its end);
//   - then the compressed entries: all entries e < (t + 1) / ratio in order (HCA, a list of
//     `entries` slots), or the indexer's picks in their order (CSA; -1 marks an unused slot).
// p = softmax over the read keys of (q . k) * head_dim^-0.5 with the head's sink as an extra
// logit in the denominator only; o = sum p * k.
//
// math: float32; the max includes the sink (transformers concatenates it as a logit).
// official: the kernel's online softmax over blocks of 64 list slots: running max m_b over the
// real keys only, sum_exp = sum_exp * e^(m_prev - m_b) + sum e^(s - m_b) in float32, the P·V
// weights rounded to BF16 before the product (acc_o likewise rescaled per block),
// sum_exp += e^(sink - m_final), o = acc_o / sum_exp rounded to BF16.
#ifndef QUANTD_SERVER_MODEL_V4_ATTENTION_SPARSE_H_
#define QUANTD_SERVER_MODEL_V4_ATTENTION_SPARSE_H_

#include <stdint.h>

#include "absl/status/status.h"
#include "kernels/sparse_attention_args.h"
#include "server/model/v4_linear.h"

namespace quantd::model {

// o [seq_len, heads, head_dim]. Scores and P·V go through ctx.gemm; errors from it pass through.
absl::Status SparseAttention(const ForwardContext& ctx, const kernels::SparseAttentionArgs& in,
                             float* o);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_ATTENTION_SPARSE_H_
