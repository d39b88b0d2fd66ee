#include "server/model/v4_attention_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/v4_attention_blocks.h"
#include "kernels/cuda/v4_blocks.h"
#include "kernels/cuda/v4_compressor_blocks.h"
#include "kernels/cuda/v4_head_norm_blocks.h"
#include "kernels/cuda/v4_moe_blocks.h"
#include "server/base/status_macros.h"
#include "server/model/v4_act_quant.h"
#include "server/model/v4_attention.h"
#include "server/model/v4_indexer.h"
#include "server/model/v4_linear_cuda.h"
#include "server/model/v4_rope.h"

namespace quantd::model {
namespace {

namespace cuda = kernels::cuda;

// Score rows of the indexer's dot products held at once: [queries * heads, entries] floats.
constexpr int64_t kIndexerDotValues = int64_t{1} << 26;  // 256 MiB

// A layer's RoPE table (RopeTable) in device memory.
struct DeviceRope {
  int64_t pairs = 0;
  DeviceArray<float> cos, sin;  // [positions, pairs]
};

absl::StatusOr<DeviceRope> UploadRope(const DeviceForwardContext& ctx, const RopeTable& table) {
  const int64_t n = table.num_positions() * table.pairs();
  std::vector<float> cos(static_cast<size_t>(n)), sin(cos.size());
  for (int64_t p = 0; p < table.num_positions(); ++p) {
    for (int64_t i = 0; i < table.pairs(); ++i) {
      cos[p * table.pairs() + i] = table.cos(p, i);
      sin[p * table.pairs() + i] = table.sin(p, i);
    }
  }
  DeviceRope d;
  d.pairs = table.pairs();
  ASSIGN_OR_RETURN(d.cos, UploadArray(ctx, cos, "RoPE cos"));
  ASSIGN_OR_RETURN(d.sin, UploadArray(ctx, sin, "RoPE sin"));
  return d;
}

absl::Status Rope(const DeviceForwardContext& ctx, const DeviceRope& rope,
                  const DeviceArray<int64_t>& positions, bool inverse, float* x, int64_t rows,
                  int64_t heads, int64_t head_dim, const std::string& what) {
  return LaunchStatus(
      cuda::LaunchRope(rope.cos.data(), rope.sin.data(), rope.pairs, positions.data(), inverse, x,
                       rows, heads, head_dim, ctx.launch),
      what + " RoPE");
}

absl::Status RmsNormOnDevice(const DeviceForwardContext& ctx, float* x, int64_t rows, int64_t n,
                             const DeviceArray<float>& weight, float eps, const std::string& what) {
  return LaunchStatus(
      cuda::LaunchRmsNorm(x, rows, n, weight.data(), eps, ctx.official(), x, ctx.launch),
      what + " RMSNorm");
}

// Shows the observer a host copy of the KV cache entries kv [rows, cols].
absl::Status ObserveKv(const DeviceForwardContext& ctx, const std::string& module, const float* kv,
                       int64_t rows, int64_t cols) {
  if (ctx.observer == nullptr || rows == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<float> host, DownloadArray(kv, rows * cols, module));
  KvCacheInput input;
  input.module = &module;
  input.kv = host.data();
  input.rows = rows;
  input.cols = cols;
  ctx.observer->OnKvCache(input);
  return absl::OkStatus();
}

// The official KV simulation (SimulateKvFp8 in v4_attention.cc): FP8 per 64 nope columns of rows
// of width `dim`, the last `rope_dim` left as they are.
absl::Status SimulateKvFp8(const DeviceForwardContext& ctx, const std::string& module, float* kv,
                           int64_t rows, int64_t dim, int64_t rope_dim) {
  const int64_t nope = dim - rope_dim;
  RETURN_IF_ERROR(LaunchStatus(
      cuda::LaunchSimulateFp8Act(kv, rows, nope, dim, kKvQuantBlock, ctx.results(), ctx.launch),
      module + " FP8 simulation"));
  ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(ctx, module));
  if (bad == cuda::kNoBad) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(module,
                                                 ": activation quantization: non-finite value at [",
                                                 bad / nope, ", ", bad % nope, "]"));
}

