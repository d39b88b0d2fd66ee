#include "server/model/v4_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/v4_row_math.h"
#include "server/base/status_macros.h"
#include "server/model/v4_act_quant.h"
#include "server/model/v4_attention_sparse.h"
#include "server/model/v4_compressor.h"
#include "server/model/v4_forward_ops.h"
#include "server/model/v4_indexer.h"
#include "server/model/v4_mhc.h"
#include "server/model/v4_parallel.h"
#include "server/model/v4_rope.h"

namespace quantd::model {
namespace {

absl::Status CheckLinear(const LinearWeight& w, int64_t out, int64_t in) {
  if (w.view.data == nullptr || w.out_features() != out || w.in_features() != in) {
    return absl::InvalidArgumentError(absl::StrCat(w.module, ": attention needs [", out, ", ", in,
                                                   "], the weight is [", w.out_features(), ", ",
                                                   w.in_features(), "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckVector(const std::string& prefix, const char* name, const std::vector<float>& v,
                         int64_t size) {
  if (static_cast<int64_t>(v.size()) != size) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, name, ": attention needs ", size, " values, there are ", v.size()));
  }
  return absl::OkStatus();
}

// The module prefix ("layers.N.attn.") as the weights name it, from wkv's module.
std::string ModulePrefix(const V4AttentionWeights& w) {
  const std::string& m = w.wkv.module;
  const size_t dot = m.rfind('.');
  return dot == std::string::npos ? std::string() : m.substr(0, dot + 1);
}

absl::Status CheckCompressor(const std::string& prefix, const V4CompressorWeights& w, int64_t ratio,
                             int64_t width, int64_t hidden) {
  const int64_t coff = ratio == 4 ? 2 : 1;
  RETURN_IF_ERROR(CheckLinear(w.wkv, coff * width, hidden));
  RETURN_IF_ERROR(CheckLinear(w.wgate, coff * width, hidden));
  RETURN_IF_ERROR(CheckVector(prefix, "ape", w.ape, ratio * coff * width));
  return CheckVector(prefix, "norm.weight", w.norm, width);
}

}  // namespace

absl::Status CheckOfficialShapes(const V4Config& config, int64_t ratio) {
  const int64_t nope = config.head_dim - config.qk_rope_head_dim;
  if (nope % kKvQuantBlock != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("official numerics: head_dim - qk_rope_head_dim = ", nope,
                     " is not a multiple of the KV FP8 block ", kKvQuantBlock));
  }
  const int64_t n = config.index_head_dim;
  if (ratio == 4 && (n % kFp4QuantBlock != 0 || (n & (n - 1)) != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("official numerics: index_head_dim ", n,
                     " must be a power of two (Hadamard transform) and a multiple of ",
                     kFp4QuantBlock, " (FP4 blocks)"));
  }
  return absl::OkStatus();
}

void NormalizeHeads(const ForwardContext& ctx, float eps, float* q, int64_t rows, int64_t dim) {
  const bool official = ctx.numerics == Numerics::kOfficial;
  ParallelRows(ctx.threads, rows, 6 * dim, [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) v4math::NormalizeHead(official, eps, q + r * dim, dim);
  });
}

