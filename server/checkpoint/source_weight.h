// A linear module's weight in the source checkpoint, as the quantize, dequant and verify stages
// and the DeepSeek-V4 forward (model/v4_weights.h) read it: finding its source tensors by the
// inventory, moving bytes between host memory (the mmapped source) and a kernel backend's memory,
// decoding it to a dense tensor, and errors that name the shard and the tensor.
#ifndef QUANTD_SERVER_CHECKPOINT_SOURCE_WEIGHT_H_
#define QUANTD_SERVER_CHECKPOINT_SOURCE_WEIGHT_H_

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/tensor_inventory.h"

namespace quantd::checkpoint {

// nullptr when the inventory has no such tensor / module.
const TensorInfo* FindTensorInfo(const TensorInventory& inventory, const std::string& name);
const LinearModule* FindLinear(const TensorInventory& inventory, const std::string& name);

// File name of the source shard holding `tensor` ("" when absent).
std::string SourceShardOf(const CheckpointDir& source, const std::string& tensor);
// `status` with "<shard>: tensor <tensor>: " in front of its message, code unchanged.
absl::Status TensorError(const std::string& shard, const std::string& tensor,
                         const absl::Status& status);

// The source tensors of a linear module, their sizes checked against its format and shape.
struct SourceWeight {
  const LinearModule* module = nullptr;            // format and logical shape
  std::string shard;                               // source shard of the weight, for errors
  const TensorView* weight = nullptr;              // the stored weight
  const TensorView* scale = nullptr;               // its scales; nullptr for BF16 / F32 weights
};
absl::StatusOr<SourceWeight> FindSourceWeight(const CheckpointDir& source,
                                              const TensorInventory& inventory,
                                              const std::string& module);
// Releases the mapped source pages of a tensor, or of a module's weight and scales, once a task
// is done with them (SafetensorsFile::ReleasePages), so memory does not grow with shard size.
void ReleaseSource(const CheckpointDir& source, const TensorView* tensor);
void ReleaseSource(const CheckpointDir& source, const SourceWeight& w);
// TensorError for the weight of `w`.
absl::Status WeightError(const SourceWeight& w, const absl::Status& status);

// Host bytes as the backend's kernels can read them: `host` itself on a host backend when it is
// aligned for `align`-byte elements, else a copy owned by *holder.
absl::StatusOr<const void*> ToBackend(kernels::Backend& backend, const void* host, size_t bytes,
                                      size_t align, kernels::Buffer* holder);
// Backend bytes as host memory: `data` itself on a host backend, else a copy in *staging.
absl::StatusOr<const void*> ToHost(kernels::Backend& backend, const void* data, size_t bytes,
                                   std::vector<uint8_t>* staging);

// An MXFP4 source weight in the backend's memory. Errors name the weight.
struct BackendMxfp4 {
  kernels::Buffer data_holder;    // copy of the codes, when kernels cannot read the source
  kernels::Buffer scales_holder;  // copy of the scales, likewise
  kernels::Mxfp4Tensor tensor;    // the view kernels take
};
absl::StatusOr<BackendMxfp4> StageMxfp4(kernels::Backend& backend, const SourceWeight& w);

// A source weight as a dense tensor in the backend's memory: FP8-block and MXFP4 weights decoded
// to BF16 (the official formulas, RNE), BF16 and F32 weights as they are. Errors (a NaN scale
// byte, ...) name the weight and the element.
struct DenseWeight {
  kernels::Buffer holder;       // the decoded or copied values (empty when read in place)
  kernels::DenseTensor tensor;  // the view kernels take
  size_t bytes = 0;             // of tensor.data
};
absl::StatusOr<DenseWeight> DecodeWeight(kernels::Backend& backend, const SourceWeight& w);
// The same for rows [row_begin, row_end) of the weight only. An FP8-block weight is decoded in
// whole blocks: row_begin must be a multiple of kernels::kFp8BlockSize, and so must row_end
// unless it is the last row (InvalidArgument otherwise). Decoded rows go into `spare` when it is
// large enough (a caller stepping through a weight hands back each step's holder), else into a
// new buffer.
absl::StatusOr<DenseWeight> DecodeWeightRows(kernels::Backend& backend, const SourceWeight& w,
                                             int64_t row_begin, int64_t row_end,
                                             kernels::Buffer spare = {});

// DecodeWeight's values readable from host memory (in place on a host backend).
struct HostWeight {
  DenseWeight dense;             // the decoded values, in backend memory
  std::vector<uint8_t> staging;  // their host copy when the backend computes on device memory
  const void* data = nullptr;    // host view of the values: dense.tensor.data or staging
};
// `spare` as DecodeWeightRows takes it: a caller decoding weights of one shape in turn hands back
// the last one's holder, so that no decode allocates (and faults in) fresh pages.
absl::StatusOr<HostWeight> DecodeWeightToHost(kernels::Backend& backend, const SourceWeight& w,
                                              kernels::Buffer spare = {});

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_SOURCE_WEIGHT_H_
