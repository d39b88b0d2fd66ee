#include "server/model/v4_device_weights.h"

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"

namespace quantd::model {
namespace {

// Takes over the values LoadLinear decoded on ctx's device (LinearWeight::host.dense), or copies
// the host view there when they were decoded elsewhere (another device, the CPU, read in place).
absl::StatusOr<DeviceLinear> UploadLinear(const DeviceForwardContext& ctx, LinearWeight& w) {
  DeviceLinear d;
  d.module = w.module;
  d.quantized_source = w.quantized_source;
  d.input_scale = w.input_scale;
  const size_t bytes = static_cast<size_t>(w.view.rows * w.view.cols) *
                       (w.view.type == kernels::FloatType::kBF16 ? 2 : 4);
  checkpoint::DenseWeight& decoded = w.host.dense;
  if (decoded.holder.data() != nullptr && decoded.tensor.data == decoded.holder.data() &&
      decoded.tensor.type == w.view.type && decoded.bytes == bytes &&
      IsMemoryOf(ctx, decoded.holder.data())) {
    d.values = std::move(decoded.holder);
  } else {
    ASSIGN_OR_RETURN(d.values, ctx.device->backend().Allocate(bytes));
    RETURN_IF_ERROR(CopyToDevice(w.view.data, bytes, d.values.data(), w.module));
  }
  d.view = w.view;
  d.view.data = d.values.data();
  return d;
}

absl::StatusOr<DeviceHyperConnection> UploadHc(const DeviceForwardContext& ctx,
                                               const HyperConnectionWeights& w,
                                               const std::string& what) {
  DeviceHyperConnection d;
  ASSIGN_OR_RETURN(d.fn, UploadArray(ctx, w.fn, what + "fn"));
  ASSIGN_OR_RETURN(d.base, UploadArray(ctx, w.base, what + "base"));
  ASSIGN_OR_RETURN(d.scale, UploadArray(ctx, w.scale, what + "scale"));
  return d;
}

absl::StatusOr<DeviceCompressor> UploadCompressor(const DeviceForwardContext& ctx,
                                                  V4CompressorWeights& w) {
  DeviceCompressor d;
  ASSIGN_OR_RETURN(d.wkv, UploadLinear(ctx, w.wkv));
  ASSIGN_OR_RETURN(d.wgate, UploadLinear(ctx, w.wgate));
  ASSIGN_OR_RETURN(d.ape, UploadArray(ctx, w.ape, w.wkv.module + " ape"));
  ASSIGN_OR_RETURN(d.norm, UploadArray(ctx, w.norm, w.wkv.module + " norm"));
  return d;
}

absl::StatusOr<DeviceExpert> UploadExpert(const DeviceForwardContext& ctx, ExpertWeights& w) {
  DeviceExpert d;
  ASSIGN_OR_RETURN(d.w1, UploadLinear(ctx, w.w1));
  ASSIGN_OR_RETURN(d.w2, UploadLinear(ctx, w.w2));
  ASSIGN_OR_RETURN(d.w3, UploadLinear(ctx, w.w3));
  return d;
}

absl::StatusOr<DeviceAttention> UploadAttention(const DeviceForwardContext& ctx,
                                                V4AttentionWeights& w) {
  DeviceAttention d;
  ASSIGN_OR_RETURN(d.wq_a, UploadLinear(ctx, w.wq_a));
  ASSIGN_OR_RETURN(d.wq_b, UploadLinear(ctx, w.wq_b));
  ASSIGN_OR_RETURN(d.wkv, UploadLinear(ctx, w.wkv));
  ASSIGN_OR_RETURN(d.wo_a, UploadLinear(ctx, w.wo_a));
  ASSIGN_OR_RETURN(d.wo_b, UploadLinear(ctx, w.wo_b));
  ASSIGN_OR_RETURN(d.q_norm, UploadArray(ctx, w.q_norm, w.wq_a.module + " q_norm"));
  ASSIGN_OR_RETURN(d.kv_norm, UploadArray(ctx, w.kv_norm, w.wkv.module + " kv_norm"));
  ASSIGN_OR_RETURN(d.attn_sink, UploadArray(ctx, w.attn_sink, w.wkv.module + " attn_sink"));
  if (w.compressor) {
    ASSIGN_OR_RETURN(DeviceCompressor c, UploadCompressor(ctx, *w.compressor));
    d.compressor = std::move(c);
  }
  if (w.indexer) {
    DeviceIndexer idx;
    ASSIGN_OR_RETURN(idx.wq_b, UploadLinear(ctx, w.indexer->wq_b));
    ASSIGN_OR_RETURN(idx.weights_proj, UploadLinear(ctx, w.indexer->weights_proj));
    ASSIGN_OR_RETURN(idx.compressor, UploadCompressor(ctx, w.indexer->compressor));
    d.indexer = std::move(idx);
  }
  return d;
}

absl::StatusOr<DeviceMoe> UploadMoe(const DeviceForwardContext& ctx, MoeWeights& w) {
  DeviceMoe d;
  ASSIGN_OR_RETURN(d.gate, UploadLinear(ctx, w.gate));
  d.hash = !w.tid2eid.empty();
  if (d.hash) {
    ASSIGN_OR_RETURN(d.tid2eid, UploadArray(ctx, w.tid2eid, w.gate.module + ".tid2eid"));
  } else {
    ASSIGN_OR_RETURN(d.bias, UploadArray(ctx, w.bias, w.gate.module + ".bias"));
  }
  // Every routed expert is decoded on the host and uploaded in BF16/F32, all of them resident on
  // the device (the host forward decodes them one at a time instead).
  d.experts.reserve(static_cast<size_t>(w.experts.size()));
  for (int64_t e = 0; e < w.experts.size(); ++e) {
    ASSIGN_OR_RETURN(ExpertWeights decoded, w.experts.Decode(e));
    ASSIGN_OR_RETURN(DeviceExpert de, UploadExpert(ctx, decoded));
    d.experts.push_back(std::move(de));
  }
  ASSIGN_OR_RETURN(d.shared, UploadExpert(ctx, w.shared));
  return d;
}

}  // namespace

absl::StatusOr<V4DeviceLayerWeights> UploadLayer(const DeviceForwardContext& ctx,
                                                 const V4Config& config, V4LayerWeights layer) {
  RETURN_IF_ERROR(ValidateAttentionWeights(config, layer.layer, layer.attn));
  RETURN_IF_ERROR(UseDevice(ctx));
  const std::string p = absl::StrCat("layers.", layer.layer, ".");
  V4DeviceLayerWeights d;
  d.layer = layer.layer;
  d.cuda_index = ctx.cuda_index;
  ASSIGN_OR_RETURN(d.hc_attn, UploadHc(ctx, layer.hc_attn, p + "hc_attn_"));
  ASSIGN_OR_RETURN(d.hc_ffn, UploadHc(ctx, layer.hc_ffn, p + "hc_ffn_"));
  ASSIGN_OR_RETURN(d.attn_norm, UploadArray(ctx, layer.attn_norm, p + "attn_norm.weight"));
  ASSIGN_OR_RETURN(d.ffn_norm, UploadArray(ctx, layer.ffn_norm, p + "ffn_norm.weight"));
  ASSIGN_OR_RETURN(d.attn, UploadAttention(ctx, layer.attn));
  ASSIGN_OR_RETURN(d.moe, UploadMoe(ctx, layer.moe));
  return d;
}

}  // namespace quantd::model
