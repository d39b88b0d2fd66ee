// Kernels of v4_attention_blocks.h. Each follows its CPU block's float operations in the CPU's
// order; where the CPU calls its GEMM (the attention's q . k and P . V) the device sums in its
// own order, and expf stands for the host's exp. The indexer's picks are a CUB segmented sort
// between two small kernels (its input, then the cut after k).
#include <math.h>

#include <cub/device/device_segmented_radix_sort.cuh>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_attention_blocks.h"
#include "kernels/cuda/v4_blocks.h"
#include "kernels/formats.h"

namespace quantd::kernels::cuda {
namespace {

using formats::RoundToBf16;

constexpr int kWarps = kThreads / 32;
// Query heads per attention block at most: the register accumulators of the dot products.
constexpr int kMaxHeadsPerBlock = 16;
// Shared memory an attention block aims at, so that two blocks fit on an SM (228 KiB on
// sm_90/sm_100, 1 KiB of it reserved per block); larger only when one head needs more.
constexpr int64_t kAttentionSharedTarget = 100 * 1024;
// List slots per online-softmax block of the official kernel (v4_attention_sparse.cc).
constexpr int64_t kSoftmaxBlock = 64;
// Largest Hadamard row: n floats of shared memory within the default 48 KiB.
constexpr int64_t kMaxHadamardN = 8192;
// Sort items (entries of whole query rows) of one pass of LaunchSelectTopEntries at most, unless
// one row alone is longer: 16 bytes each in the scratch (two buffers of keys and of ids), 64 MiB.
constexpr int64_t kTopEntriesPassItems = int64_t{1} << 22;
// Alignment of each array in the picks' scratch (cudaMalloc's).
constexpr size_t kScratchAlign = 256;

// The key list's geometry, the same for every query (v4_attention_sparse.cc).
struct AttentionShape {
  int64_t window_slots;     // min(seq_len, window)
  int64_t slots;            // window_slots + the compressed slots
  int64_t softmax_blocks;   // ceil(slots / kSoftmaxBlock)
  int64_t heads_per_block;  // query heads sharing one block's key loads
  int64_t groups;           // ceil(heads / heads_per_block)
  float scale;              // head_dim^-0.5
};

// The key list's geometry of `args` (heads_per_block and groups left to the plan).
AttentionShape ShapeOf(const SparseAttentionArgs& args) {
  AttentionShape sh{};
  sh.window_slots = args.seq_len < args.window ? args.seq_len : args.window;
  const int64_t compressed_slots =
      args.ratio == 0 ? 0 : (args.picks != nullptr ? args.picks_per_query : args.entries);
  sh.slots = sh.window_slots + compressed_slots;
  sh.softmax_blocks = (sh.slots + kSoftmaxBlock - 1) / kSoftmaxBlock;
  sh.scale = 1.0f / sqrtf(static_cast<float>(args.head_dim));  // the CPU's scale, IEEE sqrt
  return sh;
}

// Shared floats of one attention block: the key rows, then per head its q, its scores (then
// P weights), its divisor and, official, its block maxima, factors and sums.
int64_t AttentionSharedFloats(const AttentionShape& sh, int64_t head_dim, bool official,
                              int64_t heads_per_block) {
  const int64_t per_head = head_dim + sh.slots + 1 + (official ? 3 * sh.softmax_blocks : 0);
  return sh.slots + heads_per_block * per_head;
}

// std::max(a, b) as the CPU blocks call it: b only when a < b (a NaN `a` stays).
__device__ __forceinline__ float StdMax(float a, float b) { return a < b ? b : a; }

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v = StdMax(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

// One block per (token, group of heads), looping over them when the grid is smaller. Per item:
//   1. key_rows[slot]: the kv row (window slots) or compressed entry (later slots) the slot
//      reads, -1 for an unused slot; q of the group's heads into shared memory.
//   2. scores: one warp per slot, q . k over the lanes for every head of the group, times
//      scale; unused slots get -inf, which every later step turns into a zero weight with the
//      bits the CPU gets by skipping them (max unchanged, e^-inf = 0, sum + 0 = sum).
//   3. the CPU's SoftmaxWeights, per head (math) or per head and softmax block (official).
//   4. P . V: one thread per output column, accumulating the group's heads over the slots.
template <bool kOfficial>
__global__ void __launch_bounds__(kThreads)
    SparseAttentionKernel(SparseAttentionArgs a, AttentionShape sh, float* o) {
  extern __shared__ float shared[];
  const int64_t slots = sh.slots;
  const int64_t dim = a.head_dim;
  const int64_t nb = sh.softmax_blocks;
  const int64_t group_heads = sh.heads_per_block;
  int32_t* key_rows = reinterpret_cast<int32_t*>(shared);
  float* q_s = shared + slots;                   // [group_heads, dim]
  float* w_s = q_s + group_heads * dim;          // [group_heads, slots]
  float* divisor = w_s + group_heads * slots;    // [group_heads]
  float* block_max = divisor + group_heads;      // [group_heads, nb] (official)
  float* block_factor = block_max + group_heads * nb;
  float* block_sum = block_factor + group_heads * nb;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const float neg_inf = -INFINITY;

  for (int64_t item = blockIdx.x; item < a.seq_len * sh.groups; item += gridDim.x) {
    const int64_t t = item / sh.groups;
    const int64_t h0 = (item % sh.groups) * group_heads;
    const int hc = static_cast<int>(min(group_heads, a.heads - h0));
    const int64_t first = max(int64_t{0}, t - a.window + 1);
    const int64_t n_window = t - first + 1;
    const int64_t visible = a.ratio == 0 ? 0 : min(a.entries, (t + 1) / a.ratio);
    __syncthreads();  // the previous item's readers of shared memory are done

    for (int64_t s = threadIdx.x; s < slots; s += blockDim.x) {
      int64_t row = -1;
      if (s < sh.window_slots) {
        if (s < n_window) row = first + s;
      } else if (a.picks != nullptr) {
        const int32_t pick = a.picks[t * a.picks_per_query + (s - sh.window_slots)];
        if (pick >= 0 && pick < a.entries) row = pick;
      } else if (s - sh.window_slots < visible) {
        row = s - sh.window_slots;
      }
      key_rows[s] = static_cast<int32_t>(row);
    }
    const float* q = a.q + (t * a.heads + h0) * dim;
    for (int64_t i = threadIdx.x; i < hc * dim; i += blockDim.x) q_s[i] = q[i];
    __syncthreads();

    for (int64_t s = warp; s < slots; s += kWarps) {
      const int32_t row = key_rows[s];
      if (row < 0) {
        if (lane < hc) w_s[lane * slots + s] = neg_inf;
        continue;
      }
      const float* key = (s < sh.window_slots ? a.kv : a.compressed) + row * dim;
      float part[kMaxHeadsPerBlock];
#pragma unroll
      for (int h = 0; h < kMaxHeadsPerBlock; ++h) part[h] = 0.0f;
      for (int64_t d = lane; d < dim; d += 32) {
        const float k = key[d];
#pragma unroll
        for (int h = 0; h < kMaxHeadsPerBlock; ++h) {
          if (h < hc) part[h] += q_s[h * dim + d] * k;
        }
      }
#pragma unroll
      for (int h = 0; h < kMaxHeadsPerBlock; ++h) {
        if (h < hc) {
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) {
            part[h] += __shfl_xor_sync(0xFFFFFFFFu, part[h], offset);
          }
        }
      }
      if (lane == 0) {
#pragma unroll
        for (int h = 0; h < kMaxHeadsPerBlock; ++h) {
          if (h < hc) w_s[h * slots + s] = part[h] * sh.scale;
        }
      }
    }
    __syncthreads();

    if constexpr (!kOfficial) {
      // max over the sink and the keys; e = exp(s - max); sum in slot order plus the sink's
      // term (lane 0, the CPU's order); p = e / sum.
      for (int h = warp; h < hc; h += kWarps) {
        float* w = w_s + h * slots;
        const float sink = a.sink[h0 + h];
        float m = sink;
        for (int64_t s = lane; s < slots; s += 32) m = StdMax(m, w[s]);
        m = WarpMax(m);
        for (int64_t s = lane; s < slots; s += 32) w[s] = expf(w[s] - m);
        __syncwarp();
        if (lane == 0) {
          float sum = 0.0f;
          for (int64_t s = 0; s < slots; ++s) sum += w[s];
          divisor[h] = sum + expf(sink - m);
        }
        __syncwarp();
        const float sum = divisor[h];
        for (int64_t s = lane; s < slots; s += 32) w[s] = w[s] / sum;
      }
    } else {
      // Block maxima over the real keys; then per head the running maxima m_b and the product
      // of the later blocks' rescales; then per block e = exp(s - m_b), its sum in slot order
      // and the weight bf16(e) * factor; then per head the chained sum and the sink's term.
      for (int64_t i = threadIdx.x; i < hc * nb; i += blockDim.x) {
        const float* w = w_s + (i / nb) * slots;
        const int64_t s1 = min(slots, (i % nb + 1) * kSoftmaxBlock);
        float m = neg_inf;
        for (int64_t s = (i % nb) * kSoftmaxBlock; s < s1; ++s) m = StdMax(m, w[s]);
        block_max[i] = m;
      }
      __syncthreads();
      for (int h = threadIdx.x; h < hc; h += blockDim.x) {
        float* bm = block_max + h * nb;
        float* f = block_factor + h * nb;
        for (int64_t b = 1; b < nb; ++b) bm[b] = StdMax(bm[b], bm[b - 1]);
        f[nb - 1] = 1.0f;
        for (int64_t b = nb - 2; b >= 0; --b) f[b] = f[b + 1] * expf(bm[b] - bm[b + 1]);
      }
      __syncthreads();
      for (int64_t i = threadIdx.x; i < hc * nb; i += blockDim.x) {
        float* w = w_s + (i / nb) * slots;
        const float m = block_max[i];
        const float factor = block_factor[i];
        const int64_t s1 = min(slots, (i % nb + 1) * kSoftmaxBlock);
        float sum = 0.0f;
        for (int64_t s = (i % nb) * kSoftmaxBlock; s < s1; ++s) {
          const float e = expf(w[s] - m);
          sum += e;
          w[s] = RoundToBf16(e) * factor;
        }
        block_sum[i] = sum;
      }
      __syncthreads();
      for (int h = threadIdx.x; h < hc; h += blockDim.x) {
        const float* bm = block_max + h * nb;
        const float* bs = block_sum + h * nb;
        float sum = 0.0f;
        float prev = neg_inf;
        for (int64_t b = 0; b < nb; ++b) {
          sum = sum * expf(prev - bm[b]) + bs[b];
          prev = bm[b];
        }
        divisor[h] = sum + expf(a.sink[h0 + h] - prev);
      }
    }
    __syncthreads();

    float* out = o + (t * a.heads + h0) * dim;
    for (int64_t d0 = 0; d0 < dim; d0 += blockDim.x) {
      const int64_t d = d0 + threadIdx.x;
      if (d >= dim) continue;
      float acc[kMaxHeadsPerBlock];
#pragma unroll
      for (int h = 0; h < kMaxHeadsPerBlock; ++h) acc[h] = 0.0f;
      for (int64_t s = 0; s < slots; ++s) {
        const int32_t row = key_rows[s];
        if (row < 0) continue;
        const float k = (s < sh.window_slots ? a.kv : a.compressed)[row * dim + d];
#pragma unroll
        for (int h = 0; h < kMaxHeadsPerBlock; ++h) {
          if (h < hc) acc[h] += w_s[h * slots + s] * k;
        }
      }
#pragma unroll
      for (int h = 0; h < kMaxHeadsPerBlock; ++h) {
        if (h < hc) out[h * dim + d] = kOfficial ? RoundToBf16(acc[h] / divisor[h]) : acc[h];
      }
    }
  }
}

// One block per row (looping when the grid is smaller): the row in shared memory, the CPU's
// butterflies stage by stage (half = 1, 2, 4, ...), then the scale.
__global__ void HadamardRowsKernel(float* x, int64_t rows, int64_t n, float scale,
                                   bool round_bf16) {
  extern __shared__ float v[];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + r * n;
    __syncthreads();  // the previous row's writers are done with v
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v[i] = row[i];
    __syncthreads();
    for (int64_t half = 1; half < n; half *= 2) {
      for (int64_t p = threadIdx.x; p < n / 2; p += blockDim.x) {
        const int64_t j = (p / half) * 2 * half + p % half;
        const float a = v[j];
        const float b = v[j + half];
        v[j] = a + b;
        v[j + half] = a - b;
      }
      __syncthreads();
    }
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float y = v[i] * scale;
      row[i] = round_bf16 ? RoundToBf16(y) : y;
    }
  }
}