// Positions 0, step, 2 * step, ... of `rows` rows, restarting every `period` rows.
absl::StatusOr<DeviceArray<int64_t>> Positions(const DeviceForwardContext& ctx, int64_t rows,
                                               int64_t period, int64_t step) {
  std::vector<int64_t> p(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) p[r] = (r % period) * step;
  return UploadArray(ctx, p, "positions");
}

// RunCompressor (v4_compressor.h): entries [sequences * (seq_len / ratio), width].
absl::StatusOr<DeviceArray<float>> CompressorOnDevice(const DeviceForwardContext& ctx,
                                                      const DeviceCompressor& w, int64_t ratio,
                                                      int64_t width, float eps,
                                                      const DeviceRope& rope, const float* x,
                                                      int64_t sequences, int64_t seq_len) {
  const int64_t tokens = sequences * seq_len;
  const int64_t projected = w.wkv.out_features();
  ASSIGN_OR_RETURN(DeviceArray<float> kv, AllocateArray<float>(ctx, tokens * projected));
  ASSIGN_OR_RETURN(DeviceArray<float> score, AllocateArray<float>(ctx, tokens * projected));
  RETURN_IF_ERROR(ApplyLinearOnDevice(ctx, w.wkv, x, tokens, kv.data(), LinearOutput::kFloat32));
  RETURN_IF_ERROR(
      ApplyLinearOnDevice(ctx, w.wgate, x, tokens, score.data(), LinearOutput::kFloat32));
  const int64_t windows = seq_len / ratio, entries = sequences * windows;
  ASSIGN_OR_RETURN(DeviceArray<float> out, AllocateArray<float>(ctx, entries * width));
  if (entries == 0) return out;
  RETURN_IF_ERROR(LaunchStatus(
      cuda::LaunchPoolCompressorWindows(kv.data(), score.data(), w.ape.data(), sequences, seq_len,
                                        ratio, width, out.data(), ctx.launch),
      w.wkv.module + " pooling"));
  RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, out.data(), entries * width));
  RETURN_IF_ERROR(RmsNormOnDevice(ctx, out.data(), entries, width, w.norm, eps, w.wkv.module));
  ASSIGN_OR_RETURN(DeviceArray<int64_t> positions, Positions(ctx, entries, windows, ratio));
  RETURN_IF_ERROR(Rope(ctx, rope, positions, false, out.data(), entries, 1, width, w.wkv.module));
  RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, out.data(), entries * width));
  return out;
}

// The official indexer simulation (SimulateIndexerFp4) of rows [rows, n] in place.
absl::Status IndexerFp4(const DeviceForwardContext& ctx, float* x, int64_t rows, int64_t n,
                        const std::string& what) {
  RETURN_IF_ERROR(
      LaunchStatus(cuda::LaunchSimulateIndexerFp4(x, rows, n, ctx.results(), ctx.launch),
                   what + " FP4 simulation"));
  ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(ctx, what));
  if (bad == cuda::kNoBad) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": activation quantization: non-finite value at [", bad / n, ", ", bad % n, "]"));
}

