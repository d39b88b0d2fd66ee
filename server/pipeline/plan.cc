#include "server/pipeline/plan.h"

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "server/base/thread_budget.h"
#include "server/checkpoint/disk_space.h"
#include "server/pipeline/export_layout.h"
#include "server/pipeline/stage.h"
#include "server/pipeline/stage_registry.h"

namespace quantd::pipeline {

using checkpoint::FormatName;
using checkpoint::LinearModule;
using checkpoint::TensorFormat;
using checkpoint::TensorInfo;
using checkpoint::TensorInventory;

using job::ExportFormat;
using job::JobSpec;
using job::RecipeKind;
using job::RecipeKindName;
using job::WeightFormat;

namespace {

using nlohmann::json;

absl::Status BadPayload(const std::string& what, const std::string& text) {
  return absl::InvalidArgumentError(absl::StrCat("corrupt ", what, " task payload: ", text));
}

bool IsStringArray(const json& j) {
  if (!j.is_array()) return false;
  for (const json& v : j) {
    if (!v.is_string()) return false;
  }
  return true;
}

// Bytes of one NVFP4 module as written: values, block scales, scalar scales.
uint64_t Nvfp4Bytes(const JobSpec& spec, const LinearModule& m) {
  uint64_t bytes = 0;
  for (const OutputTensor& t : Nvfp4ModuleTensors(spec, m.name, m.out_features, m.in_features)) {
    uint64_t n = checkpoint::DtypeSize(t.dtype);
    for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
    bytes += n;
  }
  return bytes;
}

// Bytes of a module's weight as BF16.
uint64_t Bf16Bytes(const LinearModule& m) {
  return static_cast<uint64_t>(m.out_features) * static_cast<uint64_t>(m.in_features) * 2;
}

bool Quantizable(TensorFormat f) {
  return f == TensorFormat::kFp8BlockE8m0 || f == TensorFormat::kFp8BlockF32 ||
         f == TensorFormat::kMxfp4 || f == TensorFormat::kBf16 || f == TensorFormat::kF32;
}

}  // namespace

std::string ShardLabel(size_t index, size_t count) {
  return absl::StrCat("shard ", index + 1, " of ", count);
}

std::string ToJson(const DequantTask& t) { return json{{"shard", t.shard}}.dump(); }

std::string ToJson(const ShardTask& t) {
  json j = {{"shard", t.shard},
            {"copy_tensors", t.copy_tensors},
            {"modules", t.modules},
            {"fusion_groups", t.fusion_groups}};
  // Only when there are some, so that plans stored before the key existed still compare equal.
  if (!t.bf16_modules.empty()) j["bf16_modules"] = t.bf16_modules;
  return j.dump();
}

absl::StatusOr<DequantTask> ParseDequantTask(const std::string& json_text) {
  json j = json::parse(json_text, nullptr, false);
  if (!j.is_object() || !j.contains("shard") || !j["shard"].is_string()) {
    return BadPayload("dequant", json_text);
  }
  return DequantTask{j["shard"].get<std::string>()};
}

absl::StatusOr<ShardTask> ParseShardTask(const std::string& json_text) {
  json j = json::parse(json_text, nullptr, false);
  if (!j.is_object() || !j.contains("shard") || !j["shard"].is_string() ||
      !IsStringArray(j.value("copy_tensors", json())) || !IsStringArray(j.value("modules", json())) ||
      !j.value("fusion_groups", json()).is_array() ||
      (j.contains("bf16_modules") && !IsStringArray(j["bf16_modules"]))) {
    return BadPayload("shard", json_text);
  }
  ShardTask t;
  t.shard = j["shard"].get<std::string>();
  t.copy_tensors = j["copy_tensors"].get<std::vector<std::string>>();
  t.modules = j["modules"].get<std::vector<std::string>>();
  if (j.contains("bf16_modules")) {
    t.bf16_modules = j["bf16_modules"].get<std::vector<std::string>>();
  }
  for (const json& g : j["fusion_groups"]) {
    if (!IsStringArray(g)) return BadPayload("shard", json_text);
    t.fusion_groups.push_back(g.get<std::vector<std::string>>());
  }
  return t;
}

std::vector<OutputTensor> Nvfp4ModuleTensors(const JobSpec& spec, const std::string& module,
                                             int64_t out_features, int64_t in_features) {
  using checkpoint::Dtype;
  const bool with_input = spec.weight_format == WeightFormat::kNvfp4;
  std::vector<OutputTensor> out;
  if (spec.export_format == ExportFormat::kModelOpt) {
    out.push_back({module + ".weight", Dtype::kU8, {out_features, in_features / 2}});
    out.push_back({module + ".weight_scale", Dtype::kF8E4M3, {out_features, in_features / 16}});
    out.push_back({module + ".weight_scale_2", Dtype::kF32, {}});
    if (with_input) out.push_back({module + ".input_scale", Dtype::kF32, {}});
  } else {
    out.push_back({module + ".weight_packed", Dtype::kU8, {out_features, in_features / 2}});
    out.push_back({module + ".weight_scale", Dtype::kF8E4M3, {out_features, in_features / 16}});
    out.push_back({module + ".weight_global_scale", Dtype::kF32, {1}});
    if (with_input) out.push_back({module + ".input_global_scale", Dtype::kF32, {1}});
  }
  return out;
}

absl::StatusOr<Recipe> RecipeForSpec(const JobSpec& spec, const TensorInventory& inventory) {
  if (spec.recipe == RecipeKind::kCustom) return GlobRecipe(spec.include, spec.exclude);
  absl::StatusOr<Recipe> recipe = BuiltinRecipe(RecipeKindName(spec.recipe), inventory,
                                                        spec.recipe_revision);
  if (!recipe.ok()) return recipe.status();
  // The spec's exclusions come first: the first matching rule decides.
  std::vector<RecipeRule> rules;
  for (const std::string& glob : spec.exclude) {
    rules.push_back(RecipeRule{glob, false, absl::StrCat("exclude ", glob)});
  }
  rules.insert(rules.end(), recipe->rules.begin(), recipe->rules.end());
  recipe->rules = std::move(rules);
  return recipe;
}

absl::StatusOr<Plan> BuildPlan(const JobSpec& spec, const checkpoint::CheckpointDir& source,
                               const TensorInventory& inventory) {
  return BuildPlan(spec, source, inventory, BuiltinStages());
}

absl::StatusOr<Plan> BuildPlan(const JobSpec& spec, const checkpoint::CheckpointDir& source,
                               const TensorInventory& inventory, const StageRegistry& stages,
                               const PlanLimits& limits) {
  absl::StatusOr<Recipe> recipe = RecipeForSpec(spec, inventory);
  if (!recipe.ok()) return recipe.status();
  absl::StatusOr<RecipePlan> selected = PlanRecipe(inventory, *recipe);
  if (!selected.ok()) return selected.status();
  if (selected->modules.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("recipe '", recipe->name,
                                                   "' selects no module of ", source.dir()));
  }
  std::map<std::string, const LinearModule*> linears;
  for (const LinearModule& m : inventory.linears) linears[m.name] = &m;
  std::map<std::string, const TensorInfo*> tensors;
  for (const TensorInfo& t : inventory.tensors) tensors[t.name] = &t;

