// Kernels of v4_blocks.h. Each computes an output element with the same float operations in
// the same order as its CPU block, so that -fmad=false and IEEE division and square root (the
// library's CUDA flags) give the CPU's bits; only expf differs from the host's exp.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_blocks.h"
#include "kernels/formats.h"
#include "kernels/v4_row_math.h"

namespace quantd::kernels::cuda {
namespace {

using namespace quantd::formats;  // NOLINT: kernels spell out formats.h like the CPU blocks

// One block per row: thread 0 sums the squares in column order (the CPU's order: a tree would
// round differently), then every thread scales its columns.
__global__ void RmsNormKernel(const float* x, int64_t n, const float* weight, float eps,
                              bool round_bf16, float* out) {
  __shared__ float scale;
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * n;
  float* orow = out + static_cast<int64_t>(blockIdx.x) * n;
  if (threadIdx.x == 0) scale = v4math::RsqrtMeanSquare(xr, n, eps);
  __syncthreads();
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    const float v = weight[c] * (xr[c] * scale);
    orow[c] = round_bf16 ? RoundToBf16(v) : v;
  }
}

// One item per (row, head, pair).
__global__ void RopeKernel(const float* cos_table, const float* sin_table, int64_t pairs,
                           const int64_t* positions, bool inverse, float* x, int64_t rows,
                           int64_t heads, int64_t head_dim) {
  const int64_t items = rows * heads * pairs;
  const int64_t first = head_dim - 2 * pairs;
  for (int64_t item = FirstItem(); item < items; item += ItemStride()) {
    const int64_t i = item % pairs;
    const int64_t rh = item / pairs;  // row * heads + head
    const int64_t p = positions[rh / heads];
    const float s = inverse ? -sin_table[p * pairs + i] : sin_table[p * pairs + i];
    v4math::RotatePair(cos_table[p * pairs + i], s, x + rh * head_dim + first + 2 * i);
  }
}

// One item per (row, block of columns). kFp4 selects E2M1 (max 6) over E4M3 (max 448).
template <bool kFp4>
__global__ void SimulateActKernel(float* x, int64_t rows, int64_t cols, int64_t ld, int64_t block,
                                  DeviceResults* results) {
  const float max_code = kFp4 ? kE2m1Max : kE4m3Max;
  const float min_amax = kFp4 ? 6.0f * 0x1p-126f : 1e-4f;  // kernel.py's floors (v4_act_quant.cc)
  const int64_t per_row = cols / block;
  unsigned long long bad = kNoBad;
  for (int64_t item = FirstItem(); item < rows * per_row; item += ItemStride()) {
    const int64_t r = item / per_row;
    const int64_t b = (item % per_row) * block;
    float* row = x + r * ld;
    float amax = 0.0f;
    bool finite = true;
    for (int64_t c = b; c < b + block; ++c) {
      if (!IsFinite(row[c])) {
        bad = min(bad, static_cast<unsigned long long>(r * cols + c));
        finite = false;
        break;
      }
      const float a = AbsF(row[c]);
      amax = a > amax ? a : amax;
    }
    if (!finite) continue;
    const float inv = 1.0f / max_code;
    const float s = Exp2Int(CeilLog2((amax > min_amax ? amax : min_amax) * inv));
    for (int64_t c = b; c < b + block; ++c) {
      float q = row[c] / s;
      q = q > max_code ? max_code : (q < -max_code ? -max_code : q);
      row[c] = (kFp4 ? E2m1ToFloat(FloatToE2m1(q)) : E4m3ToFloat(FloatToE4m3(q))) * s;
    }
  }
  ReportBad(results, bad);
}

__global__ void ClampedSwigluKernel(float* g, const float* u, int64_t n, float limit) {
  for (int64_t i = FirstItem(); i < n; i += ItemStride()) {
    g[i] = v4math::ClampedSwiglu(g[i], u[i], limit);
  }
}

// One thread per token: the shared SplitSinkhorn (kernels/v4_row_math.h).
__global__ void SplitSinkhornKernel(const float* mixes, const float* scale, const float* base,
                                    int64_t tokens, int64_t hc, int64_t iters, float eps,
                                    float* pre, float* post, float* comb) {
  for (int64_t t = FirstItem(); t < tokens; t += ItemStride()) {
    v4math::SplitSinkhorn(mixes + t * (2 + hc) * hc, scale, base, hc, iters, eps, pre + t * hc,
                          post + t * hc, comb + t * hc * hc);
  }
}

// One item per output element (token, stream k, column c).
__global__ void HcPostKernel(const float* post, const float* comb, const float* f,
                             const float* streams, int64_t tokens, int64_t hc, int64_t d,
                             bool round_bf16, float* out) {
  for (int64_t item = FirstItem(); item < tokens * hc * d; item += ItemStride()) {
    const int64_t c = item % d;
    const int64_t k = (item / d) % hc;
    const int64_t t = item / (hc * d);
    const float* st = streams + t * hc * d;
    const float* ct = comb + t * hc * hc;
    float acc = 0.0f;
    for (int64_t j = 0; j < hc; ++j) acc += ct[j * hc + k] * st[j * d + c];
    const float v = post[t * hc + k] * f[t * d + c] + acc;
    out[item] = round_bf16 ? RoundToBf16(v) : v;
  }
}

}  // namespace

