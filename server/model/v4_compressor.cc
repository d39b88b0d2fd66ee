#include "server/model/v4_compressor.h"

#include "kernels/v4_row_math.h"
#include "server/base/status_macros.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

// Windows [begin, end) of PoolCompressorWindows.
void PoolWindows(const float* kv, const float* score, const float* ape, int64_t ratio,
                 int64_t width, int64_t begin, int64_t end, float* out) {
  for (int64_t w = begin; w < end; ++w) {
    for (int64_t c = 0; c < width; ++c) {
      out[w * width + c] = v4math::PoolWindowChannel(kv, score, ape, ratio, width, w, c);
    }
  }
}

}  // namespace

void PoolCompressorWindows(const float* kv, const float* score, const float* ape, int64_t seq_len,
                           int64_t ratio, int64_t width, float* out, const HostThreads& threads) {
  ParallelRows(threads, seq_len / ratio, 16 * ratio * width, [&](int, int64_t begin, int64_t end) {
    PoolWindows(kv, score, ape, ratio, width, begin, end, out);
  });
}

absl::StatusOr<OpArray<float>> RunCompressor(const ForwardContext& ctx,
                                             const V4CompressorWeights& w, int64_t ratio,
                                             int64_t width, float eps, const RopeTable& rope,
                                             const AttentionBatch& batch) {
  const ForwardOps& ops = OpsOf(ctx);
  const int64_t tokens = batch.sequences * batch.seq_len;
  const int64_t projected = w.wkv.out_features();  // coff * width
  ASSIGN_OR_RETURN(OpArray<float> kv,
                   AllocateArray<float>(ops, tokens * projected, w.wkv.module + " output"));
  ASSIGN_OR_RETURN(OpArray<float> score,
                   AllocateArray<float>(ops, tokens * projected, w.wgate.module + " output"));
  RETURN_IF_ERROR(
      ops.Linear(ctx, w.wkv, batch.x, tokens, kv.data(), LinearOutput::kFloat32, {}));
  RETURN_IF_ERROR(
      ops.Linear(ctx, w.wgate, batch.x, tokens, score.data(), LinearOutput::kFloat32, {}));

  const int64_t windows = batch.seq_len / ratio;
  const int64_t entries = batch.sequences * windows;
  ASSIGN_OR_RETURN(OpArray<float> out,
                   AllocateArray<float>(ops, entries * width, w.wkv.module + " entries"));
  if (entries == 0) return out;
  RETURN_IF_ERROR(ops.PoolCompressor(ctx, kv.data(), score.data(), w.ape, batch.sequences,
                                     batch.seq_len, ratio, width, out.data()));
  // official: kv.to(bf16) before the norm
  RETURN_IF_ERROR(ops.ToModelDtype(ctx, out.data(), entries * width));
  RETURN_IF_ERROR(ops.RmsNorm(ctx, out.data(), entries, width, w.norm, eps, out.data()));

  std::vector<int64_t> positions(static_cast<size_t>(entries));
  for (int64_t e = 0; e < entries; ++e) positions[e] = (e % windows) * ratio;
  RETURN_IF_ERROR(
      ops.Rope(ctx, rope, positions, /*inverse=*/false, out.data(), entries, /*heads=*/1, width));
  RETURN_IF_ERROR(ops.ToModelDtype(ctx, out.data(), entries * width));
  return out;
}

}  // namespace quantd::model