// RunIndexer (v4_indexer.h): picks [tokens, k] (k = min(index_topk, seq_len / ratio); nothing
// allocated when k is 0), -1 for none.
struct DevicePicks {
  int64_t k = 0;
  DeviceArray<int32_t> entries;
};
absl::StatusOr<DevicePicks> IndexerOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                                            const DeviceIndexer& w, int64_t ratio,
                                            const DeviceRope& rope,
                                            const DeviceArray<int64_t>& positions, const float* x,
                                            int64_t sequences, int64_t seq_len, const float* qr) {
  const int64_t tokens = sequences * seq_len;
  const int64_t heads = config.index_n_heads, dim = config.index_head_dim;
  ASSIGN_OR_RETURN(DeviceArray<float> q, AllocateArray<float>(ctx, tokens * heads * dim));
  RETURN_IF_ERROR(ApplyLinearOnDevice(ctx, w.wq_b, qr, tokens, q.data()));
  RETURN_IF_ERROR(Rope(ctx, rope, positions, false, q.data(), tokens, heads, dim, w.wq_b.module));
  RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, q.data(), tokens * heads * dim));
  ASSIGN_OR_RETURN(DeviceArray<float> keys,
                   CompressorOnDevice(ctx, w.compressor, ratio, dim, config.rms_norm_eps, rope, x,
                                      sequences, seq_len));
  const int64_t entries = seq_len / ratio;
  if (ctx.official()) {
    RETURN_IF_ERROR(IndexerFp4(ctx, q.data(), tokens * heads, dim, w.wq_b.module + " output"));
    if (sequences * entries > 0) {
      RETURN_IF_ERROR(IndexerFp4(ctx, keys.data(), sequences * entries, dim,
                                 w.compressor.wkv.module + " entries"));
    }
  }
  ASSIGN_OR_RETURN(DeviceArray<float> weights, AllocateArray<float>(ctx, tokens * heads));
  RETURN_IF_ERROR(ApplyLinearOnDevice(ctx, w.weights_proj, x, tokens, weights.data()));
  // RunIndexer's head weights: official bf16(w * (dim^-0.5 * heads^-0.5)), math w * heads^-0.5,
  // as ScaleRows over one row (the same product, then the same rounding).
  const float scale = ctx.official()
                          ? static_cast<float>(std::pow(static_cast<double>(dim), -0.5) *
                                               std::pow(static_cast<double>(heads), -0.5))
                          : 1.0f / std::sqrt(static_cast<float>(heads));
  ASSIGN_OR_RETURN(DeviceArray<float> scale_d,
                   UploadArray(ctx, std::vector<float>{scale}, "indexer head scale"));
  RETURN_IF_ERROR(LaunchStatus(cuda::LaunchScaleRows(scale_d.data(), 1, tokens * heads,
                                                     ctx.official(), weights.data(), ctx.launch),
                               w.weights_proj.module + " scale"));

  DevicePicks picks;
  picks.k = std::min(config.index_topk, entries);
  if (picks.k == 0) return picks;
  ASSIGN_OR_RETURN(picks.entries, AllocateArray<int32_t>(ctx, tokens * picks.k));
  const int64_t chunk = std::clamp<int64_t>(kIndexerDotValues / (heads * entries), 1, seq_len);
  ASSIGN_OR_RETURN(DeviceArray<float> dots, AllocateArray<float>(ctx, chunk * heads * entries));
  ASSIGN_OR_RETURN(DeviceArray<float> scores, AllocateArray<float>(ctx, chunk * entries));
  const int64_t scratch_bytes = cuda::TopEntriesScratchBytes(chunk, entries);
  if (scratch_bytes < 0) {
    return absl::InternalError(absl::StrCat(w.wq_b.module, " top-k: CUB gives no scratch size for ",
                                            chunk, " queries of ", entries, " entries"));
  }
  ASSIGN_OR_RETURN(DeviceArray<uint8_t> scratch, AllocateArray<uint8_t>(ctx, scratch_bytes));
  for (int64_t b = 0; b < sequences; ++b) {
    const float* seq_keys = keys.data() + b * entries * dim;
    for (int64_t t0 = 0; t0 < seq_len; t0 += chunk) {
      const int64_t queries = std::min(chunk, seq_len - t0);
      const float* seq_q = q.data() + (b * seq_len + t0) * heads * dim;
      RETURN_IF_ERROR(ctx.gemm->Sgemm(
          IndexerDotsProduct(seq_q, seq_keys, queries * heads, entries, dim, dots.data())));
      RETURN_IF_ERROR(LaunchStatus(
          cuda::LaunchIndexerScores(ctx.official(), dots.data(),
                                    weights.data() + (b * seq_len + t0) * heads, queries, heads,
                                    dim, entries, t0, ratio, scores.data(), ctx.launch),
          w.wq_b.module + " scores"));
      RETURN_IF_ERROR(
          LaunchStatus(cuda::LaunchSelectTopEntries(
                           scores.data(), t0, queries, entries, ratio, picks.k, scratch.data(),
                           picks.entries.data() + (b * seq_len + t0) * picks.k, ctx.launch),
                       w.wq_b.module + " top-k"));
    }
  }
  return picks;
}

