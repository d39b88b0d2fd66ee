#include "server/model/v4_layer.h"

#include <string.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "server/base/status_macros.h"
#include "server/model/v4_forward_ops.h"

namespace quantd::model {
namespace {

// Makes the linears of `w` readable by `ops` (on a device: moved there).
absl::Status PlaceCompressor(const ForwardOps& ops, V4CompressorWeights& w) {
  RETURN_IF_ERROR(ops.Place(w.wkv));
  return ops.Place(w.wgate);
}

absl::Status PlaceBlock(const ForwardOps& ops, V4LayerWeights& w) {
  V4AttentionWeights& a = w.attn;
  for (LinearWeight* l : {&a.wq_a, &a.wq_b, &a.wkv, &a.wo_a, &a.wo_b, &w.moe.gate,
                          &w.moe.shared.w1, &w.moe.shared.w2, &w.moe.shared.w3}) {
    RETURN_IF_ERROR(ops.Place(*l));
  }
  if (a.compressor) RETURN_IF_ERROR(PlaceCompressor(ops, *a.compressor));
  if (a.indexer) {
    RETURN_IF_ERROR(ops.Place(a.indexer->wq_b));
    RETURN_IF_ERROR(ops.Place(a.indexer->weights_proj));
    RETURN_IF_ERROR(PlaceCompressor(ops, a.indexer->compressor));
  }
  return absl::OkStatus();
}

absl::StatusOr<HyperConnectionWeights> LoadHyperConnection(const V4Checkpoint& ckpt,
                                                           const std::string& prefix,
                                                           int64_t mix_width, int64_t scales) {
  const V4Config& c = ckpt.config;
  HyperConnectionWeights w;
  ASSIGN_OR_RETURN(w.fn, LoadFloats(ckpt, prefix + "fn", {mix_width, c.hc_mult * c.hidden_size}));
  ASSIGN_OR_RETURN(w.base, LoadFloats(ckpt, prefix + "base", {mix_width}));
  ASSIGN_OR_RETURN(w.scale, LoadFloats(ckpt, prefix + "scale", {scales}));
  return w;
}

absl::StatusOr<V4CompressorWeights> LoadCompressor(const V4Checkpoint& ckpt,
                                                   kernels::Backend& backend,
                                                   const std::string& prefix, int64_t ratio,
                                                   int64_t width) {
  const int64_t coff = ratio == 4 ? 2 : 1, d = ckpt.config.hidden_size;
  V4CompressorWeights w;
  ASSIGN_OR_RETURN(w.wkv, LoadLinear(ckpt, backend, prefix + "wkv", coff * width, d));
  ASSIGN_OR_RETURN(w.wgate, LoadLinear(ckpt, backend, prefix + "wgate", coff * width, d));
  ASSIGN_OR_RETURN(w.ape, LoadFloats(ckpt, prefix + "ape", {ratio, coff * width}));
  ASSIGN_OR_RETURN(w.norm, LoadFloats(ckpt, prefix + "norm.weight", {width}));
  return w;
}

absl::StatusOr<V4AttentionWeights> LoadAttention(const V4Checkpoint& ckpt,
                                                 kernels::Backend& backend,
                                                 const std::string& prefix, int64_t layer) {
  const V4Config& c = ckpt.config;
  const int64_t d = c.hidden_size, hd = c.head_dim, heads = c.num_attention_heads;
  const std::string p = prefix + "attn.";
  V4AttentionWeights w;
  ASSIGN_OR_RETURN(w.wq_a, LoadLinear(ckpt, backend, p + "wq_a", c.q_lora_rank, d));
  ASSIGN_OR_RETURN(w.q_norm, LoadFloats(ckpt, p + "q_norm.weight", {c.q_lora_rank}));
  ASSIGN_OR_RETURN(w.wq_b, LoadLinear(ckpt, backend, p + "wq_b", heads * hd, c.q_lora_rank));
  ASSIGN_OR_RETURN(w.wkv, LoadLinear(ckpt, backend, p + "wkv", hd, d));
  ASSIGN_OR_RETURN(w.kv_norm, LoadFloats(ckpt, p + "kv_norm.weight", {hd}));
  ASSIGN_OR_RETURN(w.wo_a, LoadLinear(ckpt, backend, p + "wo_a", c.o_groups * c.o_lora_rank,
                                      heads * hd / c.o_groups));
  ASSIGN_OR_RETURN(w.wo_b, LoadLinear(ckpt, backend, p + "wo_b", d, c.o_groups * c.o_lora_rank));
  // Absent in some releases (reference §2); the official loader then leaves it uninitialized,
  // transformers zero: a zero sink.
  ASSIGN_OR_RETURN(w.attn_sink, LoadFloatsOr(ckpt, p + "attn_sink", {heads}, 0.0f));
  const int64_t ratio = c.CompressRatio(layer);
  if (ratio != 0) {
    ASSIGN_OR_RETURN(w.compressor, LoadCompressor(ckpt, backend, p + "compressor.", ratio, hd));
  }
  if (ratio == 4) {
    V4IndexerWeights idx;
    const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
    ASSIGN_OR_RETURN(idx.wq_b,
                     LoadLinear(ckpt, backend, p + "indexer.wq_b", ih * ihd, c.q_lora_rank));
    ASSIGN_OR_RETURN(idx.weights_proj,
                     LoadLinear(ckpt, backend, p + "indexer.weights_proj", ih, d));
    ASSIGN_OR_RETURN(idx.compressor,
                     LoadCompressor(ckpt, backend, p + "indexer.compressor.", 4, ihd));
    w.indexer = std::move(idx);
  }
  RETURN_IF_ERROR(ValidateAttentionWeights(c, layer, w));
  return w;
}

// The weights of the decoder block under `p` ("layers.N." or "mtp.0."), layer index `layer`.
absl::StatusOr<V4LayerWeights> LoadBlock(const V4Checkpoint& ckpt, const std::string& p,
                                         int64_t layer, compute::Device& device,
                                         const std::function<void()>& alive) {
  const V4Config& c = ckpt.config;
  const int64_t mix = (2 + c.hc_mult) * c.hc_mult;
  V4LayerWeights w;
  w.layer = layer;
  ASSIGN_OR_RETURN(w.hc_attn, LoadHyperConnection(ckpt, p + "hc_attn_", mix, 3));
  ASSIGN_OR_RETURN(w.hc_ffn, LoadHyperConnection(ckpt, p + "hc_ffn_", mix, 3));
  ASSIGN_OR_RETURN(w.attn_norm, LoadFloats(ckpt, p + "attn_norm.weight", {c.hidden_size}));
  ASSIGN_OR_RETURN(w.ffn_norm, LoadFloats(ckpt, p + "ffn_norm.weight", {c.hidden_size}));
  ASSIGN_OR_RETURN(w.attn, LoadAttention(ckpt, device.backend(), p, layer));
  if (alive) alive();
  ASSIGN_OR_RETURN(w.moe, LoadMoe(ckpt, device.backend(), p, c.IsHashLayer(layer), alive));
  ASSIGN_OR_RETURN(const std::shared_ptr<ForwardOps> ops, MakeForwardOps(device));
  RETURN_IF_ERROR(PlaceBlock(*ops, w));
  w.placed = ops->placement();
  return w;
}

// hc_head_*, norm under `prefix` ("" or "mtp.0.") and the shared head.weight.
absl::StatusOr<V4HeadWeights> LoadHeadWeights(const V4Checkpoint& ckpt, compute::Device& device,
                                              const std::string& prefix) {
  const V4Config& c = ckpt.config;
  V4HeadWeights w;
  ASSIGN_OR_RETURN(w.hc_head, LoadHyperConnection(ckpt, prefix + "hc_head_", c.hc_mult, 1));
  ASSIGN_OR_RETURN(w.norm, LoadFloats(ckpt, prefix + "norm.weight", {c.hidden_size}));
  ASSIGN_OR_RETURN(w.head, LoadLinear(ckpt, device.backend(), "head", c.vocab_size, c.hidden_size));
  ASSIGN_OR_RETURN(const std::shared_ptr<ForwardOps> ops, MakeForwardOps(device));
  RETURN_IF_ERROR(ops->Place(w.head));
  w.placed = ops->placement();
  return w;
}

// The BF16 embedding rows of `ids` as float32, row t at out + t * stride, and copied to the
// `copies` - 1 rows of d values after it.
absl::Status EmbedRows(const V4Checkpoint& ckpt, const std::vector<int32_t>& ids, float* out,
                       int64_t stride, int64_t copies, const HostThreads& threads) {
  const V4Config& c = ckpt.config;
  const int64_t d = c.hidden_size;
  const checkpoint::TensorView* embed = ckpt.dir->Find("embed.weight");
  if (embed == nullptr || embed->dtype != checkpoint::Dtype::kBF16 ||
      embed->shape != std::vector<int64_t>{c.vocab_size, d}) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor embed.weight must be BF16 [", c.vocab_size, ", ", d, "] in ", ckpt.dir->dir()));
  }
  for (size_t t = 0; t < ids.size(); ++t) {
    if (ids[t] < 0 || ids[t] >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("Embed: token id at position ", t, " is outside [0, ", c.vocab_size, ")"));
    }
  }
  EmbeddingRows(embed->data, d, ids.data(), static_cast<int64_t>(ids.size()), stride, copies, out,
                threads);
  ReleasePages(ckpt, *embed);
  return absl::OkStatus();
}