// One item per (query, entry).
__global__ void IndexerScoresKernel(bool official, const float* dots, const float* weights,
                                    int64_t queries, int64_t heads, float dot_scale,
                                    int64_t entries, int64_t first_position, int64_t ratio,
                                    float* scores) {
  for (int64_t item = FirstItem(); item < queries * entries; item += ItemStride()) {
    const int64_t i = item / entries;
    const int64_t s = item % entries;
    if (s >= min(entries, (first_position + i + 1) / ratio)) continue;
    const float* w_t = weights + i * heads;
    float sum = 0.0f;
    for (int64_t h = 0; h < heads; ++h) {
      const float dot = dots[(i * heads + h) * entries + s];
      sum += official ? RoundToBf16(StdMax(RoundToBf16(dot), 0.0f) * w_t[h])
                      : StdMax(dot, 0.0f) * dot_scale * w_t[h];
    }
    scores[item] = official ? RoundToBf16(sum) : sum;
  }
}

// The sort's input for `rows` queries from first_position on: each row's visible entries as
// (key, id) pairs at their own places, the key the score with NaN as -inf (the total order of
// LaunchSelectTopEntries), and each row's segment [begin, end) over its visible entries.
__global__ void TopEntriesSortInputKernel(const float* scores, int64_t first_position,
                                          int64_t rows, int64_t entries, int64_t ratio,
                                          float* keys, int32_t* ids, int32_t* begin,
                                          int32_t* end) {
  for (int64_t item = FirstItem(); item < rows * entries; item += ItemStride()) {
    const int64_t i = item / entries;
    const int64_t s = item % entries;
    const int64_t visible = min(entries, (first_position + i + 1) / ratio);
    if (s == 0) {
      begin[i] = static_cast<int32_t>(item);
      end[i] = static_cast<int32_t>(item + visible);
    }
    if (s < visible) {
      const float x = scores[item];
      keys[item] = isnan(x) ? -INFINITY : x;
      ids[item] = static_cast<int32_t>(s);
    }
  }
}