absl::Status ValidateAttentionWeights(const V4Config& config, int64_t layer,
                                      const V4AttentionWeights& w) {
  const std::string prefix = ModulePrefix(w);
  const int64_t ratio = config.CompressRatio(layer);
  const int64_t d = config.hidden_size, heads = config.num_attention_heads;
  const int64_t dim = config.head_dim, rope = config.qk_rope_head_dim;
  if (ratio != 0 && ratio != 4 && ratio != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("compress_ratios[", layer, "] is ", ratio, ": attention knows 0, 4 and 128"));
  }
  if (rope <= 0 || rope % 2 != 0 || rope > dim || config.o_groups <= 0 ||
      (heads * dim) % config.o_groups != 0 || config.sliding_window <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention of layer ", layer, ": qk_rope_head_dim ", rope, ", head_dim ", dim,
        ", o_groups ", config.o_groups, ", sliding_window ", config.sliding_window,
        " do not make an attention (rope dims even and within a head, heads split into groups)"));
  }
  RETURN_IF_ERROR(CheckLinear(w.wq_a, config.q_lora_rank, d));
  RETURN_IF_ERROR(CheckVector(prefix, "q_norm.weight", w.q_norm, config.q_lora_rank));
  RETURN_IF_ERROR(CheckLinear(w.wq_b, heads * dim, config.q_lora_rank));
  RETURN_IF_ERROR(CheckLinear(w.wkv, dim, d));
  RETURN_IF_ERROR(CheckVector(prefix, "kv_norm.weight", w.kv_norm, dim));
  RETURN_IF_ERROR(
      CheckLinear(w.wo_a, config.o_groups * config.o_lora_rank, heads * dim / config.o_groups));
  RETURN_IF_ERROR(CheckLinear(w.wo_b, d, config.o_groups * config.o_lora_rank));
  RETURN_IF_ERROR(CheckVector(prefix, "attn_sink", w.attn_sink, heads));
  if (w.compressor.has_value() != (ratio != 0) || w.indexer.has_value() != (ratio == 4)) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "compressor / indexer: layer ", layer, " has compress ratio ", ratio,
        ", which needs ", ratio == 0 ? "neither" : (ratio == 4 ? "both" : "a compressor only")));
  }
  if (w.compressor) {
    RETURN_IF_ERROR(CheckCompressor(prefix + "compressor.", *w.compressor, ratio, dim, d));
  }
  if (w.indexer) {
    const int64_t n = config.index_n_heads, hd = config.index_head_dim;
    if (hd < rope) {
      return absl::InvalidArgumentError(
          absl::StrCat("index_head_dim ", hd, " is smaller than qk_rope_head_dim ", rope));
    }
    RETURN_IF_ERROR(CheckLinear(w.indexer->wq_b, n * hd, config.q_lora_rank));
    RETURN_IF_ERROR(CheckLinear(w.indexer->weights_proj, n, d));
    RETURN_IF_ERROR(
        CheckCompressor(prefix + "indexer.compressor.", w.indexer->compressor, ratio, hd, d));
  }
  return absl::OkStatus();
}