// FailedPrecondition unless `what`'s weights, placed for `placed`, are where ctx's ops run.
absl::Status CheckPlaced(const ForwardContext& ctx, const std::string& what,
                         const std::string& placed) {
  const std::string runs = OpsOf(ctx).placement();
  if (placed == runs) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, " is loaded for ", placed,
                                                    ", the forward context runs on ", runs));
}

// A V4Activations like `in` (sizes and token ids) with the streams at `streams` (ops memory).
absl::StatusOr<V4Activations> ActivationsFrom(const ForwardOps& ops, const V4Activations& in,
                                              const float* streams, int64_t n,
                                              std::vector<int32_t> ids) {
  V4Activations out;
  out.sequences = in.sequences;
  out.seq_len = in.seq_len;
  out.hc_mult = in.hc_mult;
  out.hidden_size = in.hidden_size;
  out.token_ids = std::move(ids);
  ASSIGN_OR_RETURN(out.streams, DownloadArray(ops, streams, n, "output streams"));
  return out;
}

// RunLayer over the ops, the input streams (`in`'s shape, its token ids) in their memory.
absl::StatusOr<V4Activations> RunBlock(const ForwardContext& ctx, const V4Config& config,
                                       const V4LayerWeights& layer, const V4Activations& in,
                                       const OpArray<float>& streams) {
  const ForwardOps& ops = OpsOf(ctx);
  const int64_t tokens = in.tokens(), d = config.hidden_size;
  const int64_t n = tokens * config.hc_mult * d;
  ASSIGN_OR_RETURN(const OpArray<float> x, AllocateArray<float>(ops, tokens * d, "layer input"));
  ASSIGN_OR_RETURN(OpHcMix mix,
                   ops.HcPre(ctx, config, layer.hc_attn, streams.data(), tokens, x.data()));
  RETURN_IF_ERROR(ops.RmsNorm(ctx, x.data(), tokens, d, layer.attn_norm, config.rms_norm_eps,
                              x.data()));
  ASSIGN_OR_RETURN(const OpArray<float> attn,
                   AllocateArray<float>(ops, tokens * d, "attention output"));
  RETURN_IF_ERROR(AttentionBlock(ctx, config, layer.layer, layer.attn,
                                 {x.data(), in.sequences, in.seq_len}, attn.data()));
  ASSIGN_OR_RETURN(const OpArray<float> mid, AllocateArray<float>(ops, n, "attention streams"));
  RETURN_IF_ERROR(
      ops.HcPost(ctx, config, mix, attn.data(), streams.data(), tokens, mid.data()));

  ASSIGN_OR_RETURN(mix, ops.HcPre(ctx, config, layer.hc_ffn, mid.data(), tokens, x.data()));
  RETURN_IF_ERROR(
      ops.RmsNorm(ctx, x.data(), tokens, d, layer.ffn_norm, config.rms_norm_eps, x.data()));
  const OpArray<float>& ffn = attn;  // the attention output is spent: reuse its memory
  RETURN_IF_ERROR(
      MoeBlock(ctx, config, layer.moe, x.data(), tokens, in.token_ids.data(), ffn.data()));
  ASSIGN_OR_RETURN(const OpArray<float> out, AllocateArray<float>(ops, n, "output streams"));
  RETURN_IF_ERROR(ops.HcPost(ctx, config, mix, ffn.data(), mid.data(), tokens, out.data()));
  return ActivationsFrom(ops, in, out.data(), n, in.token_ids);
}

}  // namespace