// picks [rows, k] from each row's sorted ids: the first k of its visible entries, -1 beyond.
__global__ void TopEntriesPicksKernel(const int32_t* sorted_ids, int64_t first_position,
                                      int64_t rows, int64_t entries, int64_t ratio, int64_t k,
                                      int32_t* picks) {
  for (int64_t item = FirstItem(); item < rows * k; item += ItemStride()) {
    const int64_t i = item / k;
    const int64_t j = item % k;
    const int64_t visible = min(entries, (first_position + i + 1) / ratio);
    picks[item] = j < visible ? sorted_ids[i * entries + j] : -1;
  }
}

// The stable descending sort of the segments [begin[r], end[r]) of `keys` and `ids`, r < rows
// (the sorted pairs end in keys.Current() and ids.Current()); with temp == nullptr, only the
// size of CUB's temporary storage into temp_bytes. The same instantiation for both.
cudaError_t SortRowsDescending(void* temp, size_t& temp_bytes, cub::DoubleBuffer<float>& keys,
                               cub::DoubleBuffer<int32_t>& ids, int64_t items, int64_t rows,
                               const int32_t* begin, const int32_t* end, cudaStream_t stream) {
  return cub::DeviceSegmentedRadixSort::SortPairsDescending(
      temp, temp_bytes, keys, ids, static_cast<int>(items), static_cast<int>(rows), begin, end,
      /*begin_bit=*/0, /*end_bit=*/static_cast<int>(8 * sizeof(float)), stream);
}