  // Every selected module goes to the shard of its weight; a fusion group to its first member's.
  std::map<std::string, std::string> module_shard;
  std::set<std::string> quantized_tensors;
  for (const std::string& name : selected->modules) {
    const LinearModule* m = linears.at(name);
    if (!Quantizable(m->format)) {
      return absl::InvalidArgumentError(absl::StrCat("module ", name, " is stored as ",
                                                     FormatName(m->format),
                                                     ", which quantd cannot quantize to NVFP4"));
    }
    if (m->in_features % 16 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("module ", name, " has ", m->in_features,
                                                     " input features, not a multiple of 16"));
    }
    // No runtime quantizes the input of DeepSeek-V4's grouped output projection (vLLM, SGLang
    // and TensorRT-LLM compute it as an FP8 / BF16 grouped product), and the evaluation would
    // not either: as W4A4 it would ship an input_scale no one uses and figures no runtime
    // reproduces. Jobs planned by an earlier release (recipe revision 1) keep their plan.
    if (spec.weight_format == WeightFormat::kNvfp4 && spec.recipe_revision >= 2 &&
        inventory.arch == checkpoint::ModelArch::kDeepseekV4 &&
        IsGroupedOutputProjection(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "module ", name,
          ": the grouped output projection attn.wo_a runs as W4A4 in no runtime (vLLM, SGLang "
          "and TensorRT-LLM compute it in FP8 / BF16); exclude *.attn.wo_a or use weight_format "
          "w4a16_nvfp4"));
    }
    module_shard[name] = tensors.at(m->tensors.front())->shard;
    quantized_tensors.insert(m->tensors.begin(), m->tensors.end());
  }
  std::map<std::string, std::vector<std::vector<std::string>>> shard_groups;
  for (const std::vector<std::string>& group : selected->fusion_groups) {
    const std::string shard = module_shard.at(group.front());
    for (const std::string& member : group) module_shard[member] = shard;
    shard_groups[shard].push_back(group);
  }

  // Modules left alone that the layout cannot describe in their FP8 / MXFP4 format are written
  // as BF16 (export_layout.h).
  const std::set<std::string> quantized(selected->modules.begin(), selected->modules.end());
  const ExportLayout layout = ChooseExportLayout(spec, inventory, source.config(), quantized);
  std::vector<const LinearModule*> bf16_modules;
  std::set<std::string> bf16_tensors;
  if (!KeepsSourceQuantization(layout)) {
    for (const LinearModule& m : inventory.linears) {
      if (quantized.count(m.name) != 0 || !IsBlockQuantizedFormat(m.format)) continue;
      bf16_modules.push_back(&m);
      bf16_tensors.insert(m.tensors.begin(), m.tensors.end());
    }
  }

  Plan plan;
  plan.recipe = *selected;
  std::map<std::string, ShardTask> shards;  // by file name
  std::map<std::string, uint64_t> shard_source_bytes;
  for (const TensorInfo& t : inventory.tensors) {
    plan.source_bytes += t.bytes;
    if (quantized_tensors.count(t.name) != 0 || bf16_tensors.count(t.name) != 0) continue;
    ShardTask& task = shards[t.shard];
    task.shard = t.shard;
    task.copy_tensors.push_back(t.name);
    shard_source_bytes[t.shard] += t.bytes;
    plan.output_bytes += t.bytes;
  }
  for (const std::string& name : selected->modules) {
    const LinearModule* m = linears.at(name);
    const std::string& shard = module_shard.at(name);
    ShardTask& task = shards[shard];
    task.shard = shard;
    task.modules.push_back(name);
    shard_source_bytes[shard] += m->bytes;
    plan.output_bytes += Nvfp4Bytes(spec, *m);
  }
  for (const LinearModule* m : bf16_modules) {
    const std::string& shard = tensors.at(m->tensors.front())->shard;
    ShardTask& task = shards[shard];
    task.shard = shard;
    task.bf16_modules.push_back(m->name);
    shard_source_bytes[shard] += m->bytes;
    plan.output_bytes += Bf16Bytes(*m);
  }
  for (auto& [shard, groups] : shard_groups) shards[shard].fusion_groups = groups;

  PlanInput input;
  input.spec = &spec;
  input.source = &source;
  input.inventory = &inventory;
  for (auto& [shard, task] : shards) {
    input.output_shards.push_back({std::move(task), shard_source_bytes[shard]});
  }
  for (const TensorInfo& t : inventory.tensors) input.source_shards[t.shard] += t.bytes;
  if (!spec.materialize_bf16.empty()) {
    for (const TensorInfo& t : inventory.tensors) {
      if (t.format == TensorFormat::kScale) continue;
      if (IsBlockQuantizedFormat(t.format)) {
        plan.bf16_bytes += Bf16Bytes(*linears.at(t.module));
      } else {
        plan.bf16_bytes += t.bytes;
      }
    }
  }
  int64_t planned = 0;  // tasks of the stages so far
  for (const std::unique_ptr<Stage>& stage : stages.stages()) {
    base::ThreadBudgetCheck();  // a cancelled or late planning stops here (base/thread_budget.h)
    absl::StatusOr<std::vector<store::TaskPlan>> tasks = stage->Plan(input);
    if (!tasks.ok()) return tasks.status();
    if (tasks->empty()) continue;
    planned += static_cast<int64_t>(tasks->size());
    if (planned > limits.max_tasks) {
      return absl::InvalidArgumentError(absl::StrCat(
          source.dir(), ": the plan holds more than ", limits.max_tasks, " tasks (", planned,
          " up to its ", std::string(stage->kind()), " stage), more than one job may have "
          "(--max-tasks-per-job)"));
    }
    ASSIGN_OR_RETURN(const uint64_t checkpoint_bytes, stage->CheckpointBytes(input, *tasks));
    plan.checkpoint_bytes += checkpoint_bytes;
    plan.stages.push_back({std::string(stage->kind()), std::move(*tasks)});
  }
  return plan;
}

