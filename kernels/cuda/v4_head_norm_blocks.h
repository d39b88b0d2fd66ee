// The attention's per-head q normalisation of DeepSeek-V4 (NormalizeHeads in
// server/model/v4_attention.h) on CUDA, in the style of v4_blocks.h: device buffers, work
// enqueued on launch.stream, the launch error returned.
#ifndef QUANTD_KERNELS_CUDA_V4_HEAD_NORM_BLOCKS_H_
#define QUANTD_KERNELS_CUDA_V4_HEAD_NORM_BLOCKS_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"

namespace quantd::kernels::cuda {

// NormalizeHeads in place on q [rows, dim]: q *= 1 / sqrt(mean(q^2) + eps), the sum of squares
// in float32 in column order; `official` rounds each square, the mean, mean + eps, the scale and
// each product to BF16 as the CPU block does. One thread per row, the CPU's operations in its
// order (IEEE division and square root, no fused multiply-add): bit-exact.
cudaError_t LaunchNormalizeHeads(bool official, float eps, float* q, int64_t rows, int64_t dim,
                                 const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_V4_HEAD_NORM_BLOCKS_H_
