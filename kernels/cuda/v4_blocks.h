// The DeepSeek-V4 forward's blocks that no library does, on CUDA: each a launcher over device
// buffers (float32, row-major, on the current device) with the arithmetic of its CPU block in
// server/model/ (named below), compiled with -fmad=false, IEEE division and square root, so that
// every block without a transcendental function gives the CPU's bits. Launchers only enqueue work
// on launch.stream and return the launch error (launch.h); the caller waits on the stream.
#ifndef QUANTD_KERNELS_CUDA_V4_BLOCKS_H_
#define QUANTD_KERNELS_CUDA_V4_BLOCKS_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"

namespace quantd::kernels::cuda {

// RmsNorm (v4_mhc.h): out[r, c] = weight[c] * (x[r, c] * s), s = 1 / sqrt(float(sum / n) + eps)
// with the sum of squares in double, in column order (as the CPU sums it, so bit-exact); then
// BF16-rounded when `round_bf16` (official numerics). `out` may alias `x`.
cudaError_t LaunchRmsNorm(const float* x, int64_t rows, int64_t n, const float* weight, float eps,
                          bool round_bf16, float* out, const Launch& launch);

// ApplyRope (v4_rope.h) with the table's cos and sin [positions, pairs] in device memory: plain
// and YaRN differ only in the table. Rotates the last 2 * pairs values of each head of each row
// of x [rows, heads * head_dim] in place; `inverse` rotates by the negated angle. Bit-exact.
cudaError_t LaunchRope(const float* cos, const float* sin, int64_t pairs, const int64_t* positions,
                       bool inverse, float* x, int64_t rows, int64_t heads, int64_t head_dim,
                       const Launch& launch);

// SimulateFp8Act / SimulateFp4Act (v4_act_quant.h) in place on x [rows, cols], row stride ld,
// per row per `block` columns (cols a multiple of it; FP4: block 32), power-of-two scales.
// Bit-exact. results->first_bad: the smallest r * cols + c of a non-finite value (kNoBad: none).
cudaError_t LaunchSimulateFp8Act(float* x, int64_t rows, int64_t cols, int64_t ld, int64_t block,
                                 DeviceResults* results, const Launch& launch);
cudaError_t LaunchSimulateFp4Act(float* x, int64_t rows, int64_t cols, int64_t ld,
                                 DeviceResults* results, const Launch& launch);

// ClampedSwiglu (v4_moe.h) elementwise: g[i] = silu(min(g, limit)) * clamp(u, -limit, limit)
// (limit 0: no clamp). Uses expf: within a few ulp of the CPU, not bit-exact.
cudaError_t LaunchClampedSwiglu(float* g, const float* u, int64_t n, float limit,
                                const Launch& launch);

// SplitSinkhorn (v4_mhc.h) for each of `tokens` tokens: mixes [tokens, (2 + hc) * hc] ->
// pre [tokens, hc], post [tokens, hc], comb [tokens, hc, hc]; scale [3] and base
// [(2 + hc) * hc] in device memory. Uses expf: within a tolerance of the CPU.
cudaError_t LaunchSplitSinkhorn(const float* mixes, const float* scale, const float* base,
                                int64_t tokens, int64_t hc, int64_t iters, float eps, float* pre,
                                float* post, float* comb, const Launch& launch);

// HcPost (v4_mhc.h): out[t, k] = post[t, k] * f[t] + sum_j comb[t, j, k] * streams[t, j]
// (streams and out [tokens, hc, d], f [tokens, d]), then BF16-rounded when `round_bf16`.
// Bit-exact. `out` may not alias `streams`.
cudaError_t LaunchHcPost(const float* post, const float* comb, const float* f,
                         const float* streams, int64_t tokens, int64_t hc, int64_t d,
                         bool round_bf16, float* out, const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_V4_BLOCKS_H_