size_t AlignScratch(size_t bytes) {
  return (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
}

// Where LaunchSelectTopEntries keeps its arrays in the scratch: byte offsets of arrays sized for
// one pass of `rows` rows.
struct TopEntriesLayout {
  int64_t rows = 0;       // queries per pass
  size_t keys[2] = {};    // float [rows * entries] each: the sort's key double buffer
  size_t ids[2] = {};     // int32 [rows * entries] each: the entry ids sorted with the keys
  size_t begin = 0;       // int32 [rows]: each row's first sort item
  size_t end = 0;         // int32 [rows]: one past each row's last visible entry
  size_t temp = 0;        // CUB's temporary storage
  size_t temp_bytes = 0;  // its size
  size_t total = 0;       // bytes of the whole scratch
};

// The layout for `queries` rows of `entries` (both >= 1, entries <= INT32_MAX), CUB asked for
// its temporary storage on the current device.
cudaError_t PlanTopEntries(int64_t queries, int64_t entries, TopEntriesLayout* layout) {
  const int64_t per_pass = kTopEntriesPassItems / entries;
  layout->rows = per_pass < 1 ? 1 : (per_pass < queries ? per_pass : queries);
  const int64_t items = layout->rows * entries;  // <= max(2^22, entries) <= INT32_MAX
  size_t at = 0;
  const auto place = [&at](size_t bytes) {
    const size_t offset = at;
    at += AlignScratch(bytes);
    return offset;
  };
  for (int b = 0; b < 2; ++b) layout->keys[b] = place(items * sizeof(float));
  for (int b = 0; b < 2; ++b) layout->ids[b] = place(items * sizeof(int32_t));
  layout->begin = place(layout->rows * sizeof(int32_t));
  layout->end = place(layout->rows * sizeof(int32_t));
  cub::DoubleBuffer<float> keys(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> ids(nullptr, nullptr);
  const cudaError_t e = SortRowsDescending(nullptr, layout->temp_bytes, keys, ids, items,
                                           layout->rows, nullptr, nullptr, nullptr);
  if (e != cudaSuccess) return e;
  layout->temp = place(layout->temp_bytes);
  layout->total = at;
  return cudaSuccess;
}

// The device's per-block shared memory limit with opt-in.
cudaError_t SharedLimit(int64_t* bytes) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  int limit = 0;
  e = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  *bytes = limit;
  return e;
}

template <bool kOfficial>
cudaError_t LaunchSparseAttentionKernel(const SparseAttentionArgs& args, const AttentionShape& sh,
                                        int64_t shared_bytes, float* o, const Launch& launch) {
  cudaError_t e = cudaFuncSetAttribute(SparseAttentionKernel<kOfficial>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(shared_bytes));
  if (e != cudaSuccess) return e;
  const int64_t items = args.seq_len * sh.groups;
  const int blocks = static_cast<int>(items < launch.max_blocks ? items : launch.max_blocks);
  SparseAttentionKernel<kOfficial><<<blocks, kThreads, static_cast<size_t>(shared_bytes),
                                     launch.stream>>>(args, sh, o);
  return cudaGetLastError();
}

}  // namespace