// GroupedOutputA (v4_attention.cc): per group g, u[:, g] = o[:, g] · wo_a[g]^T, then the model
// dtype. The group's columns are copied out (and its product back) with strided copies.
absl::Status GroupedOutputAOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                                    const DeviceLinear& wo_a, const float* o, int64_t tokens,
                                    float* u) {
  const int64_t groups = config.o_groups, rank = config.o_lora_rank;
  const int64_t width = wo_a.in_features();
  RETURN_IF_ERROR(ObserveLinearInput(ctx, wo_a.module, o, tokens, groups * width, {}));
  ASSIGN_OR_RETURN(DeviceArray<float> slice, AllocateArray<float>(ctx, tokens * width));
  ASSIGN_OR_RETURN(DeviceArray<float> part, AllocateArray<float>(ctx, tokens * rank));
  const size_t weight_bytes = wo_a.view.type == kernels::FloatType::kBF16 ? 2 : 4;
  for (int64_t g = 0; g < groups; ++g) {
    RETURN_IF_ERROR(
        LaunchStatus(cudaMemcpy2DAsync(slice.data(), width * sizeof(float), o + g * width,
                                       groups * width * sizeof(float), width * sizeof(float),
                                       tokens, cudaMemcpyDeviceToDevice, ctx.launch.stream),
                     wo_a.module + " group input"));
    kernels::DenseTensor w = wo_a.view;
    w.data = static_cast<const char*>(wo_a.view.data) + g * rank * width * weight_bytes;
    w.rows = rank;
    RETURN_IF_ERROR(DeviceMatMulNT(ctx, slice.data(), tokens, w, part.data(), wo_a.module));
    RETURN_IF_ERROR(
        LaunchStatus(cudaMemcpy2DAsync(u + g * rank, groups * rank * sizeof(float), part.data(),
                                       rank * sizeof(float), rank * sizeof(float), tokens,
                                       cudaMemcpyDeviceToDevice, ctx.launch.stream),
                     wo_a.module + " group output"));
  }
  return ToModelDtypeOnDevice(ctx, u, tokens * groups * rank);
}

}  // namespace