absl::Status CheckActivations(const V4Config& c, const V4Activations& a) {
  if (a.hc_mult != c.hc_mult || a.hidden_size != c.hidden_size || a.sequences <= 0 ||
      a.seq_len <= 0 || static_cast<int64_t>(a.token_ids.size()) != a.tokens() ||
      static_cast<int64_t>(a.streams.size()) != a.tokens() * c.hc_mult * c.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "activations [", a.sequences, ", ", a.seq_len, ", ", a.hc_mult, ", ", a.hidden_size, "] (",
        a.streams.size(), " values) do not fit a model with hc_mult ", c.hc_mult,
        " and hidden_size ", c.hidden_size));
  }
  return absl::OkStatus();
}

absl::StatusOr<ForwardContext> MakeForwardContext(compute::Device& device, Numerics numerics,
                                                  Observer* observer) {
  if (device.gemm() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the DeepSeek-V4 forward needs matrix products; device ", device.name(),
                     " has no Gemm"));
  }
  ForwardContext ctx;
  ASSIGN_OR_RETURN(ctx.ops, MakeForwardOps(device));
  ctx.gemm = device.gemm();
  ctx.numerics = numerics;
  ctx.observer = observer;
  if (device.host_visible()) {
    ctx.threads.count = device.host_threads();
    ctx.threads.pool = device.host_pool();
  }
  return ctx;
}

