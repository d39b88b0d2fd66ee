// What one DeepSeek-V4 decoder layer's forward holds in memory (LoadLayer + RunLayer on the
// host), from the checkpoint's own tensors, so it follows the formats on disk: the dense weights
// (attention, router, shared expert) decoded and resident, the small parameters as float32, and
// one routed expert decoded at a time (MoeForward); the other routed experts stay in the mapped
// source, file pages the kernel can drop, not memory the forward allocates. Stages state their
// layer tasks' memory from it (compute::DeviceRequirement), so placement never runs more layer
// tasks on a device than fit.
#ifndef QUANTD_SERVER_MODEL_V4_MEMORY_H_
#define QUANTD_SERVER_MODEL_V4_MEMORY_H_

#include <stdint.h>

#include <string>

#include "server/checkpoint/tensor_inventory.h"

namespace quantd::model {

struct LayerMemory {
  int64_t dense_bytes = 0;          // decoded dense linears and float32 parameters
  int64_t expert_bytes = 0;         // the largest routed expert, decoded
  int64_t stored_expert_bytes = 0;  // every routed expert as stored (read through the mapping)

  int64_t resident_bytes() const { return dense_bytes + expert_bytes; }
};

// How a linear decodes: each module as its format decodes (2 bytes per value for FP8, MXFP4 and
// BF16 weights, 4 for F32 and NVFP4), or every module as float32 (a quantized model that is not
// written yet, whose NVFP4 modules will decode to float32).
enum class DecodedWidth { kAsStored, kFloat32 };

// The memory of the block under `prefix` ("layers.3.", "mtp.0.") of the checkpoint `inventory`
// describes.
LayerMemory EstimateLayerMemory(const checkpoint::TensorInventory& inventory,
                                const std::string& prefix, DecodedWidth width);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_MEMORY_H_
