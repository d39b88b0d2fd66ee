// Activation quantization simulation of DeepSeek's official kernels (inference/kernel.py): values
// are quantized and immediately dequantized in place, so the following fp32 product sees exactly
// the operand the FP8/FP4 tensor-core GEMM would.
//
//  - FP8 (`act_quant(x, block, "ue8m0")`): per row, per `block` columns,
//    amax = max(max|x|, 1e-4), s = 2^ceil(log2(amax * (1/448))) (fast_round_scale: the product
//    with the fp32 reciprocal, not a division), x = e4m3_rne(clamp(x / s, -448, 448)) * s.
//    Blocks of 128 before every FP8/FP4 GEMM; 64 for the KV cache's nope part.
//  - FP4 (`fp4_quant`, the indexer): per row, per 32 columns, amax = max(max|x|, 6 * 2^-126),
//    s = 2^ceil(log2(amax * (1/6))), x = e2m1_rne(clamp(x / s, -6, 6)) * s.
// Scales are powers of two, so x / s and q * s are exact: the only rounding is the E4M3 / E2M1
// cast. Widths must be multiples of the block (the official kernels assert the same).
#ifndef QUANTD_SERVER_MODEL_V4_ACT_QUANT_H_
#define QUANTD_SERVER_MODEL_V4_ACT_QUANT_H_

#include <stdint.h>

#include "absl/status/status.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {

inline constexpr int64_t kActQuantBlock = 128;  // before FP8/FP4 GEMMs
inline constexpr int64_t kKvQuantBlock = 64;    // KV cache nope dims
inline constexpr int64_t kFp4QuantBlock = 32;   // indexer FP4 simulation

// The power-of-two scale for a block with absolute maximum `amax` (already floored) and format
// maximum `max_code` (448 or 6): 2^ceil(log2(amax * (1 / max_code))).
float PowerOfTwoScale(float amax, float max_code);

// FP8 E4M3 simulation of x [rows, cols] in place, row stride `ld` (>= cols), rows split over up
// to `threads` threads (v4_parallel.h). InvalidArgument when cols is not a multiple of `block` or
// a value is not finite (naming the first such [row, col]).
absl::Status SimulateFp8Act(float* x, int64_t rows, int64_t cols, int64_t ld, int64_t block,
                            const HostThreads& threads = {});

// FP4 E2M1 simulation of x [rows, cols] in place (block 32), as SimulateFp8Act.
absl::Status SimulateFp4Act(float* x, int64_t rows, int64_t cols, int64_t ld,
                            const HostThreads& threads = {});

// Round every value to BF16 (RNE) and back, in place: the official code's BF16 tensors.
void RoundToBf16(float* x, int64_t n);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_ACT_QUANT_H_