absl::StatusOr<V4LayerWeights> LoadLayer(const V4Checkpoint& ckpt, int64_t layer,
                                         compute::Device& device,
                                         const std::function<void()>& alive) {
  const V4Config& c = ckpt.config;
  if (layer < 0 || layer >= c.num_hidden_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is outside [0, ", c.num_hidden_layers, ")"));
  }
  return LoadBlock(ckpt, absl::StrCat("layers.", layer, "."), layer, device, alive);
}

absl::StatusOr<V4Activations> RunLayer(const ForwardContext& ctx, const V4Config& config,
                                       const V4LayerWeights& layer, const V4Activations& in) {
  RETURN_IF_ERROR(CheckActivations(config, in));
  RETURN_IF_ERROR(CheckPlaced(ctx, absl::StrCat("layer ", layer.layer), layer.placed));
  ASSIGN_OR_RETURN(const OpArray<float> streams,
                   UploadArray(OpsOf(ctx), in.streams, "input streams"));
  return RunBlock(ctx, config, layer, in, streams);
}

void EmbeddingRows(const uint8_t* table, int64_t d, const int32_t* ids, int64_t tokens,
                   int64_t stride, int64_t copies, float* out, const HostThreads& threads) {
  ParallelRows(threads, tokens, 2 * copies * d, [&](int, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* src = table + static_cast<int64_t>(ids[t]) * d * 2;
      float* row = out + t * stride;
      for (int64_t i = 0; i < d; ++i) {
        uint16_t b;
        memcpy(&b, src + 2 * i, 2);
        row[i] = formats::Bf16ToFloat(b);
      }
      for (int64_t j = 1; j < copies; ++j) memcpy(row + j * d, row, static_cast<size_t>(d) * 4);
    }
  });
}

