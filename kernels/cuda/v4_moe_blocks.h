// The DeepSeek-V4 MoE's steps other than its GEMMs, on CUDA (CPU: server/model/v4_moe.h): the
// router, and the grouping, gather, routing-weight scaling and scatter-add around the expert
// GEMMs (which stay on cuBLAS through the device's Gemm). Launchers in the style of v4_blocks.h:
// device buffers (float32 row-major unless named otherwise), work enqueued on launch.stream,
// the launch error returned; compiled with -fmad=false and IEEE division and square root.
//
// A routed MoE on the device, step by step as MoeForward does it:
//   logits = gate(x) (Gemm, fp32)      LaunchRouteByScore / LaunchRouteByHash -> ids, weights
//   LaunchGroupByExpert -> offsets (copied to the host: the GEMM sizes), rows, row_weights
//   sum = 0 (cudaMemsetAsync: +0.0f, as the CPU's)
//   for each expert e ascending with n = offsets[e + 1] - offsets[e] > 0 rows:
//     LaunchGatherRows(x, rows + offsets[e]) -> xe;  w1, w3 (Gemm);  LaunchClampedSwiglu
//     LaunchScaleRows(row_weights + offsets[e]) on w2's input (on its fp32 output for W4A4)
//     w2 (Gemm);  LaunchAddRows(out, rows + offsets[e]) into sum
//   y = shared expert(x) (model dtype);  LaunchAddRoutedSum(sum, y)
// Each expert's scatter-add is its own launch, in ascending expert order on one stream, so every
// element of sum sees the CPU's additions in the CPU's order: bit-exact.
#ifndef QUANTD_KERNELS_CUDA_V4_MOE_BLOCKS_H_
#define QUANTD_KERNELS_CUDA_V4_MOE_BLOCKS_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"

namespace quantd::kernels::cuda {

// Route (v4_moe.h) in a score-routed layer: for each token t of logits [tokens, experts], the
// topk experts of sqrtsoftplus(logit) + bias[e] in descending order, ties to the lower id
// (ids [tokens, topk]), weights [tokens, topk] = score / (sum of the chosen scores, in rank
// order) * route_scale from the unbiased scores. One warp per token.
// The selection and its order are the CPU's whenever no two biased scores the CPU ranks next to
// each other (ranks 0..topk) are within the score error of each other: exact ties (the same logit
// and bias) are broken by id as on the CPU. Scores use expf and log1pf (CUDA: 2 and 1 ulp) where
// the host uses its own: within 2^-20 relative of the CPU's; weights within
// (2^-19 + (topk + 2) * 2^-23) relative.
// results->first_bad: the smallest t * experts + e whose logit or biased score is not finite
// (the CPU's ordering is undefined there; the device's ranks such a NaN last).
// InvalidValue unless 1 <= topk <= experts.
cudaError_t LaunchRouteByScore(const float* logits, int64_t tokens, int64_t experts,
                               const float* bias, int64_t topk, float route_scale, int32_t* ids,
                               float* weights, DeviceResults* results, const Launch& launch);

// Route in a hash layer: ids[t] = tid2eid[token_ids[t]] (tid2eid [vocab, topk], its ids in
// [0, experts) as LoadMoe checks them), weights as in LaunchRouteByScore. One thread per token.
// ids bit-exact; weights within the tolerance above.
// results->first_bad: the smallest t whose token id is outside [0, vocab) (MoeForward's check);
// that token's ids and weights are not written.
cudaError_t LaunchRouteByHash(const float* logits, int64_t tokens, int64_t experts,
                              const int32_t* token_ids, const int32_t* tid2eid, int64_t vocab,
                              int64_t topk, float route_scale, int32_t* ids, float* weights,
                              DeviceResults* results, const Launch& launch);

// GroupByExpert (v4_moe.h), flattened: expert e's rows are [offsets[e], offsets[e + 1]) of
// rows (token indices, ascending) and row_weights (their routing weights); offsets
// [experts + 1], rows and row_weights [tokens * topk]. ids and weights [tokens, topk] as the
// router writes them. Bit-exact (a stable counting sort: one block per expert).
// results->first_bad: the smallest t * topk + k whose id is outside [0, experts); such entries
// are left out of every expert.
cudaError_t LaunchGroupByExpert(const int32_t* ids, const float* weights, int64_t tokens,
                                int64_t topk, int64_t experts, int64_t* offsets, int64_t* rows,
                                float* row_weights, DeviceResults* results, const Launch& launch);

// GatherRows (v4_moe.h): out[i, :] = x[rows[i], :] for i < n, rows of d values. Bit-exact.
cudaError_t LaunchGatherRows(const float* x, int64_t d, const int64_t* rows, int64_t n,
                             float* out, const Launch& launch);

// ScaleRows (v4_moe.h) then, when `round_bf16`, ToModelDtype: x[r, c] = weights[r] * x[r, c]
// over x [rows, cols]. Bit-exact.
cudaError_t LaunchScaleRows(const float* weights, int64_t rows, int64_t cols, bool round_bf16,
                            float* x, const Launch& launch);

// AddRows (v4_moe.h): sum[rows[i], :] += out[i, :] for i < n, rows of d values. The rows of
// one call must be distinct (a token is routed to an expert at most once): no atomics. Bit-exact.
cudaError_t LaunchAddRows(const float* out, const int64_t* rows, int64_t n, int64_t d, float* sum,
                          const Launch& launch);

// MoeForward's last step: y[i] = sum[i] + y[i] (the routed sum plus the shared expert's output)
// over n values, then BF16-rounded when `round_bf16`. Bit-exact.
cudaError_t LaunchAddRoutedSum(const float* sum, int64_t n, bool round_bf16, float* y,
                               const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_V4_MOE_BLOCKS_H_
