// The parts of mHC's hc_pre and hc_head (server/model/v4_mhc.h) around their GEMM, on CUDA;
// hc_post and the Sinkhorn split are in v4_blocks.h. Launchers in the style of v4_blocks.h
// (device buffers, float32 row-major, work enqueued on launch.stream, the launch error returned).
//
//   hc_pre:  mixes = streams_flat · fn^T (Gemm);  LaunchHcScaleMixes;  LaunchSplitSinkhorn;
//            LaunchHcCollapse(pre)
//   hc_head: mixes = streams_flat · fn^T (Gemm);  LaunchHcScaleMixes;  LaunchHcHeadPre;
//            LaunchHcCollapse(pre)
#ifndef QUANTD_KERNELS_CUDA_V4_MHC_BLOCKS_H_
#define QUANTD_KERNELS_CUDA_V4_MHC_BLOCKS_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"

namespace quantd::kernels::cuda {

// The scaling of the mixes after their GEMM: mixes[t, i] *= 1 / sqrt(float(sum / width) + eps)
// for mixes [tokens, mix_width], sum = the squares of streams[t, :] ([tokens, width], width =
// hc * d) summed in double in column order, as the CPU sums them. Bit-exact. One thread per
// token (the sum is sequential to keep the CPU's rounding).
cudaError_t LaunchHcScaleMixes(const float* streams, int64_t tokens, int64_t width, float eps,
                               float* mixes, int64_t mix_width, const Launch& launch);

// hc_head's stream weights: pre[t, j] = sigmoid(mixes[t, j] * scale[0] + base[j]) + eps over
// mixes [tokens, hc] (scaled), scale [1] and base [hc] in device memory. The argument is the
// CPU's bits; expf differs by at most 2 + 1 ulp (CUDA, host), 1 + e, the division and + eps by
// one more ulp each: within 12 * 2^-24 relative of the CPU's, not bit-exact.
cudaError_t LaunchHcHeadPre(const float* mixes, const float* scale, const float* base,
                            int64_t tokens, int64_t hc, float eps, float* pre,
                            const Launch& launch);

// The collapse of hc_pre and hc_head: y[t, c] = sum_j pre[t, j] * streams[t, j, c] (j ascending,
// from 0) over streams [tokens, hc, d], then BF16-rounded when `round_bf16`. Bit-exact.
cudaError_t LaunchHcCollapse(const float* pre, const float* streams, int64_t tokens, int64_t hc,
                             int64_t d, bool round_bf16, float* y, const Launch& launch);

// The MTP block's input (RunMtp): x[t, j, :] = e[t, :] + x[t, j, :] over x [tokens, hc, d] and
// e [tokens, d]; bit-exact (one float addition per element).
cudaError_t LaunchAddToStreams(const float* e, int64_t tokens, int64_t hc, int64_t d, float* x,
                               const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_V4_MHC_BLOCKS_H_