SparseAttentionPlan PlanSparseAttention(const SparseAttentionArgs& args, bool official,
                                        int64_t shared_limit) {
  const AttentionShape sh = ShapeOf(args);
  const int64_t max_heads = args.heads < kMaxHeadsPerBlock ? args.heads : kMaxHeadsPerBlock;
  const auto heads_fitting = [&](int64_t bytes) {
    int64_t fit = 0;
    while (fit < max_heads &&
           4 * AttentionSharedFloats(sh, args.head_dim, official, fit + 1) <= bytes) {
      ++fit;
    }
    return fit;
  };
  int64_t fit = heads_fitting(kAttentionSharedTarget < shared_limit ? kAttentionSharedTarget
                                                                    : shared_limit);
  if (fit == 0) fit = heads_fitting(shared_limit);
  if (fit == 0) return {};
  // Balanced groups: ceil(heads / fit) groups of (nearly) equal size, none larger than fit.
  SparseAttentionPlan plan;
  plan.groups = (args.heads + fit - 1) / fit;
  plan.heads_per_block = (args.heads + plan.groups - 1) / plan.groups;
  plan.shared_bytes = 4 * AttentionSharedFloats(sh, args.head_dim, official, plan.heads_per_block);
  return plan;
}

cudaError_t LaunchSparseAttention(const SparseAttentionArgs& args, bool official, float* o,
                                  const Launch& launch) {
  if (args.head_dim <= 0 || args.window < 1 || args.ratio < 0 || args.entries < 0 ||
      args.seq_len < 0 || args.heads < 0 || args.seq_len > INT32_MAX ||
      args.entries > INT32_MAX || (args.picks != nullptr && args.picks_per_query < 0)) {
    return cudaErrorInvalidValue;
  }
  if (args.seq_len == 0 || args.heads == 0) return cudaSuccess;
  int64_t limit = 0;
  cudaError_t e = SharedLimit(&limit);
  if (e != cudaSuccess) return e;
  const SparseAttentionPlan plan = PlanSparseAttention(args, official, limit);
  if (plan.heads_per_block == 0) return cudaErrorInvalidValue;
  AttentionShape sh = ShapeOf(args);
  sh.heads_per_block = plan.heads_per_block;
  sh.groups = plan.groups;
  return official ? LaunchSparseAttentionKernel<true>(args, sh, plan.shared_bytes, o, launch)
                  : LaunchSparseAttentionKernel<false>(args, sh, plan.shared_bytes, o, launch);
}