absl::Status AttentionForwardOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                                      int64_t layer, const DeviceAttention& weights, const float* x,
                                      int64_t sequences, int64_t seq_len, float* out) {
  const int64_t ratio = config.CompressRatio(layer);
  if (ctx.official()) RETURN_IF_ERROR(CheckOfficialShapes(config, ratio));
  const int64_t tokens = sequences * seq_len;
  const int64_t heads = config.num_attention_heads, dim = config.head_dim;
  const int64_t rope_dim = config.qk_rope_head_dim;
  const float eps = config.rms_norm_eps;
  const std::string& wkv_module = weights.wkv.module;
  const std::string prefix = wkv_module.substr(0, wkv_module.rfind('.') + 1);
  ASSIGN_OR_RETURN(const DeviceRope rope,
                   UploadRope(ctx, RopeTable(LayerRopeInvFreq(config, layer), seq_len)));
  ASSIGN_OR_RETURN(const DeviceArray<int64_t> positions, Positions(ctx, tokens, seq_len, 1));

  // q: wq_a -> q_norm -> wq_b -> per-head RMS -> RoPE.
  ASSIGN_OR_RETURN(DeviceArray<float> qr, AllocateArray<float>(ctx, tokens * config.q_lora_rank));
  RETURN_IF_ERROR(ApplyLinearOnDevice(ctx, weights.wq_a, x, tokens, qr.data()));
  RETURN_IF_ERROR(RmsNormOnDevice(ctx, qr.data(), tokens, config.q_lora_rank, weights.q_norm, eps,
                                  prefix + "q_norm"));
  ASSIGN_OR_RETURN(DeviceArray<float> q, AllocateArray<float>(ctx, tokens * heads * dim));
  RETURN_IF_ERROR(ApplyLinearOnDevice(ctx, weights.wq_b, qr.data(), tokens, q.data()));
  RETURN_IF_ERROR(LaunchStatus(
      cuda::LaunchNormalizeHeads(ctx.official(), eps, q.data(), tokens * heads, dim, ctx.launch),
      prefix + "q head norm"));
  RETURN_IF_ERROR(Rope(ctx, rope, positions, false, q.data(), tokens, heads, dim, prefix + "q"));
  RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, q.data(), tokens * heads * dim));

  // The window K=V: wkv -> kv_norm -> RoPE -> (official) FP8 simulation of the nope dims.
  ASSIGN_OR_RETURN(DeviceArray<float> kv, AllocateArray<float>(ctx, tokens * dim));
  RETURN_IF_ERROR(ApplyLinearOnDevice(ctx, weights.wkv, x, tokens, kv.data()));
  RETURN_IF_ERROR(
      RmsNormOnDevice(ctx, kv.data(), tokens, dim, weights.kv_norm, eps, prefix + "kv_norm"));
  RETURN_IF_ERROR(Rope(ctx, rope, positions, false, kv.data(), tokens, 1, dim, prefix + "kv"));
  RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, kv.data(), tokens * dim));
  RETURN_IF_ERROR(ObserveKv(ctx, prefix + "kv", kv.data(), tokens, dim));
  if (ctx.official()) {
    RETURN_IF_ERROR(SimulateKvFp8(ctx, prefix + "kv", kv.data(), tokens, dim, rope_dim));
  }

  // Compressed entries, and the indexer's picks among them (CSA).
  DeviceArray<float> compressed;
  DevicePicks picks;
  const int64_t entries = ratio == 0 ? 0 : seq_len / ratio;
  if (ratio != 0) {
    ASSIGN_OR_RETURN(compressed, CompressorOnDevice(ctx, *weights.compressor, ratio, dim, eps, rope,
                                                    x, sequences, seq_len));
    RETURN_IF_ERROR(
        ObserveKv(ctx, prefix + "compressor", compressed.data(), sequences * entries, dim));
    if (ctx.official() && entries > 0) {
      RETURN_IF_ERROR(SimulateKvFp8(ctx, prefix + "compressor", compressed.data(),
                                    sequences * entries, dim, rope_dim));
    }
  }
  if (ratio == 4) {
    ASSIGN_OR_RETURN(picks, IndexerOnDevice(ctx, config, *weights.indexer, ratio, rope, positions,
                                            x, sequences, seq_len, qr.data()));
  }

  ASSIGN_OR_RETURN(DeviceArray<float> o, AllocateArray<float>(ctx, tokens * heads * dim));
  for (int64_t b = 0; b < sequences; ++b) {
    kernels::SparseAttentionArgs in;
    in.q = q.data() + b * seq_len * heads * dim;
    in.kv = kv.data() + b * seq_len * dim;
    in.compressed = entries > 0 ? compressed.data() + b * entries * dim : nullptr;
    in.entries = entries;
    if (ratio == 4 && picks.k > 0) {
      in.picks = picks.entries.data() + b * seq_len * picks.k;
      in.picks_per_query = picks.k;
    }
    in.sink = weights.attn_sink.data();
    in.seq_len = seq_len;
    in.heads = heads;
    in.head_dim = dim;
    in.window = config.sliding_window;
    in.ratio = ratio;
    RETURN_IF_ERROR(
        LaunchStatus(cuda::LaunchSparseAttention(in, ctx.official(),
                                                 o.data() + b * seq_len * heads * dim, ctx.launch),
                     prefix + "sparse attention"));
  }
  RETURN_IF_ERROR(Rope(ctx, rope, positions, true, o.data(), tokens, heads, dim, prefix + "o"));
  RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, o.data(), tokens * heads * dim));

  ASSIGN_OR_RETURN(DeviceArray<float> u,
                   AllocateArray<float>(ctx, tokens * config.o_groups * config.o_lora_rank));
  RETURN_IF_ERROR(GroupedOutputAOnDevice(ctx, config, weights.wo_a, o.data(), tokens, u.data()));
  return ApplyLinearOnDevice(ctx, weights.wo_b, u.data(), tokens, out);
}

}  // namespace quantd::model
