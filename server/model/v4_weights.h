// Reading DeepSeek-V4 weights for the forward from a source checkpoint: linear layers decoded
// from FP8-block / MXFP4 by the device's kernels (checkpoint/source_weight.h DecodeWeightRows),
// small parameters (norms, mHC, sinks, biases, tid2eid) converted to float32 / int32. Every
// tensor's dtype and shape are checked against the config; errors name the tensor.
#ifndef QUANTD_SERVER_MODEL_V4_WEIGHTS_H_
#define QUANTD_SERVER_MODEL_V4_WEIGHTS_H_

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/tensor_views.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/source_weight.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/model/v4_config.h"

namespace quantd::model {

// An opened DeepSeek-V4 source checkpoint: its files (shared with whoever else reads the same
// opened checkpoint, so that its shards are mapped once), tensor inventory and config.
struct V4Checkpoint {
  std::shared_ptr<const checkpoint::CheckpointDir> dir;
  checkpoint::TensorInventory inventory;
  V4Config config;
};

// Opens `path` and parses its config.json. InvalidArgument when it is not a DeepSeek-V4 layout.
absl::StatusOr<std::unique_ptr<V4Checkpoint>> OpenV4Checkpoint(
    const std::string& path, const checkpoint::SourceRoots& roots = std::nullopt);
// The same, every file opened beneath `dir` (checkpoint::CheckpointDir::Open(DirHandle)): a job's
// own output read back.
absl::StatusOr<std::unique_ptr<V4Checkpoint>> OpenV4Checkpoint(const checkpoint::DirHandle& dir);
// The same over a checkpoint already opened (a job's source, opened once for all its stages).
absl::StatusOr<std::unique_ptr<V4Checkpoint>> OpenV4Checkpoint(
    std::shared_ptr<const checkpoint::CheckpointDir> dir);

// A linear layer's weight [out, in], dense, in the memory of the backend that decoded it (host
// memory for a CPU backend; a CUDA backend's device memory, with no host copy): BF16 for
// FP8-block, MXFP4 and BF16 sources (the decode is exact), F32 for F32 sources and for NVFP4
// (ModelOpt or compressed-tensors, as quantd writes them: e2m1 * weight_scale * weight_scale_2 is
// exact in float32, not in BF16). It owns its values: the source pages are released once loaded,
// so memory holds only the layers the caller keeps.
struct LinearWeight {
  std::string module;             // official name: "layers.3.attn.wq_a"
  bool quantized_source = false;  // FP8 or MXFP4 on disk: `official` FP8-simulates its input
  // NVFP4 with an input_scale (W4A4; compressed-tensors: 1 / input_global_scale): its input is
  // NVFP4 fake-quantized with it (kernels/nvfp4_fake_quant.h) in both numerics, as the runtime
  // quantizes it. 0 for every other weight, W4A16 NVFP4 included (weights only).
  float input_scale = 0.0f;
  checkpoint::DenseWeight decoded;  // the decoded values (or the source bytes read in place)
  std::vector<uint8_t> copy;        // BF16/F32 values copied out of the mapped source, else empty
  kernels::DenseTensor view;        // the values: decoded.tensor.data or copy

  int64_t out_features() const { return view.rows; }
  int64_t in_features() const { return view.cols; }
};

// Decodes linear `module` with `backend`'s kernels, into `spare` when it is large enough (the
// holder of a weight the caller is done with: RoutedExperts reuses one expert's buffers for the
// next). InvalidArgument when it is missing or its shape is not [out, in], or (NVFP4) a global or
// input scale is not finite and positive.
absl::StatusOr<LinearWeight> LoadLinear(const V4Checkpoint& ckpt, kernels::Backend& backend,
                                        const std::string& module, int64_t out, int64_t in,
                                        kernels::Buffer spare = {});

// A linear layer as its checkpoint stores it, found and checked as LoadLinear finds and checks
// it, for weights kept in their stored form and decoded later from a copy of their bytes (the
// CUDA ops upload a layer's routed experts once and decode each from device memory).
struct StoredLinear {
  std::string module;                 // official name
  checkpoint::TensorFormat format = checkpoint::TensorFormat::kOther;
  int64_t out = 0, in = 0;            // [out, in]
  const checkpoint::TensorView* weight = nullptr;  // codes (or the BF16/F32 values)
  const checkpoint::TensorView* scale = nullptr;   // block scales; nullptr for BF16/F32
  bool quantized_source = false;      // LinearWeight::quantized_source
  float scale_2 = 0.0f;               // NVFP4: weight_scale_2 (compressed-tensors: 1 / global)
  float input_scale = 0.0f;           // NVFP4 W4A4: LinearWeight::input_scale; else 0
};
// Linear `module` [out, in] as stored. InvalidArgument as LoadLinear.
absl::StatusOr<StoredLinear> FindStoredLinear(const V4Checkpoint& ckpt, const std::string& module,
                                              int64_t out, int64_t in);
// The LinearWeight LoadLinear gives for `s`, decoded by `backend` from a copy of its stored bytes
// in the backend's memory (`weight`: s.weight->size bytes, `scales`: s.scale->size bytes, or
// nullptr), into `spare` when it is large enough. BF16 and F32 values are not copied: the view
// reads `weight` itself, which must outlive the result. Errors name the weight.
absl::StatusOr<LinearWeight> DecodeStoredLinear(kernels::Backend& backend, const StoredLinear& s,
                                                const void* weight, const void* scales,
                                                kernels::Buffer spare = {});

// What LoadLinear checks before it decodes (the module is present, [out, in], its tensors of the
// sizes its format needs), without decoding it: for weights decoded later (RoutedExperts).
absl::Status CheckLinear(const V4Checkpoint& ckpt, const std::string& module, int64_t out,
                         int64_t in);

// Drops the resident pages of a tensor of the mapped source once it has been copied out, so that
// memory stays flat as the forward moves through the layers.
void ReleasePages(const V4Checkpoint& ckpt, const checkpoint::TensorView& tensor);

// A BF16 or F32 tensor of exactly `shape` as float32.
absl::StatusOr<std::vector<float>> LoadFloats(const V4Checkpoint& ckpt, const std::string& name,
                                              const std::vector<int64_t>& shape);

// Like LoadFloats, but an absent tensor gives `fallback` values (the official loader's
// strict=False: attn_sink is absent in some releases).
absl::StatusOr<std::vector<float>> LoadFloatsOr(const V4Checkpoint& ckpt, const std::string& name,
                                                const std::vector<int64_t>& shape, float fallback);

// tid2eid: I64 or I32 [vocab, topk], every id in [0, experts) and distinct within a row (the
// official MoE adds a repeated expert only once, transformers twice).
absl::StatusOr<std::vector<int32_t>> LoadExpertIds(const V4Checkpoint& ckpt,
                                                   const std::string& name, int64_t vocab,
                                                   int64_t topk, int64_t experts);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_WEIGHTS_H_
