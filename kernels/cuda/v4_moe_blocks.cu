// Kernels of v4_moe_blocks.h, each with its CPU function's float operations in the same order.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_moe_blocks.h"
#include "kernels/formats.h"
#include "kernels/v4_row_math.h"

namespace quantd::kernels::cuda {
namespace {

using formats::IsFinite;
using formats::RoundToBf16;

constexpr unsigned kFullWarp = 0xFFFFFFFFu;
constexpr int kWarpSize = 32;

using v4math::SqrtSoftplus;

// Whether expert (a, ia) ranks before (b, ib): the CPU's partial_sort comparator. Keys are never
// NaN (SelectionKey), so this is a strict total order over distinct ids.
__device__ __forceinline__ bool RanksBefore(float a, int64_t ia, float b, int64_t ib) {
  return a > b || (a == b && ia < ib);
}

// A biased score as the selection compares it: NaN ranks last, so that every step finds an
// expert (the CPU's order is undefined there; the launcher reports the token).
__device__ __forceinline__ float SelectionKey(float biased) {
  return biased != biased ? -INFINITY : biased;
}

// weights[k] = score(ids[k]) / sum * route_scale, the sum in rank order (Route's last loops).
__device__ void RoutingWeights(const float* token_logits, const int32_t* ids, int64_t topk,
                               float route_scale, float* weights) {
  float sum = 0.0f;
  for (int64_t k = 0; k < topk; ++k) sum += (weights[k] = SqrtSoftplus(token_logits[ids[k]]));
  for (int64_t k = 0; k < topk; ++k) weights[k] = weights[k] / sum * route_scale;
}

// One warp per token. Step k takes the best expert that ranks after step k - 1's choice: with a
// total order, those are exactly the experts not chosen yet, so the k-th step is the CPU's
// k-th element of partial_sort. Scores are recomputed at each step (the same float operations
// give the same value) rather than held per lane.
__global__ void RouteByScoreKernel(const float* logits, int64_t tokens, int64_t experts,
                                   const float* bias, int64_t topk, float route_scale,
                                   int32_t* ids, float* weights, DeviceResults* results) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warps = ItemStride() / kWarpSize;
  unsigned long long bad = kNoBad;
  // The loop bound depends on the warp only: every lane runs every step (full-warp shuffles).
  for (int64_t t = FirstItem() / kWarpSize; t < tokens; t += warps) {
    const float* lt = logits + t * experts;
    for (int64_t e = lane; e < experts; e += kWarpSize) {
      if (!IsFinite(lt[e]) || !IsFinite(SqrtSoftplus(lt[e]) + bias[e])) {
        bad = min(bad, static_cast<unsigned long long>(t * experts + e));
      }
    }
    int32_t* token_ids = ids + t * topk;
    float last_key = 0.0f;
    int64_t last_id = -1;  // none chosen yet
    for (int64_t k = 0; k < topk; ++k) {
      float best_key = -INFINITY;
      int64_t best_id = -1;  // this lane has no candidate yet
      for (int64_t e = lane; e < experts; e += kWarpSize) {
        const float key = SelectionKey(SqrtSoftplus(lt[e]) + bias[e]);
        if (last_id >= 0 && !RanksBefore(last_key, last_id, key, e)) continue;  // chosen already
        if (best_id < 0 || RanksBefore(key, e, best_key, best_id)) {
          best_key = key;
          best_id = e;
        }
      }
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        const float other_key = __shfl_xor_sync(kFullWarp, best_key, offset);
        const long long other_id = __shfl_xor_sync(kFullWarp, static_cast<long long>(best_id),
                                                   offset);
        if (other_id >= 0 && (best_id < 0 || RanksBefore(other_key, other_id, best_key, best_id))) {
          best_key = other_key;
          best_id = other_id;
        }
      }
      // Every lane holds the same best (topk <= experts: at least one expert is left).
      last_key = best_key;
      last_id = best_id;
      if (lane == 0) token_ids[k] = static_cast<int32_t>(best_id);
    }
    if (lane == 0) RoutingWeights(lt, token_ids, topk, route_scale, weights + t * topk);
  }
  ReportBad(results, bad);
}

