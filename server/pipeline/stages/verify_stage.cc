// Verify: re-reads one output shard, checks it against the plan and the export rules (its header,
// every scale tensor, BF16-written modules against their decoded source), then checks that the
// file holds the bytes the quantize task recorded. When this process recorded that task, which
// hashed every byte as it wrote it, the size is checked and the bytes are not hashed again (each
// output byte is hashed once); a shard recorded by an earlier process (a resumed job) or a job
// with verify.deep is read back whole and re-hashed. The error statistics of its modules were
// measured by the quantize task from those same bytes (quantize_stage.h), so verify does not
// decode the source or the output again.
#include "server/pipeline/stages/verify_stage.h"

#include <algorithm>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/source_weight.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/pipeline/stages/quantize_stage.h"
#include "server/pipeline/stages/shard_output.h"
#include "server/pipeline/stages/verify_rules.h"

namespace quantd::pipeline {

using checkpoint::DecodeWeightToHost;
using checkpoint::FindLinear;
using checkpoint::FindSourceWeight;
using checkpoint::HostWeight;
using checkpoint::LinearModule;
using checkpoint::ReleaseSource;
using checkpoint::ShapeString;
using checkpoint::SourceWeight;

using job::WeightFormat;

namespace {

using checkpoint::Dtype;
using checkpoint::TensorView;

// The shard holds exactly the planned tensors, with the planned dtypes and shapes.
void CheckShardContents(const StageContext& ctx, const ShardTask& task,
                        const std::map<std::string, const LinearModule*>& linears,
                        const checkpoint::SafetensorsFile& shard,
                        std::vector<Violation>* out) {
  struct Expected {
    Dtype dtype;
    std::vector<int64_t> shape;
  };
  std::map<std::string, Expected> expected;
  for (const std::string& name : task.copy_tensors) {
    const TensorView* src = ctx.source->Find(name);
    if (src != nullptr) expected[name] = {src->dtype, src->shape};
  }
  for (const std::string& module : task.modules) {
    auto it = linears.find(module);
    if (it == linears.end()) continue;
    for (const OutputTensor& t : Nvfp4ModuleTensors(*ctx.spec, module, it->second->out_features,
                                                    it->second->in_features)) {
      expected[t.name] = {t.dtype, t.shape};
    }
  }
  for (const std::string& module : task.bf16_modules) {
    const LinearModule* m = FindLinear(*ctx.inventory, module);
    if (m != nullptr) expected[module + ".weight"] = {Dtype::kBF16, {m->out_features, m->in_features}};
  }
  for (const auto& [name, want] : expected) {
    const TensorView* v = shard.Find(name);
    if (v == nullptr) {
      out->push_back({kRuleShardContents, name, "planned tensor is missing from the shard"});
    } else if (v->dtype != want.dtype || v->shape != want.shape) {
      out->push_back({kRuleShardContents, name,
                      absl::StrCat("is ", std::string(checkpoint::DtypeName(v->dtype)), " ",
                                   ShapeString(v->shape), ", planned ",
                                   std::string(checkpoint::DtypeName(want.dtype)), " ",
                                   ShapeString(want.shape))});
    }
  }
  for (const TensorView& v : shard.tensors()) {
    if (expected.count(v.name) == 0) {
      out->push_back({kRuleShardContents, v.name, "tensor is not in the plan for this shard"});
    }
  }
}

// A module written as BF16 must equal its source decoded the official way, bit for bit.
absl::Status CheckBf16Module(const StageContext& ctx, const std::string& module,
                             const TensorView& written, std::vector<Violation>* out) {
  absl::StatusOr<SourceWeight> w = FindSourceWeight(*ctx.source, *ctx.inventory, module);
  if (!w.ok()) return w.status();
  absl::StatusOr<HostWeight> decoded = DecodeWeightToHost(*ctx.backend, *w);
  if (!decoded.ok()) return decoded.status();
  const uint16_t* want = static_cast<const uint16_t*>(decoded->data);
  const uint16_t* got = reinterpret_cast<const uint16_t*>(written.data);
  const size_t n = decoded->dense.bytes / 2;
  for (size_t i = 0; i < n; ++i) {
    if (want[i] == got[i]) continue;
    out->push_back({kRuleShardContents, written.name,
                    absl::StrCat("BF16 weight differs from the decoded source at element ", i)});
    break;
  }
  ReleaseSource(*ctx.source, *w);
  return absl::OkStatus();
}

// Checks the shard is what the quantize task of its shard recorded: its size, and, when `rehash`,
// its SHA-256 over the whole file read back through its mapping (the same bytes the rules were
// checked on), with progress in proportion to the bytes read. Returns the bytes re-hashed.
absl::StatusOr<uint64_t> CheckRecordedBytes(const StageContext& ctx, const ShardTask& task,
                                            const checkpoint::SafetensorsFile& shard,
                                            const RecordedOutput& recorded, uint64_t source_bytes) {
  const std::string& path = shard.path();
  if (shard.file_size() != static_cast<uint64_t>(recorded.bytes)) {
    return absl::DataLossError(absl::StrCat(path, ": ", shard.file_size(),
                                            " bytes, but the quantize task wrote ",
                                            recorded.bytes));
  }
  if (!ctx.spec->verify.deep && recorded.written_by_this_process) {
    AddProgress(ctx, source_bytes);
    return 0;
  }
  uint64_t read = 0, reported = 0;
  const uint64_t size = recorded.bytes > 0 ? static_cast<uint64_t>(recorded.bytes) : 1;
  ASSIGN_OR_RETURN(const std::string sha256, shard.Sha256([&](uint64_t n) -> absl::Status {
    RETURN_IF_ERROR(CheckCancelled(ctx, task.shard));
    read += n;
    const uint64_t due =
        static_cast<uint64_t>(static_cast<double>(source_bytes) * std::min(read, size) / size);
    AddProgress(ctx, due - reported);
    reported = due;
    return absl::OkStatus();
  }));
  if (read != static_cast<uint64_t>(recorded.bytes) || sha256 != recorded.sha256) {
    return absl::DataLossError(absl::StrCat(
        path, ": read back, its ", read, " bytes are not the ", recorded.bytes,
        " bytes the quantize task wrote (SHA-256 ", sha256, ", recorded ", recorded.sha256, ")"));
  }
  AddProgress(ctx, source_bytes - reported);
  return read;
}

}  // namespace

absl::StatusOr<std::vector<store::TaskPlan>> VerifyStage::Plan(const PlanInput& input) const {
  std::vector<store::TaskPlan> tasks;
  for (size_t i = 0; i < input.output_shards.size(); ++i) {
    const OutputShard& shard = input.output_shards[i];
    const store::TaskRef quantized{std::string(QuantizeStage::kKind), shard.task.shard};
    tasks.push_back({shard.task.shard, ToJson(shard.task), static_cast<int64_t>(shard.source_bytes),
                     ShardLabel(i, input.output_shards.size()), {}, {quantized}});
  }
  return tasks;
}

absl::StatusOr<TaskOutput> VerifyStage::Run(const store::TaskRow& task, compute::Device&,
                                            const StageContext& ctx) const {
  ASSIGN_OR_RETURN(ShardTask payload, ParseShardTask(task.payload_json));
  return RunVerifyTask(ctx, payload);
}

absl::StatusOr<TaskOutput> RunVerifyTask(const StageContext& ctx, const ShardTask& task) {
  if (ctx.output_dir == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(task.shard, ": the job's output directory is not open"));
  }
  // Read back beneath the handle the quantize task wrote through: a path swapped since cannot
  // lead the read to another file.
  const std::string path = ctx.output_dir->PathOf(task.shard);
  const std::optional<RecordedOutput> recorded =
      ctx.recorded_output ? ctx.recorded_output(QuantizeStage::kKind, task.shard) : std::nullopt;
  if (!recorded.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": the quantize task of ", task.shard, " recorded no output"));
  }
  absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsFile>> shard =
      checkpoint::SafetensorsFile::Open(*ctx.output_dir, task.shard);
  if (!shard.ok()) return shard.status();

  std::map<std::string, const LinearModule*> linears;
  for (const std::string& module : task.modules) {
    const LinearModule* m = FindLinear(*ctx.inventory, module);
    if (m == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(task.shard, ": planned module ", module, " is not in the source"));
    }
    linears[module] = m;
  }

  // Both files are mapped: what was read from them counts only while they are intact.
  const auto intact = [&] {
    absl::Status s = CheckSourceIntact(ctx);
    return s.ok() ? (*shard)->CheckIntact() : s;
  };
  std::vector<Violation> violations;
  CheckShardContents(ctx, task, linears, **shard, &violations);
  std::vector<const TensorView*> views;
  for (const TensorView& v : (*shard)->tensors()) views.push_back(&v);
  const std::vector<Nvfp4ModuleViews> modules = FindNvfp4Modules(views);
  CheckNvfp4Modules(modules, ctx.spec->weight_format == WeightFormat::kNvfp4, &violations);
  if (absl::Status s = intact(); !s.ok()) return s;
  if (!violations.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", violations.size(),
                                                   " export rule violation(s):\n",
                                                   FormatViolations(violations)));
  }

  uint64_t source_bytes = 0;  // of the shard's source tensors, for progress
  for (const std::string& module : task.modules) source_bytes += linears.at(module)->bytes;
  for (const std::string& module : task.bf16_modules) {
    if (absl::Status s = CheckCancelled(ctx, task.shard); !s.ok()) return s;
    const LinearModule* m = FindLinear(*ctx.inventory, module);
    if (m == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(task.shard, ": planned module ", module, " is not in the source"));
    }
    // CheckShardContents has seen the weight with the planned dtype and shape.
    const TensorView& written = *(*shard)->Find(module + ".weight");
    if (absl::Status s = CheckBf16Module(ctx, module, written, &violations); !s.ok()) return s;
    (*shard)->ReleasePages(written);
    source_bytes += m->bytes;
  }
  if (absl::Status s = intact(); !s.ok()) return s;
  if (!violations.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", violations.size(),
                                                   " export rule violation(s):\n",
                                                   FormatViolations(violations)));
  }
  for (const std::string& name : task.copy_tensors) {
    const TensorView* src = ctx.source->Find(name);
    if (src != nullptr) source_bytes += src->size;
  }
  for (const TensorView& v : (*shard)->tensors()) (*shard)->ReleasePages(v);
  ASSIGN_OR_RETURN(const uint64_t rehashed,
                   CheckRecordedBytes(ctx, task, **shard, *recorded, source_bytes));
  TaskOutput output;
  output.summary = rehashed > 0 ? absl::StrCat("read back and re-hashed ", rehashed, " bytes")
                                : "size checked; its bytes were hashed as they were written";
  return output;
}

}  // namespace quantd::pipeline