absl::StatusOr<V4Activations> Embed(const V4Checkpoint& ckpt, std::vector<int32_t> token_ids,
                                    int64_t sequences, int64_t seq_len,
                                    const HostThreads& threads) {
  const V4Config& c = ckpt.config;
  const int64_t d = c.hidden_size, hc = c.hc_mult;
  if (sequences <= 0 || seq_len <= 0 ||
      static_cast<int64_t>(token_ids.size()) != sequences * seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("Embed: ", token_ids.size(), " token ids for ", sequences, " x ", seq_len));
  }
  V4Activations a;
  a.sequences = sequences;
  a.seq_len = seq_len;
  a.hc_mult = hc;
  a.hidden_size = d;
  a.streams.resize(static_cast<size_t>(a.tokens() * hc * d));
  // Row t of the embedding into each stream of token t.
  RETURN_IF_ERROR(EmbedRows(ckpt, token_ids, a.streams.data(), hc * d, hc, threads));
  a.token_ids = std::move(token_ids);
  return a;
}

absl::StatusOr<V4HeadWeights> LoadHead(const V4Checkpoint& ckpt, compute::Device& device) {
  return LoadHeadWeights(ckpt, device, "");
}

absl::Status HeadForward(const ForwardContext& ctx, const V4Config& config,
                         const V4HeadWeights& head, const V4Activations& acts,
                         std::vector<float>* hidden, std::vector<float>* logits) {
  RETURN_IF_ERROR(CheckActivations(config, acts));
  RETURN_IF_ERROR(CheckPlaced(ctx, "the head", head.placed));
  const ForwardOps& ops = OpsOf(ctx);
  const int64_t tokens = acts.tokens(), d = config.hidden_size;
  ASSIGN_OR_RETURN(const OpArray<float> streams, UploadArray(ops, acts.streams, "head streams"));
  ASSIGN_OR_RETURN(const OpArray<float> y, AllocateArray<float>(ops, tokens * d, "hidden state"));
  RETURN_IF_ERROR(ops.HcHead(ctx, config, head.hc_head, streams.data(), tokens, y.data()));
  RETURN_IF_ERROR(
      ops.RmsNorm(ctx, y.data(), tokens, d, head.norm, config.rms_norm_eps, y.data()));
  ASSIGN_OR_RETURN(*hidden, DownloadArray(ops, y.data(), tokens * d, "hidden state"));
  if (logits == nullptr) return absl::OkStatus();
  const int64_t n = tokens * config.vocab_size;
  ASSIGN_OR_RETURN(const OpArray<float> out, AllocateArray<float>(ops, n, "logits"));
  RETURN_IF_ERROR(
      ops.Linear(ctx, head.head, y.data(), tokens, out.data(), LinearOutput::kFloat32, {}));
  ASSIGN_OR_RETURN(*logits, DownloadArray(ops, out.data(), n, "logits"));
  return absl::OkStatus();
}

