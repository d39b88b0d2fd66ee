// The window pooling of DeepSeek-V4's KV compressor (PoolCompressorWindows in
// server/model/v4_compressor.h) on CUDA, in the style of v4_blocks.h: device buffers, float32
// row-major, work enqueued on launch.stream, the launch error returned. The projections before
// it are GEMMs (the device's Gemm); the norm and RoPE after it are v4_blocks.h's.
#ifndef QUANTD_KERNELS_CUDA_V4_COMPRESSOR_BLOCKS_H_
#define QUANTD_KERNELS_CUDA_V4_COMPRESSOR_BLOCKS_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"

namespace quantd::kernels::cuda {

// PoolCompressorWindows for each of `sequences` sequences at once: kv and score
// [sequences * seq_len, coff * width] (coff = 2 when ratio == 4, the CSA overlap; else 1), ape
// [ratio, coff * width] -> out [sequences * (seq_len / ratio), width], sequence-major
// (RunCompressor's layout). Each output is the softmax over its window's slots (8 with the overlap, 4 in a
// sequence's first window, 128 for HCA) of score + ape weighting kv, in the CPU's slot order.
// The exponentials use expf (CUDA: 2 ulp, host: 1): an output is within
// (16 + 4 * slots) * 2^-24 * sum_s |kv_s| p_s of the CPU's (p_s its softmax weights), not
// bit-exact. One thread per (sequence, window, channel); it reads its slots three times (max,
// sum, weighted sum) instead of holding them.
cudaError_t LaunchPoolCompressorWindows(const float* kv, const float* score, const float* ape,
                                        int64_t sequences, int64_t seq_len, int64_t ratio,
                                        int64_t width, float* out, const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_V4_COMPRESSOR_BLOCKS_H_