cudaError_t LaunchRmsNorm(const float* x, int64_t rows, int64_t n, const float* weight, float eps,
                          bool round_bf16, float* out, const Launch& launch) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, launch.stream>>>(x, n, weight, eps,
                                                                            round_bf16, out);
  return cudaGetLastError();
}

cudaError_t LaunchRope(const float* cos, const float* sin, int64_t pairs, const int64_t* positions,
                       bool inverse, float* x, int64_t rows, int64_t heads, int64_t head_dim,
                       const Launch& launch) {
  const int64_t items = rows * heads * pairs;
  if (items <= 0) return cudaSuccess;
  RopeKernel<<<GridFor(items, launch), kThreads, 0, launch.stream>>>(
      cos, sin, pairs, positions, inverse, x, rows, heads, head_dim);
  return cudaGetLastError();
}

cudaError_t LaunchSimulateFp8Act(float* x, int64_t rows, int64_t cols, int64_t ld, int64_t block,
                                 DeviceResults* results, const Launch& launch) {
  cudaError_t e = ResetResults(results, launch.stream);
  if (e != cudaSuccess || rows <= 0 || cols <= 0) return e;
  SimulateActKernel<false><<<GridFor(rows * (cols / block), launch), kThreads, 0,
                              launch.stream>>>(x, rows, cols, ld, block, results);
  return cudaGetLastError();
}

cudaError_t LaunchSimulateFp4Act(float* x, int64_t rows, int64_t cols, int64_t ld,
                                 DeviceResults* results, const Launch& launch) {
  constexpr int64_t kBlock = 32;  // v4_act_quant.h kFp4QuantBlock
  cudaError_t e = ResetResults(results, launch.stream);
  if (e != cudaSuccess || rows <= 0 || cols <= 0) return e;
  SimulateActKernel<true><<<GridFor(rows * (cols / kBlock), launch), kThreads, 0,
                             launch.stream>>>(x, rows, cols, ld, kBlock, results);
  return cudaGetLastError();
}

cudaError_t LaunchClampedSwiglu(float* g, const float* u, int64_t n, float limit,
                                const Launch& launch) {
  if (n <= 0) return cudaSuccess;
  ClampedSwigluKernel<<<GridFor(n, launch), kThreads, 0, launch.stream>>>(g, u, n, limit);
  return cudaGetLastError();
}

cudaError_t LaunchSplitSinkhorn(const float* mixes, const float* scale, const float* base,
                                int64_t tokens, int64_t hc, int64_t iters, float eps, float* pre,
                                float* post, float* comb, const Launch& launch) {
  if (tokens <= 0) return cudaSuccess;
  SplitSinkhornKernel<<<GridFor(tokens, launch), kThreads, 0, launch.stream>>>(
      mixes, scale, base, tokens, hc, iters, eps, pre, post, comb);
  return cudaGetLastError();
}

cudaError_t LaunchHcPost(const float* post, const float* comb, const float* f,
                         const float* streams, int64_t tokens, int64_t hc, int64_t d,
                         bool round_bf16, float* out, const Launch& launch) {
  const int64_t items = tokens * hc * d;
  if (items <= 0) return cudaSuccess;
  HcPostKernel<<<GridFor(items, launch), kThreads, 0, launch.stream>>>(
      post, comb, f, streams, tokens, hc, d, round_bf16, out);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
