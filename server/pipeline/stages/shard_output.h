// What the stages that write one safetensors shard of the output (quantize, dequant) share: the
// shard's writer, streaming into it, source weights appended decoded (checkpoint/source_weight.h);
// and with verify, which reads one back: progress, cancellation and the source's integrity.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_SHARD_OUTPUT_H_
#define QUANTD_SERVER_PIPELINE_STAGES_SHARD_OUTPUT_H_

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

// A writer for the shard `shard` (a plain file name) beneath `dir`, the job's output or BF16
// directory handle (StageContext), declaring `tensors` in the given order, with __metadata__
// {"format": "pt"}. Internal error when the job has no such directory open.
absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsWriter>> CreateShardWriter(
    const checkpoint::DirHandle* dir, const std::string& shard,
    std::vector<checkpoint::TensorSpec> tensors);
// Streams `size` bytes of host memory into the writer in large chunks.
absl::Status AppendChunked(checkpoint::SafetensorsWriter& writer, const void* data, uint64_t size);
// Appends the weight of `module` decoded to BF16 (checkpoint::DecodeWeight) and releases its source
// pages.
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

#endif  // QUANTD_SERVER_PIPELINE_STAGES_SHARD_OUTPUT_H_
