#include "server/pipeline/stages/dequant_stage.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/checkpoint/source_weight.h"
#include "server/pipeline/stages/inspect_stage.h"
#include "server/pipeline/stages/shard_output.h"

namespace quantd::pipeline {

using checkpoint::FindLinear;
using checkpoint::FindTensorInfo;
using checkpoint::LinearModule;
using checkpoint::NaturalLess;
using checkpoint::ReleaseSource;
using checkpoint::TensorError;
using checkpoint::TensorFormat;
using checkpoint::TensorInfo;

namespace {

bool Dequantized(TensorFormat f) {
  return f == TensorFormat::kFp8BlockE8m0 || f == TensorFormat::kFp8BlockF32 ||
         f == TensorFormat::kMxfp4;
}

// One tensor of the BF16 shard.
struct OutputEntry {
  checkpoint::TensorSpec spec;
  const checkpoint::TensorView* source = nullptr;  // copied unchanged, or the weight decoded
  std::string module;                              // decoded weights: their module ("" for copies)
};

}  // namespace

absl::StatusOr<std::vector<store::TaskPlan>> DequantStage::Plan(const PlanInput& input) const {
  std::vector<store::TaskPlan> tasks;
  if (input.spec->materialize_bf16.empty()) return tasks;
  const store::TaskRef inspect{std::string(InspectStage::kKind), std::string(InspectStage::kKind)};
  size_t i = 0;
  for (const auto& [shard, bytes] : input.source_shards) {
    tasks.push_back({shard, ToJson(DequantTask{shard}), static_cast<int64_t>(bytes),
                     ShardLabel(i++, input.source_shards.size()), {}, {inspect}});
  }
  return tasks;
}

absl::StatusOr<TaskOutput> DequantStage::Run(const store::TaskRow& task, compute::Device&,
                                             const StageContext& ctx) const {
  ASSIGN_OR_RETURN(DequantTask payload, ParseDequantTask(task.payload_json));
  return RunDequantTask(ctx, payload);
}

absl::StatusOr<TaskOutput> RunDequantTask(const StageContext& ctx, const DequantTask& task) {
  const checkpoint::SafetensorsFile* file = nullptr;
  for (const auto& shard : ctx.source->shards()) {
    if (std::filesystem::path(shard->path()).filename() == task.shard) file = shard.get();
  }
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", task.shard, " is not part of ", ctx.source->dir()));
  }

  std::vector<OutputEntry> entries;
  uint64_t dropped_bytes = 0;  // scale tensors left out, counted as processed at the end
  for (const checkpoint::TensorView& t : file->tensors()) {
    const TensorInfo* info = FindTensorInfo(*ctx.inventory, t.name);
    if (info == nullptr) {
      return TensorError(task.shard, t.name,
                         absl::InvalidArgumentError("not in the source's tensor inventory"));
    }
    if (info->format == TensorFormat::kScale && !info->owner.empty()) {
      const TensorInfo* owner = FindTensorInfo(*ctx.inventory, info->owner);
      if (owner != nullptr && Dequantized(owner->format)) {
        dropped_bytes += t.size;
        continue;
      }
    }
    OutputEntry e;
    e.source = &t;
    if (Dequantized(info->format)) {
      const LinearModule* m = FindLinear(*ctx.inventory, info->module);
      if (m == nullptr) {
        return TensorError(task.shard, t.name,
                           absl::InvalidArgumentError("weight of no linear module"));
      }
      e.spec = {t.name, checkpoint::Dtype::kBF16, {m->out_features, m->in_features}};
      e.module = m->name;
    } else {
      e.spec = {t.name, t.dtype, t.shape};
    }
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const OutputEntry& a, const OutputEntry& b) {
    return NaturalLess(a.spec.name, b.spec.name);
  });

  std::vector<checkpoint::TensorSpec> specs;
  for (const OutputEntry& e : entries) specs.push_back(e.spec);
  absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsWriter>> writer =
      CreateShardWriter(ctx.materialize_bf16_dir, task.shard, std::move(specs));
  if (!writer.ok()) return writer.status();
  const std::string path = ctx.materialize_bf16_dir->PathOf(task.shard);
  for (const OutputEntry& e : entries) {
    if (absl::Status s = CheckCancelled(ctx, task.shard); !s.ok()) return s;
    absl::Status status;
    if (e.module.empty()) {
      status = AppendChunked(**writer, e.source->data, e.source->size);
    } else {
      status = AppendDecodedWeight(ctx, **writer, e.module);
    }
    if (!status.ok()) return status;
    ReleaseSource(*ctx.source, e.source);
    AddProgress(ctx, e.source->size);
  }
  absl::StatusOr<TaskOutput> out = FinishShard(ctx, **writer, path);
  if (out.ok()) AddProgress(ctx, dropped_bytes);
  return out;
}

}  // namespace quantd::pipeline