cudaError_t LaunchHadamardRows(float* x, int64_t rows, int64_t n, bool round_bf16,
                               const Launch& launch) {
  if (n < 1 || n > kMaxHadamardN || (n & (n - 1)) != 0 || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const float scale = 1.0f / sqrtf(static_cast<float>(n));  // the CPU's scale, IEEE sqrt
  const int threads = n / 2 < 32 ? 32 : (n / 2 > kThreads ? kThreads : static_cast<int>(n / 2));
  const int blocks = static_cast<int>(rows < launch.max_blocks ? rows : launch.max_blocks);
  HadamardRowsKernel<<<blocks, threads, static_cast<size_t>(n) * sizeof(float), launch.stream>>>(
      x, rows, n, scale, round_bf16);
  return cudaGetLastError();
}

cudaError_t LaunchSimulateIndexerFp4(float* x, int64_t rows, int64_t n, DeviceResults* results,
                                     const Launch& launch) {
  if (n % 32 != 0) return cudaErrorInvalidValue;  // whole FP4 blocks
  cudaError_t e = LaunchHadamardRows(x, rows, n, /*round_bf16=*/true, launch);
  if (e != cudaSuccess) return e;
  return LaunchSimulateFp4Act(x, rows, n, n, results, launch);
}

cudaError_t LaunchIndexerScores(bool official, const float* dots, const float* weights,
                                int64_t queries, int64_t heads, int64_t dim, int64_t entries,
                                int64_t first_position, int64_t ratio, float* scores,
                                const Launch& launch) {
  if (ratio < 1 || dim < 1 || heads < 0 || first_position < 0) return cudaErrorInvalidValue;
  const int64_t items = queries * entries;
  if (queries <= 0 || entries <= 0) return cudaSuccess;
  const float dot_scale = 1.0f / sqrtf(static_cast<float>(dim));  // the CPU's, IEEE sqrt
  IndexerScoresKernel<<<GridFor(items, launch), kThreads, 0, launch.stream>>>(
      official, dots, weights, queries, heads, dot_scale, entries, first_position, ratio,
      scores);
  return cudaGetLastError();
}

int64_t TopEntriesScratchBytes(int64_t queries, int64_t entries) {
  if (queries <= 0 || entries <= 0) return 0;
  if (entries > INT32_MAX) return -1;
  TopEntriesLayout layout;
  if (PlanTopEntries(queries, entries, &layout) != cudaSuccess) return -1;
  return static_cast<int64_t>(layout.total);
}

cudaError_t LaunchSelectTopEntries(const float* scores, int64_t first_position, int64_t queries,
                                   int64_t entries, int64_t ratio, int64_t k, void* scratch,
                                   int32_t* picks, const Launch& launch) {
  if (ratio < 1 || k < 0 || k > entries || first_position < 0 || entries > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (queries <= 0 || k == 0) return cudaSuccess;
  TopEntriesLayout layout;
  cudaError_t e = PlanTopEntries(queries, entries, &layout);
  if (e != cudaSuccess) return e;
  char* base = static_cast<char*>(scratch);
  int32_t* begin = reinterpret_cast<int32_t*>(base + layout.begin);
  int32_t* end = reinterpret_cast<int32_t*>(base + layout.end);
  for (int64_t r0 = 0; r0 < queries; r0 += layout.rows) {
    const int64_t rows = layout.rows < queries - r0 ? layout.rows : queries - r0;
    cub::DoubleBuffer<float> keys(reinterpret_cast<float*>(base + layout.keys[0]),
                                  reinterpret_cast<float*>(base + layout.keys[1]));
    cub::DoubleBuffer<int32_t> ids(reinterpret_cast<int32_t*>(base + layout.ids[0]),
                                   reinterpret_cast<int32_t*>(base + layout.ids[1]));
    TopEntriesSortInputKernel<<<GridFor(rows * entries, launch), kThreads, 0, launch.stream>>>(
        scores + r0 * entries, first_position + r0, rows, entries, ratio, keys.Current(),
        ids.Current(), begin, end);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    size_t temp_bytes = layout.temp_bytes;
    e = SortRowsDescending(base + layout.temp, temp_bytes, keys, ids, rows * entries, rows, begin,
                           end, launch.stream);
    if (e != cudaSuccess) return e;
    TopEntriesPicksKernel<<<GridFor(rows * k, launch), kThreads, 0, launch.stream>>>(
        ids.Current(), first_position + r0, rows, entries, ratio, k, picks + r0 * k);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace quantd::kernels::cuda