// One thread per token.
__global__ void RouteByHashKernel(const float* logits, int64_t tokens, int64_t experts,
                                  const int32_t* token_ids, const int32_t* tid2eid, int64_t vocab,
                                  int64_t topk, float route_scale, int32_t* ids, float* weights,
                                  DeviceResults* results) {
  unsigned long long bad = kNoBad;
  for (int64_t t = FirstItem(); t < tokens; t += ItemStride()) {
    const int64_t token = token_ids[t];
    if (token < 0 || token >= vocab) {
      bad = min(bad, static_cast<unsigned long long>(t));
      continue;
    }
    int32_t* token_ids_out = ids + t * topk;
    for (int64_t k = 0; k < topk; ++k) token_ids_out[k] = tid2eid[token * topk + k];
    RoutingWeights(logits + t * experts, token_ids_out, topk, route_scale, weights + t * topk);
  }
  ReportBad(results, bad);
}

// counts[e] (at offsets[e + 1], zeroed by the launcher) = entries routed to e.
__global__ void CountPerExpertKernel(const int32_t* ids, int64_t entries, int64_t experts,
                                     int64_t* offsets, DeviceResults* results) {
  unsigned long long bad = kNoBad;
  for (int64_t i = FirstItem(); i < entries; i += ItemStride()) {
    const int64_t e = ids[i];
    if (e < 0 || e >= experts) {
      bad = min(bad, static_cast<unsigned long long>(i));
      continue;
    }
    atomicAdd(reinterpret_cast<unsigned long long*>(offsets + e + 1), 1ull);
  }
  ReportBad(results, bad);
}

// offsets[e] = sum of the counts of experts < e. One thread: a few hundred additions.
__global__ void CountsToOffsetsKernel(int64_t experts, int64_t* offsets) {
  for (int64_t e = 1; e <= experts; ++e) offsets[e] += offsets[e - 1];
}

// One block per expert: walks the entries in order, kThreads at a time, and writes its matches
// at offsets[e] + (matches before them): a stable compaction, so rows come in token order.
__global__ void FillExpertRowsKernel(const int32_t* ids, const float* weights, int64_t entries,
                                     int64_t topk, int64_t experts, const int64_t* offsets,
                                     int64_t* rows, float* row_weights) {
  constexpr int kWarps = kThreads / kWarpSize;
  __shared__ int warp_matches[kWarps];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  for (int64_t e = blockIdx.x; e < experts; e += gridDim.x) {
    int64_t next = offsets[e];  // where the chunk's first match goes
    // Uniform over the block: every thread reaches every __syncthreads.
    for (int64_t chunk = 0; chunk < entries; chunk += kThreads) {
      const int64_t i = chunk + threadIdx.x;
      const bool match = i < entries && ids[i] == e;
      const unsigned ballot = __ballot_sync(kFullWarp, match);
      if (lane == 0) warp_matches[warp] = __popc(ballot);
      __syncthreads();
      int64_t before = 0, total = 0;
      for (int w = 0; w < kWarps; ++w) {
        before += w < warp ? warp_matches[w] : 0;
        total += warp_matches[w];
      }
      if (match) {
        const int64_t at = next + before + __popc(ballot & ((1u << lane) - 1u));
        rows[at] = i / topk;
        row_weights[at] = weights[i];
      }
      next += total;
      __syncthreads();  // warp_matches is rewritten by the next chunk
    }
  }
}

// One item per output element.
__global__ void GatherRowsKernel(const float* x, int64_t d, const int64_t* rows, int64_t n,
                                 float* out) {
  for (int64_t item = FirstItem(); item < n * d; item += ItemStride()) {
    out[item] = x[rows[item / d] * d + item % d];
  }
}

__global__ void ScaleRowsKernel(const float* weights, int64_t rows, int64_t cols,
                                bool round_bf16, float* x) {
  for (int64_t item = FirstItem(); item < rows * cols; item += ItemStride()) {
    const float v = weights[item / cols] * x[item];
    x[item] = round_bf16 ? RoundToBf16(v) : v;
  }
}

__global__ void AddRowsKernel(const float* out, const int64_t* rows, int64_t n, int64_t d,
                              float* sum) {
  for (int64_t item = FirstItem(); item < n * d; item += ItemStride()) {
    sum[rows[item / d] * d + item % d] += out[item];
  }
}

__global__ void AddRoutedSumKernel(const float* sum, int64_t n, bool round_bf16, float* y) {
  for (int64_t i = FirstItem(); i < n; i += ItemStride()) {
    const float v = sum[i] + y[i];
    y[i] = round_bf16 ? RoundToBf16(v) : v;
  }
}

}  // namespace

