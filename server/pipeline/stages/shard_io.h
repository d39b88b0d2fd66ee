// What the stages that write one safetensors shard from the source checkpoint (quantize,
// dequant) share: finding a module's source tensors, moving bytes between host memory (the
// mmapped source, the writer) and the backend's memory, decoding a source weight, streaming into
// the writer, progress, cancellation, and errors that name the shard and the tensor.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_SHARD_IO_H_
#define QUANTD_SERVER_PIPELINE_STAGES_SHARD_IO_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/pipeline/stage.h"
#include "server/pipeline/tensor_inventory.h"

namespace quantd::pipeline {

// nullptr when the inventory has no such tensor / module.
const TensorInfo* FindTensorInfo(const TensorInventory& inventory, const std::string& name);
const LinearModule* FindLinear(const TensorInventory& inventory, const std::string& name);

// File name of the source shard holding `tensor` ("" when absent).
std::string SourceShardOf(const StageContext& ctx, const std::string& tensor);
// `status` with "<shard>: tensor <tensor>: " in front of its message, code unchanged.
absl::Status TensorError(const std::string& shard, const std::string& tensor,
                         const absl::Status& status);

// The source tensors of a linear module, their sizes checked against its format and shape.
struct SourceWeight {
  const LinearModule* module = nullptr;            // format and logical shape
  std::string shard;                               // source shard of the weight, for errors
  const checkpoint::TensorView* weight = nullptr;  // the stored weight
  const checkpoint::TensorView* scale = nullptr;   // its scales; nullptr for BF16 / F32 weights
};
absl::StatusOr<SourceWeight> FindSourceWeight(const StageContext& ctx, const std::string& module);
// Releases the mapped source pages of a tensor, or of a module's weight and scales, once a task
// is done with them (SafetensorsFile::ReleasePages), so memory does not grow with shard size.
void ReleaseSource(const StageContext& ctx, const checkpoint::TensorView* tensor);
void ReleaseSource(const StageContext& ctx, const SourceWeight& w);
// TensorError for the weight of `w`.
absl::Status WeightError(const SourceWeight& w, const absl::Status& status);

// Whether the backend's kernels work on host memory (the CPU backends, named "cpu-*" in
// backend.h): host pointers can then be handed to them and their buffers read in place.
bool ComputesOnHost(const kernels::Backend& backend);
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
absl::StatusOr<HostWeight> DecodeWeightToHost(kernels::Backend& backend, const SourceWeight& w);

// Creates the directory of `path` (and its parents) and a writer for `path` declaring `tensors`
// in the given order, with __metadata__ {"format": "pt"}.
absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsWriter>> CreateShardWriter(
    const std::string& path, std::vector<checkpoint::TensorSpec> tensors);
// Streams `size` bytes of host memory into the writer in large chunks.
absl::Status AppendChunked(checkpoint::SafetensorsWriter& writer, const void* data, uint64_t size);
// Appends the weight of `module` decoded to BF16 (DecodeWeight) and releases its source pages.
absl::Status AppendDecodedWeight(const StageContext& ctx, checkpoint::SafetensorsWriter& writer,
                                 const std::string& module);
// Finishes the writer (fsync, rename) and describes the file: path, size, SHA-256. Refuses (and
// removes the .tmp file) when a source shard shrank while the task read it (CheckSourceIntact).
absl::StatusOr<TaskOutput> FinishShard(const StageContext& ctx,
                                       checkpoint::SafetensorsWriter& writer,
                                       const std::string& path);

// DataLoss naming the source shard that shrank under the job (its mapped reads saw zeros:
// checkpoint/mapped_region_guard.h); the job fails, the process lives.
absl::Status CheckSourceIntact(const StageContext& ctx);
// Cancelled, naming the shard, once ctx.cancelled is set; CheckSourceIntact's DataLoss before that.
absl::Status CheckCancelled(const StageContext& ctx, const std::string& shard);
void AddProgress(const StageContext& ctx, uint64_t source_bytes);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_SHARD_IO_H_