namespace {

// Free bytes on the file system that holds (or will hold) `dir`, relative or not.
absl::StatusOr<uint64_t> FreeDiskBytes(const std::string& dir) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::absolute(dir, ec);
  ASSIGN_OR_RETURN(const checkpoint::DiskSpace space, checkpoint::DiskSpaceUnder(p.string()));
  return static_cast<uint64_t>(space.free_bytes);
}

}  // namespace

absl::Status CheckDiskSpace(const JobSpec& spec, const Plan& plan, const std::string& work_dir) {
  absl::StatusOr<uint64_t> out_free = FreeDiskBytes(spec.output);
  if (!out_free.ok()) return out_free.status();
  uint64_t needed_on_output = plan.output_bytes;
  std::string with_checkpoints;  // what the output's figure includes besides the output
  if (plan.checkpoint_bytes > 0) {
    ASSIGN_OR_RETURN(const uint64_t work_free, FreeDiskBytes(work_dir));
    const std::string checkpoints =
        absl::StrCat("the layer checkpoints of calibration and evaluation need about ",
                     plan.checkpoint_bytes, " bytes in ", work_dir);
    if (work_free == *out_free) {
      needed_on_output += plan.checkpoint_bytes;  // most likely the same file system
      with_checkpoints = absl::StrCat(" (", checkpoints, ")");
    } else if (work_free < plan.checkpoint_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat(checkpoints, " but it has ", work_free, " free"));
    }
  }
  if (!spec.materialize_bf16.empty()) {
    absl::StatusOr<uint64_t> bf16_free = FreeDiskBytes(spec.materialize_bf16);
    if (!bf16_free.ok()) return bf16_free.status();
    if (*bf16_free == *out_free) {
      needed_on_output += plan.bf16_bytes;  // most likely the same file system
    } else if (*bf16_free < plan.bf16_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the BF16 copy needs about ", plan.bf16_bytes, " bytes but ", spec.materialize_bf16,
          " has ", *bf16_free, " free"));
    }
  }
  if (*out_free < needed_on_output) {
    return absl::ResourceExhaustedError(absl::StrCat("the output needs about ", needed_on_output,
                                                     " bytes", with_checkpoints, " but ",
                                                     spec.output, " has ", *out_free, " free"));
  }
  return absl::OkStatus();
}

}  // namespace quantd::pipeline
