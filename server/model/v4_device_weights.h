// One DeepSeek-V4 decoder layer's weights resident in CUDA device memory (CUDA builds only), in
// their decoded dtype (BF16 for FP8/MXFP4/BF16 sources, F32 for F32 and NVFP4): LoadLayer on the
// CUDA device decodes every linear with the device's kernels into device memory (and stages a
// host copy, v4_weights.h); UploadLayer keeps those device values and drops the host copies, so
// that a layer costs its decoded size on the device and nothing on the host. Weights decoded
// elsewhere, and the small float32 parameters, are copied over.
#ifndef QUANTD_SERVER_MODEL_V4_DEVICE_WEIGHTS_H_
#define QUANTD_SERVER_MODEL_V4_DEVICE_WEIGHTS_H_

#include <stdint.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor_views.h"
#include "server/model/v4_device_context.h"
#include "server/model/v4_layer.h"

namespace quantd::model {

// A linear layer's weight [out, in] on the device, with what ApplyLinear needs of LinearWeight.
struct DeviceLinear {
  std::string module;             // LinearWeight::module
  bool quantized_source = false;  // LinearWeight::quantized_source
  float input_scale = 0.0f;       // LinearWeight::input_scale
  kernels::Buffer values;         // the decoded values, view.type's dtype
  kernels::DenseTensor view;      // view.data: device pointer into `values`

  int64_t out_features() const { return view.rows; }
  int64_t in_features() const { return view.cols; }
};

struct DeviceHyperConnection {  // HyperConnectionWeights
  DeviceArray<float> fn, base, scale;
};

struct DeviceCompressor {  // V4CompressorWeights
  DeviceLinear wkv, wgate;
  DeviceArray<float> ape, norm;
};

struct DeviceIndexer {  // V4IndexerWeights
  DeviceLinear wq_b, weights_proj;
  DeviceCompressor compressor;
};

struct DeviceAttention {  // V4AttentionWeights
  DeviceLinear wq_a, wq_b, wkv, wo_a, wo_b;
  DeviceArray<float> q_norm, kv_norm, attn_sink;
  std::optional<DeviceCompressor> compressor;
  std::optional<DeviceIndexer> indexer;
};

struct DeviceExpert {  // ExpertWeights
  DeviceLinear w1, w2, w3;
};

struct DeviceMoe {  // MoeWeights
  DeviceLinear gate;
  DeviceArray<float> bias;       // score-routed layers
  DeviceArray<int32_t> tid2eid;  // hash layers, [vocab, topk]
  bool hash = false;
  std::vector<DeviceExpert> experts;
  DeviceExpert shared;
};

struct V4DeviceLayerWeights {  // V4LayerWeights
  int64_t layer = 0;
  int cuda_index = 0;  // the device they are on
  DeviceHyperConnection hc_attn, hc_ffn;
  DeviceArray<float> attn_norm, ffn_norm;
  DeviceAttention attn;
  DeviceMoe moe;
};

// `layer` (as LoadLayer returns it, on ctx's device or any other) resident on ctx's device.
// InvalidArgument for attention weights that fail ValidateAttentionWeights; ResourceExhausted
// (naming the tensor) when the device memory runs out.
absl::StatusOr<V4DeviceLayerWeights> UploadLayer(const DeviceForwardContext& ctx,
                                                 const V4Config& config, V4LayerWeights layer);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_DEVICE_WEIGHTS_H_
