// Tensor inventory: what every tensor of a checkpoint is.
//
// Each tensor gets a storage format (detected from its dtype and its sibling scale tensors), the
// module it belongs to (its name up to the last '.': "layers.0.attn.wq_a.weight" and
// "layers.0.attn.wq_a.scale" both belong to "layers.0.attn.wq_a") and, for scale tensors, the
// weight they belong to. Detected formats:
//   fp8_block_e8m0  F8_E4M3 `.weight` + F8_E8M0 `<module>.scale` [ceil(out/128), ceil(in/128)] (V4)
//   fp8_block_f32   F8_E4M3 `.weight` + F32 `<weight>_scale_inv` or `<module>.scale`, same shape
//                   (V3, V4-Base)
//   mxfp4           I8 `.weight` [out, in/2] + F8_E8M0 `<module>.scale` [out, in/32] (V4 experts)
//   nvfp4           U8 `.weight` [out, in/2] + F8_E4M3 `.weight_scale` [out, in/16] + F32
//                   `.weight_scale_2` (one element), optional F32 `.input_scale` (ModelOpt)
//   nvfp4_compressed_tensors  U8 `.weight_packed` + F8_E4M3 `.weight_scale` + F32
//                   `.weight_global_scale` [1], optional `.input_global_scale` [1]
//   bf16, f32       unquantized tensors of those dtypes
//   scale           a scale tensor of one of the weights above, or a KV-cache `.k_scale`/`.v_scale`
//   other           anything else (I64 tid2eid, F16, ...)
// A quantized weight without its scale, a scale of the wrong dtype or shape, or a scale-named
// tensor without a weight is an error that names the tensors.
#ifndef QUANTD_SERVER_CHECKPOINT_TENSOR_INVENTORY_H_
#define QUANTD_SERVER_CHECKPOINT_TENSOR_INVENTORY_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/dtype.h"

namespace quantd::checkpoint {

enum class TensorFormat {
  kFp8BlockE8m0,
  kFp8BlockF32,
  kMxfp4,
  kNvfp4,
  kNvfp4CompressedTensors,
  kBf16,
  kF32,
  kScale,
  kOther,
};
// "fp8_block_e8m0", "fp8_block_f32", "mxfp4", "nvfp4", "nvfp4_compressed_tensors", "bf16", "f32",
// "scale", "other".
std::string FormatName(TensorFormat f);

enum class ModelArch { kDeepseekV4, kDeepseekV3, kUnknown };
// "deepseek_v4", "deepseek_v3", "unknown".
std::string ArchName(ModelArch a);

struct TensorInfo {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  std::string shard;    // file name of the shard holding it
  TensorFormat format;  // the weight's format for weights, kScale for their scales
  std::string module;   // name up to the last '.' ("" for a top-level tensor)
  std::string owner;    // kScale: the weight tensor it belongs to ("" for KV-cache scales)
};

// A module with a 2-D weight (`.weight` or `.weight_packed`): a linear layer or an embedding.
// These are the units recipes select.
struct LinearModule {
  std::string name;
  TensorFormat format;                // of the weight
  int64_t out_features = 0;           // logical shape, FP4 packing undone
  int64_t in_features = 0;
  std::vector<std::string> tensors;   // the weight, then its scale tensors
  uint64_t bytes = 0;                 // of those tensors
};

struct TensorInventory {
  ModelArch arch = ModelArch::kUnknown;
  std::string model_type;             // config.json model_type ("" when absent)
  int64_t num_hidden_layers = 0;      // config.json (V3: the MTP layer's index); 0 when absent
  std::vector<TensorInfo> tensors;    // natural order of names
  std::vector<LinearModule> linears;  // natural order of names
};

absl::StatusOr<TensorInventory> BuildInventory(const CheckpointDir& dir);

// "layers.0.attn.wq_a.weight" -> "weight" (the whole name when it has no '.').
std::string LeafName(const std::string& name);
// "layers.0.attn.wq_a.weight" -> "layers.0.attn.wq_a" ("" when the name has no '.').
std::string ModuleOf(const std::string& name);
// "[2048, 4096]".
std::string ShapeString(const std::vector<int64_t>& shape);

// Natural order: runs of digits compare as numbers, so "layers.2" < "layers.10".
bool NaturalLess(absl::string_view a, absl::string_view b);

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_TENSOR_INVENTORY_H_