absl::Status AttentionBlock(const ForwardContext& ctx, const V4Config& config, int64_t layer,
                            const V4AttentionWeights& weights, const AttentionBatch& batch,
                            float* out) {
  RETURN_IF_ERROR(ValidateAttentionWeights(config, layer, weights));
  if (batch.x == nullptr || batch.sequences <= 0 || batch.seq_len <= 0 || ctx.gemm == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention of layer ", layer, ": a batch of ", batch.sequences, " sequences of ",
        batch.seq_len, " tokens", batch.x == nullptr ? " without data" : "",
        ctx.gemm == nullptr ? " without a Gemm" : ""));
  }
  const ForwardOps& ops = OpsOf(ctx);
  const bool official = ctx.numerics == Numerics::kOfficial;
  const int64_t ratio = config.CompressRatio(layer);
  if (official) RETURN_IF_ERROR(CheckOfficialShapes(config, ratio));
  const int64_t seq_len = batch.seq_len;
  const int64_t tokens = batch.sequences * seq_len;
  const int64_t heads = config.num_attention_heads;
  const int64_t dim = config.head_dim;
  const int64_t rope_dim = config.qk_rope_head_dim;
  const float eps = config.rms_norm_eps;
  const std::string prefix = ModulePrefix(weights);
  const RopeTable rope(LayerRopeInvFreq(config, layer), seq_len);
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t r = 0; r < tokens; ++r) positions[r] = r % seq_len;

  // q: wq_a -> q_norm -> wq_b -> per-head RMS -> RoPE.
  ASSIGN_OR_RETURN(OpArray<float> qr,
                   AllocateArray<float>(ops, tokens * config.q_lora_rank, prefix + "qr"));
  RETURN_IF_ERROR(ops.Linear(ctx, weights.wq_a, batch.x, tokens, qr.data(),
                             LinearOutput::kModelDtype, {}));
  RETURN_IF_ERROR(
      ops.RmsNorm(ctx, qr.data(), tokens, config.q_lora_rank, weights.q_norm, eps, qr.data()));
  ASSIGN_OR_RETURN(OpArray<float> q, AllocateArray<float>(ops, tokens * heads * dim, prefix + "q"));
  RETURN_IF_ERROR(
      ops.Linear(ctx, weights.wq_b, qr.data(), tokens, q.data(), LinearOutput::kModelDtype, {}));
  RETURN_IF_ERROR(ops.NormalizeHeads(ctx, eps, q.data(), tokens * heads, dim));
  RETURN_IF_ERROR(ops.Rope(ctx, rope, positions, /*inverse=*/false, q.data(), tokens, heads, dim));
  RETURN_IF_ERROR(ops.ToModelDtype(ctx, q.data(), q.size()));

  // The window K=V: wkv -> kv_norm -> RoPE -> (official) FP8 simulation of the nope dims.
  ASSIGN_OR_RETURN(OpArray<float> kv, AllocateArray<float>(ops, tokens * dim, prefix + "kv"));
  RETURN_IF_ERROR(
      ops.Linear(ctx, weights.wkv, batch.x, tokens, kv.data(), LinearOutput::kModelDtype, {}));
  RETURN_IF_ERROR(ops.RmsNorm(ctx, kv.data(), tokens, dim, weights.kv_norm, eps, kv.data()));
  RETURN_IF_ERROR(ops.Rope(ctx, rope, positions, /*inverse=*/false, kv.data(), tokens, 1, dim));
  RETURN_IF_ERROR(ops.ToModelDtype(ctx, kv.data(), tokens * dim));
  RETURN_IF_ERROR(ops.ObserveKv(ctx, prefix + "kv", kv.data(), tokens, dim));
  if (official) {
    RETURN_IF_ERROR(ops.SimulateKvFp8(ctx, prefix + "kv", kv.data(), tokens, dim, rope_dim));
  }

  // Compressed entries, and the indexer's picks among them (CSA).
  OpArray<float> compressed;
  IndexerPicks picks;
  const int64_t entries = ratio == 0 ? 0 : seq_len / ratio;
  if (ratio != 0) {
    ASSIGN_OR_RETURN(compressed,
                     RunCompressor(ctx, *weights.compressor, ratio, dim, eps, rope, batch));
    RETURN_IF_ERROR(ops.ObserveKv(ctx, prefix + "compressor", compressed.data(),
                                  batch.sequences * entries, dim));
    if (official && entries > 0) {
      RETURN_IF_ERROR(ops.SimulateKvFp8(ctx, prefix + "compressor", compressed.data(),
                                        batch.sequences * entries, dim, rope_dim));
    }
  }
  if (ratio == 4) {
    ASSIGN_OR_RETURN(picks,
                     RunIndexer(ctx, config, *weights.indexer, ratio, rope, batch, qr.data()));
  }

  ASSIGN_OR_RETURN(const float* sink, ops.Parameter(weights.attn_sink, prefix + "attn_sink"));
  ASSIGN_OR_RETURN(OpArray<float> o, AllocateArray<float>(ops, tokens * heads * dim, prefix + "o"));
  for (int64_t b = 0; b < batch.sequences; ++b) {
    kernels::SparseAttentionArgs in;
    in.q = q.data() + b * seq_len * heads * dim;
    in.kv = kv.data() + b * seq_len * dim;
    in.compressed = entries > 0 ? compressed.data() + b * entries * dim : nullptr;
    in.entries = entries;
    if (ratio == 4 && picks.k > 0) {
      in.picks = picks.entries.data() + b * seq_len * picks.k;
      in.picks_per_query = picks.k;
    }
    in.sink = sink;
    in.seq_len = seq_len;
    in.heads = heads;
    in.head_dim = dim;
    in.window = config.sliding_window;
    in.ratio = ratio;
    RETURN_IF_ERROR(ops.SparseAttention(ctx, in, o.data() + b * seq_len * heads * dim));
  }
  RETURN_IF_ERROR(ops.Rope(ctx, rope, positions, /*inverse=*/true, o.data(), tokens, heads, dim));
  RETURN_IF_ERROR(ops.ToModelDtype(ctx, o.data(), o.size()));

  ASSIGN_OR_RETURN(
      OpArray<float> u,
      AllocateArray<float>(ops, tokens * config.o_groups * config.o_lora_rank, prefix + "u"));
  RETURN_IF_ERROR(ops.GroupedOutputA(ctx, config, weights.wo_a, o.data(), tokens, u.data()));
  return ops.Linear(ctx, weights.wo_b, u.data(), tokens, out, LinearOutput::kModelDtype, {});
}

absl::StatusOr<std::vector<float>> AttentionForward(const ForwardContext& ctx,
                                                    const V4Config& config, int64_t layer,
                                                    const V4AttentionWeights& weights,
                                                    const AttentionBatch& batch) {
  const ForwardOps& ops = OpsOf(ctx);
  const int64_t tokens = std::max<int64_t>(batch.sequences * batch.seq_len, 0);
  const int64_t d = config.hidden_size;
  AttentionBatch on_ops = batch;
  OpArray<float> x;
  if (batch.x != nullptr && tokens > 0) {
    ASSIGN_OR_RETURN(x, AllocateArray<float>(ops, tokens * d, "attention input"));
    RETURN_IF_ERROR(ops.CopyIn(batch.x, static_cast<size_t>(tokens * d) * sizeof(float), x.data(),
                               "attention input"));
    on_ops.x = x.data();
  }
  ASSIGN_OR_RETURN(OpArray<float> out, AllocateArray<float>(ops, tokens * d, "attention output"));
  RETURN_IF_ERROR(AttentionBlock(ctx, config, layer, weights, on_ops, out.data()));
  return DownloadArray(ops, out.data(), tokens * d, "attention output");
}

}  // namespace quantd::model
