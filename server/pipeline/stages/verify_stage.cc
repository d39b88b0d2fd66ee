// Verify: reads one output shard back whole and checks that it is byte for byte the file the
// quantize task wrote (size and SHA-256 as recorded; the quantize task measured each module's
// error while writing exactly those bytes), then checks it against the plan and the export rules,
// and every module written as BF16 against its source decoded again.
#include "server/pipeline/stages/verify_stage.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/sha256.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/pipeline/stages/export_stage.h"
#include "server/pipeline/stages/quantize_stage.h"
#include "server/pipeline/stages/shard_io.h"
#include "server/pipeline/stages/verify_rules.h"
#include "server/pipeline/tensor_inventory.h"

namespace quantd::pipeline {
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
  absl::StatusOr<SourceWeight> w = FindSourceWeight(ctx, module);
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
  ReleaseSource(ctx, *w);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<store::TaskPlan>> VerifyStage::Plan(const PlanInput& input) const {
  const store::TaskRef exported{std::string(ExportStage::kKind), std::string(ExportStage::kKind)};
  std::vector<store::TaskPlan> tasks;
  for (size_t i = 0; i < input.output_shards.size(); ++i) {
    const OutputShard& shard = input.output_shards[i];
    const store::TaskRef quantized{std::string(QuantizeStage::kKind), shard.task.shard};
    tasks.push_back({shard.task.shard, ToJson(shard.task), static_cast<int64_t>(shard.source_bytes),
                     ShardLabel(i, input.output_shards.size()), {}, {quantized, exported}});
  }
  return tasks;
}

absl::StatusOr<TaskOutput> VerifyStage::Run(const store::TaskRow& task, compute::Device&,
                                            const StageContext& ctx) const {
  ASSIGN_OR_RETURN(ShardTask payload, ParseShardTask(task.payload_json));
  for (const store::TaskInput& input : task.inputs) {
    if (input.stage_kind == QuantizeStage::kKind && input.name == payload.shard) {
      return RunVerifyTask(ctx, payload, input);
    }
  }
  return absl::FailedPreconditionError(
      absl::StrCat(payload.shard, ": verify has no recorded quantize output to check"));
}

absl::StatusOr<TaskOutput> RunVerifyTask(const StageContext& ctx, const ShardTask& task,
                                         const store::TaskInput& written) {
  const std::string path = absl::StrCat(ctx.spec->output, "/", task.shard);
  if (absl::Status s = CheckCancelled(ctx, task.shard); !s.ok()) return s;
  // Every byte read back: the file is the one the quantize task wrote and measured.
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec || size != static_cast<uintmax_t>(written.output_bytes)) {
    return absl::DataLossError(absl::StrCat(path, ": ", ec ? ec.message() : std::to_string(size),
                                            " bytes, the quantize task wrote ",
                                            written.output_bytes));
  }
  ASSIGN_OR_RETURN(const std::string sha256, checkpoint::Sha256File(path));
  if (sha256 != written.output_sha256) {
    return absl::DataLossError(
        absl::StrCat(path, ": SHA-256 ", sha256, " differs from the ", written.output_sha256,
                     " of the file the quantize task wrote"));
  }
  absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsFile>> shard =
      checkpoint::SafetensorsFile::Open(path);
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

  std::vector<Violation> violations;
  CheckShardContents(ctx, task, linears, **shard, &violations);
  std::vector<const TensorView*> views;
  for (const TensorView& v : (*shard)->tensors()) views.push_back(&v);
  const std::vector<Nvfp4ModuleViews> modules = FindNvfp4Modules(views);
  CheckNvfp4Modules(modules, ctx.spec->weight_format == WeightFormat::kNvfp4, &violations);
  if (!violations.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", violations.size(),
                                                   " export rule violation(s):\n",
                                                   FormatViolations(violations)));
  }

  TaskOutput output;
  for (const Nvfp4ModuleViews& m : modules) {
    for (const TensorView* v : {m.weight, m.weight_scale}) (*shard)->ReleasePages(*v);
  }
  for (const std::string& module : task.modules) AddProgress(ctx, linears.at(module)->bytes);
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
    AddProgress(ctx, m->bytes);
  }
  if (!violations.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", violations.size(),
                                                   " export rule violation(s):\n",
                                                   FormatViolations(violations)));
  }
  uint64_t copied = 0;
  for (const std::string& name : task.copy_tensors) {
    const TensorView* src = ctx.source->Find(name);
    if (src != nullptr) copied += src->size;
  }
  AddProgress(ctx, copied);
  return output;
}

}  // namespace quantd::pipeline