absl::StatusOr<V4MtpWeights> LoadMtp(const V4Checkpoint& ckpt, compute::Device& device) {
  const V4Config& c = ckpt.config;
  const int64_t d = c.hidden_size;
  const std::string p = "mtp.0.";
  V4MtpWeights w;
  ASSIGN_OR_RETURN(w.e_proj, LoadLinear(ckpt, device.backend(), p + "e_proj", d, d));
  ASSIGN_OR_RETURN(w.h_proj, LoadLinear(ckpt, device.backend(), p + "h_proj", d, d));
  ASSIGN_OR_RETURN(w.enorm, LoadFloats(ckpt, p + "enorm.weight", {d}));
  ASSIGN_OR_RETURN(w.hnorm, LoadFloats(ckpt, p + "hnorm.weight", {d}));
  ASSIGN_OR_RETURN(w.block, LoadBlock(ckpt, p, c.num_hidden_layers, device, {}));
  ASSIGN_OR_RETURN(w.head, LoadHeadWeights(ckpt, device, p));
  ASSIGN_OR_RETURN(const std::shared_ptr<ForwardOps> ops, MakeForwardOps(device));
  RETURN_IF_ERROR(ops->Place(w.e_proj));
  RETURN_IF_ERROR(ops->Place(w.h_proj));
  return w;
}

absl::StatusOr<V4Activations> RunMtp(const ForwardContext& ctx, const V4Checkpoint& ckpt,
                                     const V4MtpWeights& mtp, const V4Activations& h,
                                     std::vector<int32_t> next_ids) {
  const V4Config& c = ckpt.config;
  RETURN_IF_ERROR(CheckActivations(c, h));
  RETURN_IF_ERROR(CheckPlaced(ctx, "the MTP block", mtp.block.placed));
  const ForwardOps& ops = OpsOf(ctx);
  const int64_t tokens = h.tokens(), d = c.hidden_size, hc = c.hc_mult;
  if (static_cast<int64_t>(next_ids.size()) != tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunMtp: ", next_ids.size(), " next-token ids for ", tokens, " tokens"));
  }
  std::vector<float> embedded(static_cast<size_t>(tokens * d));
  RETURN_IF_ERROR(EmbedRows(ckpt, next_ids, embedded.data(), d, 1, ctx.threads));
  ASSIGN_OR_RETURN(const OpArray<float> e, UploadArray(ops, embedded, "MTP embedding"));
  ASSIGN_OR_RETURN(const OpArray<float> ep, AllocateArray<float>(ops, tokens * d, "MTP e_proj"));
  RETURN_IF_ERROR(ops.RmsNorm(ctx, e.data(), tokens, d, mtp.enorm, c.rms_norm_eps, e.data()));
  RETURN_IF_ERROR(
      ops.Linear(ctx, mtp.e_proj, e.data(), tokens, ep.data(), LinearOutput::kModelDtype, {}));
  // hnorm and h_proj act on each stream: [tokens * hc, d] rows.
  const int64_t n = static_cast<int64_t>(h.streams.size());
  ASSIGN_OR_RETURN(const OpArray<float> hs, UploadArray(ops, h.streams, "MTP streams"));
  ASSIGN_OR_RETURN(const OpArray<float> hn, AllocateArray<float>(ops, n, "MTP hnorm"));
  RETURN_IF_ERROR(
      ops.RmsNorm(ctx, hs.data(), tokens * hc, d, mtp.hnorm, c.rms_norm_eps, hn.data()));
  ASSIGN_OR_RETURN(const OpArray<float> x, AllocateArray<float>(ops, n, "MTP block input"));
  RETURN_IF_ERROR(ops.Linear(ctx, mtp.h_proj, hn.data(), tokens * hc, x.data(),
                             LinearOutput::kModelDtype, {}));
  RETURN_IF_ERROR(ops.AddToStreams(ep.data(), tokens, hc, d, x.data()));
  RETURN_IF_ERROR(ops.ToModelDtype(ctx, x.data(), n));
  V4Activations in;
  in.sequences = h.sequences;
  in.seq_len = h.seq_len;
  in.hc_mult = hc;
  in.hidden_size = d;
  in.token_ids = std::move(next_ids);
  return RunBlock(ctx, c, mtp.block, in, x);
}

}  // namespace quantd::model
