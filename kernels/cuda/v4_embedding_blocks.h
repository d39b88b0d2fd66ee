// The embedding gather of DeepSeek-V4 (EmbeddingRows in server/model/v4_layer.h) on CUDA, in the
// style of v4_blocks.h: device buffers, work enqueued on launch.stream, the launch error returned.
#ifndef QUANTD_KERNELS_CUDA_V4_EMBEDDING_BLOCKS_H_
#define QUANTD_KERNELS_CUDA_V4_EMBEDDING_BLOCKS_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"

namespace quantd::kernels::cuda {

// out[t * stride + j * d + i] = float(table[ids[t], i]) for j < copies (the hc streams of a token
// start equal): table BF16 [vocab, d], ids [tokens], out float32 with row stride `stride`
// (>= copies * d). Bit-exact (a widening copy).
// results->first_bad: the smallest t whose id is outside [0, vocab) (Embed's check); that
// token's rows are not written.
cudaError_t LaunchEmbeddingRows(const uint16_t* table, int64_t vocab, int64_t d,
                                const int32_t* ids, int64_t tokens, int64_t stride,
                                int64_t copies, float* out, DeviceResults* results,
                                const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_V4_EMBEDDING_BLOCKS_H_