cudaError_t LaunchRouteByScore(const float* logits, int64_t tokens, int64_t experts,
                               const float* bias, int64_t topk, float route_scale, int32_t* ids,
                               float* weights, DeviceResults* results, const Launch& launch) {
  if (topk < 1 || topk > experts) return cudaErrorInvalidValue;
  cudaError_t e = ResetResults(results, launch.stream);
  if (e != cudaSuccess || tokens <= 0) return e;
  RouteByScoreKernel<<<GridFor(tokens * kWarpSize, launch), kThreads, 0, launch.stream>>>(
      logits, tokens, experts, bias, topk, route_scale, ids, weights, results);
  return cudaGetLastError();
}

cudaError_t LaunchRouteByHash(const float* logits, int64_t tokens, int64_t experts,
                              const int32_t* token_ids, const int32_t* tid2eid, int64_t vocab,
                              int64_t topk, float route_scale, int32_t* ids, float* weights,
                              DeviceResults* results, const Launch& launch) {
  if (topk < 1 || topk > experts) return cudaErrorInvalidValue;
  cudaError_t e = ResetResults(results, launch.stream);
  if (e != cudaSuccess || tokens <= 0) return e;
  RouteByHashKernel<<<GridFor(tokens, launch), kThreads, 0, launch.stream>>>(
      logits, tokens, experts, token_ids, tid2eid, vocab, topk, route_scale, ids, weights,
      results);
  return cudaGetLastError();
}

cudaError_t LaunchGroupByExpert(const int32_t* ids, const float* weights, int64_t tokens,
                                int64_t topk, int64_t experts, int64_t* offsets, int64_t* rows,
                                float* row_weights, DeviceResults* results, const Launch& launch) {
  if (experts < 1 || topk < 1) return cudaErrorInvalidValue;
  cudaError_t e = ResetResults(results, launch.stream);
  if (e != cudaSuccess) return e;
  e = cudaMemsetAsync(offsets, 0, static_cast<size_t>(experts + 1) * sizeof(int64_t),
                      launch.stream);
  const int64_t entries = tokens * topk;
  if (e != cudaSuccess || entries <= 0) return e;
  CountPerExpertKernel<<<GridFor(entries, launch), kThreads, 0, launch.stream>>>(
      ids, entries, experts, offsets, results);
  CountsToOffsetsKernel<<<1, 1, 0, launch.stream>>>(experts, offsets);
  const int blocks = experts < launch.max_blocks ? static_cast<int>(experts) : launch.max_blocks;
  FillExpertRowsKernel<<<blocks, kThreads, 0, launch.stream>>>(ids, weights, entries, topk,
                                                               experts, offsets, rows,
                                                               row_weights);
  return cudaGetLastError();
}

cudaError_t LaunchGatherRows(const float* x, int64_t d, const int64_t* rows, int64_t n,
                             float* out, const Launch& launch) {
  if (n <= 0 || d <= 0) return cudaSuccess;
  GatherRowsKernel<<<GridFor(n * d, launch), kThreads, 0, launch.stream>>>(x, d, rows, n, out);
  return cudaGetLastError();
}

cudaError_t LaunchScaleRows(const float* weights, int64_t rows, int64_t cols, bool round_bf16,
                            float* x, const Launch& launch) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  ScaleRowsKernel<<<GridFor(rows * cols, launch), kThreads, 0, launch.stream>>>(
      weights, rows, cols, round_bf16, x);
  return cudaGetLastError();
}

cudaError_t LaunchAddRows(const float* out, const int64_t* rows, int64_t n, int64_t d, float* sum,
                          const Launch& launch) {
  if (n <= 0 || d <= 0) return cudaSuccess;
  AddRowsKernel<<<GridFor(n * d, launch), kThreads, 0, launch.stream>>>(out, rows, n, d, sum);
  return cudaGetLastError();
}

cudaError_t LaunchAddRoutedSum(const float* sum, int64_t n, bool round_bf16, float* y,
                               const Launch& launch) {
  if (n <= 0) return cudaSuccess;
  AddRoutedSumKernel<<<GridFor(n, launch), kThreads, 0, launch.stream>>>(sum, n, round_bf16, y);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
