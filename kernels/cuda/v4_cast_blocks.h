// The dtype steps of the DeepSeek-V4 forward on CUDA that sit around its GEMMs (CPU:
// ToModelDtype in server/model/v4_linear.h, and the BF16 widening OpenBLAS's Gemm does per tile):
// launchers in the style of v4_blocks.h (device buffers, work enqueued on launch.stream, the
// launch error returned). All bit-exact: a widening copy and round-to-nearest-even to BF16 with
// formats.h's conversions.
#ifndef QUANTD_KERNELS_CUDA_V4_CAST_BLOCKS_H_
#define QUANTD_KERNELS_CUDA_V4_CAST_BLOCKS_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"

namespace quantd::kernels::cuda {

// x[i] = bf16(x[i]) as float, in place over n values (RoundToBf16).
cudaError_t LaunchRoundToBf16(float* x, int64_t n, const Launch& launch);

// out[i] = the BF16 bits of x[i] (RNE) over n values: an F32 operand turned into a BF16 one for
// cuBLAS, exact when x holds BF16-representable values.
cudaError_t LaunchNarrowToBf16(const float* x, int64_t n, uint16_t* out, const Launch& launch);

// out[i] = float(x[i]) over n BF16 values: a BF16 operand widened for a float32 product.
cudaError_t LaunchWidenBf16(const uint16_t* x, int64_t n, float* out, const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_V4_CAST_BLOCKS_H_
