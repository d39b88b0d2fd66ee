#include "server/pipeline/stages/shard_output.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/checkpoint/source_weight.h"

namespace quantd::pipeline {
namespace {

// Appends of at least the writer's buffer size go straight to write(); chunks this large keep
// the number of system calls small without ever copying a whole tensor.
constexpr uint64_t kChunkBytes = 64ull << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsWriter>> CreateShardWriter(
    const checkpoint::DirHandle* dir, const std::string& shard,
    std::vector<checkpoint::TensorSpec> tensors) {
  if (dir == nullptr || !dir->is_open()) {
    return absl::InternalError(absl::StrCat(shard, ": the job's directory for it is not open"));
  }
  return checkpoint::SafetensorsWriter::Create(*dir, shard, std::move(tensors),
                                               {{"format", "pt"}});
}

absl::Status AppendChunked(checkpoint::SafetensorsWriter& writer, const void* data, uint64_t size) {
  const uint8_t* bytes = static_cast<const uint8_t*>(data);
  for (uint64_t done = 0; done < size;) {
    const uint64_t n = std::min(kChunkBytes, size - done);
    if (absl::Status s = writer.Append(bytes + done, n); !s.ok()) return s;
    done += n;
  }
  return absl::OkStatus();
}

absl::Status AppendDecodedWeight(const StageContext& ctx, checkpoint::SafetensorsWriter& writer,
                                 const std::string& module) {
  absl::StatusOr<checkpoint::SourceWeight> w =
      checkpoint::FindSourceWeight(*ctx.source, *ctx.inventory, module);
  if (!w.ok()) return w.status();
  absl::StatusOr<checkpoint::HostWeight> decoded = checkpoint::DecodeWeightToHost(*ctx.backend, *w);
  if (!decoded.ok()) return decoded.status();
  if (absl::Status s = AppendChunked(writer, decoded->data, decoded->dense.bytes); !s.ok()) {
    return s;
  }
  checkpoint::ReleaseSource(*ctx.source, *w);
  return absl::OkStatus();
}

absl::StatusOr<TaskOutput> FinishShard(const StageContext& ctx,
                                       checkpoint::SafetensorsWriter& writer,
                                       const std::string& path) {
  // The writer removes its .tmp file when it is destroyed unfinished.
  if (absl::Status s = CheckSourceIntact(ctx); !s.ok()) return s;
  if (absl::Status s = writer.Finish(); !s.ok()) return s;
  TaskOutput out;
  out.path = path;
  out.bytes = writer.total_bytes();
  out.sha256 = writer.sha256();  // hashed while writing: no second read of the file
  return out;
}

absl::Status CheckSourceIntact(const StageContext& ctx) {
  return ctx.source == nullptr ? absl::OkStatus() : ctx.source->CheckIntact();
}

absl::Status CheckCancelled(const StageContext& ctx, const std::string& shard) {
  if (absl::Status s = CheckSourceIntact(ctx); !s.ok()) return s;
  if (ctx.cancelled != nullptr && ctx.cancelled->load(std::memory_order_relaxed)) {
    return absl::CancelledError(absl::StrCat(shard, ": cancelled"));
  }
  return absl::OkStatus();
}

void AddProgress(const StageContext& ctx, uint64_t source_bytes) {
  if (ctx.add_progress) ctx.add_progress(source_bytes);
}

}  // namespace quantd::pipeline
