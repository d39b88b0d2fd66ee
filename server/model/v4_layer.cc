#include "server/model/v4_layer.h"

#include <string.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "server/base/status_macros.h"
#include "server/model/v4_device_forward.h"

namespace quantd::model {
namespace {

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

// FailedPrecondition for the host-only entries when ctx runs on a CUDA device.
absl::Status CheckHostContext(const ForwardContext& ctx, const char* what) {
  if (ctx.device == nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(what, " runs on the host; the device forward covers the decoder layers"));
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
  if (device.kind() == compute::DeviceKind::kCuda) {
    ForwardContext ctx;
    ASSIGN_OR_RETURN(ctx.device, OpenDeviceForward(device, numerics));
    ctx.gemm = device.gemm();
    ctx.numerics = numerics;
    ctx.observer = observer;
    return ctx;
  }
  if (!device.host_visible() || device.gemm() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the DeepSeek-V4 forward runs its non-GEMM blocks on the host; device ",
                     device.name(), " is not host-visible"));
  }
  ForwardContext ctx;
  ctx.gemm = device.gemm();
  ctx.numerics = numerics;
  ctx.observer = observer;
  ctx.threads.count = device.host_threads();
  ctx.threads.pool = device.host_pool();
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
  ASSIGN_OR_RETURN(V4LayerWeights w,
                   LoadBlock(ckpt, absl::StrCat("layers.", layer, "."), layer, device, alive));
  if (device.kind() != compute::DeviceKind::kCuda) return w;
  V4LayerWeights resident;
  resident.layer = layer;
  ASSIGN_OR_RETURN(resident.device, MakeLayerResident(device, c, std::move(w)));
  return resident;
}

absl::StatusOr<V4Activations> RunLayer(const ForwardContext& ctx, const V4Config& config,
                                       const V4LayerWeights& layer, const V4Activations& in) {
  if (ctx.device != nullptr || layer.device != nullptr) {
    return RunDeviceLayer(ctx, config, layer, in);
  }
  RETURN_IF_ERROR(CheckActivations(config, in));
  const int64_t tokens = in.tokens(), d = config.hidden_size;
  std::vector<float> x(static_cast<size_t>(tokens * d));
  HcMix mix;
  RETURN_IF_ERROR(HcPre(ctx, config, layer.hc_attn, in.streams.data(), tokens, x.data(), &mix));
  RmsNorm(ctx, x.data(), tokens, d, layer.attn_norm, config.rms_norm_eps, x.data());
  ASSIGN_OR_RETURN(std::vector<float> attn, AttentionForward(ctx, config, layer.layer, layer.attn,
                                                             {x.data(), in.sequences, in.seq_len}));
  std::vector<float> mid(in.streams.size());
  HcPost(ctx, config, mix, attn.data(), in.streams.data(), tokens, mid.data());

  RETURN_IF_ERROR(HcPre(ctx, config, layer.hc_ffn, mid.data(), tokens, x.data(), &mix));
  RmsNorm(ctx, x.data(), tokens, d, layer.ffn_norm, config.rms_norm_eps, x.data());
  std::vector<float> ffn(static_cast<size_t>(tokens * d));
  RETURN_IF_ERROR(
      MoeForward(ctx, config, layer.moe, x.data(), tokens, in.token_ids.data(), ffn.data()));
  V4Activations out;
  out.sequences = in.sequences;
  out.seq_len = in.seq_len;
  out.hc_mult = in.hc_mult;
  out.hidden_size = in.hidden_size;
  out.token_ids = in.token_ids;
  out.streams.resize(in.streams.size());
  HcPost(ctx, config, mix, ffn.data(), mid.data(), tokens, out.streams.data());
  return out;
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
  RETURN_IF_ERROR(CheckHostContext(ctx, "HeadForward"));
  RETURN_IF_ERROR(CheckActivations(config, acts));
  const int64_t tokens = acts.tokens(), d = config.hidden_size;
  hidden->resize(static_cast<size_t>(tokens * d));
  RETURN_IF_ERROR(HcHead(ctx, config, head.hc_head, acts.streams.data(), tokens, hidden->data()));
  RmsNorm(ctx, hidden->data(), tokens, d, head.norm, config.rms_norm_eps, hidden->data());
  if (logits == nullptr) return absl::OkStatus();
  logits->resize(static_cast<size_t>(tokens * config.vocab_size));
  return ApplyLinear(ctx, head.head, hidden->data(), tokens, logits->data(),
                     LinearOutput::kFloat32);
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
  return w;
}

absl::StatusOr<V4Activations> RunMtp(const ForwardContext& ctx, const V4Checkpoint& ckpt,
                                     const V4MtpWeights& mtp, const V4Activations& h,
                                     std::vector<int32_t> next_ids) {
  const V4Config& c = ckpt.config;
  RETURN_IF_ERROR(CheckHostContext(ctx, "RunMtp"));
  RETURN_IF_ERROR(CheckActivations(c, h));
  const int64_t tokens = h.tokens(), d = c.hidden_size, hc = c.hc_mult;
  if (static_cast<int64_t>(next_ids.size()) != tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunMtp: ", next_ids.size(), " next-token ids for ", tokens, " tokens"));
  }
  std::vector<float> e(static_cast<size_t>(tokens * d)), ep(e.size());
  RETURN_IF_ERROR(EmbedRows(ckpt, next_ids, e.data(), d, 1, ctx.threads));
  RmsNorm(ctx, e.data(), tokens, d, mtp.enorm, c.rms_norm_eps, e.data());
  RETURN_IF_ERROR(ApplyLinear(ctx, mtp.e_proj, e.data(), tokens, ep.data()));
  // hnorm and h_proj act on each stream: [tokens * hc, d] rows.
  std::vector<float> hn(h.streams.size());
  RmsNorm(ctx, h.streams.data(), tokens * hc, d, mtp.hnorm, c.rms_norm_eps, hn.data());
  V4Activations x;
  x.sequences = h.sequences;
  x.seq_len = h.seq_len;
  x.hc_mult = hc;
  x.hidden_size = d;
  x.streams.resize(h.streams.size());
  RETURN_IF_ERROR(ApplyLinear(ctx, mtp.h_proj, hn.data(), tokens * hc, x.streams.data()));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < hc; ++j) {
      float* row = x.streams.data() + (t * hc + j) * d;
      for (int64_t i = 0; i < d; ++i) row[i] = ep[t * d + i] + row[i];
    }
  }
  ToModelDtype(ctx, x.streams.data(), tokens * hc * d);
  x.token_ids = std::move(next_ids);
  return RunLayer(ctx, c, mtp.block, x);
}

}  // namespace quantd::model
