// Kernel of v4_embedding_blocks.h.
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/v4_embedding_blocks.h"
#include "kernels/formats.h"

namespace quantd::kernels::cuda {
namespace {

// One item per output element (token, copy, column): consecutive threads write consecutive
// columns of one row.
__global__ void EmbeddingRowsKernel(const uint16_t* table, int64_t vocab, int64_t d,
                                    const int32_t* ids, int64_t tokens, int64_t stride,
                                    int64_t copies, float* out, DeviceResults* results) {
  unsigned long long bad = kNoBad;
  for (int64_t item = FirstItem(); item < tokens * copies * d; item += ItemStride()) {
    const int64_t i = item % d;
    const int64_t j = (item / d) % copies;
    const int64_t t = item / (d * copies);
    const int64_t id = ids[t];
    if (id < 0 || id >= vocab) {
      bad = min(bad, static_cast<unsigned long long>(t));
      continue;
    }
    out[t * stride + j * d + i] = formats::Bf16ToFloat(table[id * d + i]);
  }
  ReportBad(results, bad);
}

}  // namespace

cudaError_t LaunchEmbeddingRows(const uint16_t* table, int64_t vocab, int64_t d,
                                const int32_t* ids, int64_t tokens, int64_t stride,
                                int64_t copies, float* out, DeviceResults* results,
                                const Launch& launch) {
  if (stride < copies * d) return cudaErrorInvalidValue;
  cudaError_t e = ResetResults(results, launch.stream);
  const int64_t items = tokens * copies * d;
  if (e != cudaSuccess || items <= 0) return e;
  EmbeddingRowsKernel<<<GridFor(items, launch), kThreads, 0, launch.stream>>>(
      table, vocab, d, ids, tokens, stride, copies, out, results);
  return cudaGetLastError();
}

}  // namespace quantd::kernels::cuda
