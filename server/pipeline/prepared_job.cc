#include "server/pipeline/prepared_job.h"

#include <float.h>
#include <math.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/checkpoint/atomic_file.h"
#include "server/pipeline/stages/dequant_stage.h"
#include "server/pipeline/stages/export_stage.h"
#include "server/pipeline/stages/quantize_stage.h"
#include "server/pipeline/stages/verify_stage.h"

namespace quantd::pipeline {
namespace {

// The inspect task: re-reads the source headers, checks that they still give the stored plan and
// that the output fits on disk.
absl::StatusOr<TaskOutput> RunInspectTask(const JobSpec& spec,
                                          const std::vector<store::TaskRow>& stored) {
  absl::StatusOr<std::unique_ptr<checkpoint::CheckpointDir>> source =
      checkpoint::CheckpointDir::Open(spec.source);
  if (!source.ok()) return source.status();
  absl::StatusOr<TensorInventory> inventory = BuildInventory(**source);
  if (!inventory.ok()) return inventory.status();
  absl::StatusOr<Plan> plan = BuildPlan(spec, **source, *inventory);
  if (!plan.ok()) return plan.status();
  if (absl::Status s = CheckPlanUnchanged(*plan, stored); !s.ok()) return s;
  if (absl::Status s = CheckDiskSpace(spec, *plan); !s.ok()) return s;
  return TaskOutput{};
}

// Removes the *.tmp files directly inside `dir` (left by interrupted tasks). Returns how many.
absl::StatusOr<int> SweepTmpFilesIn(const std::string& dir) {
  std::error_code ec;
  if (dir.empty() || !std::filesystem::is_directory(dir, ec)) return 0;
  int removed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!entry.is_regular_file() || entry.path().extension() != ".tmp") continue;
    if (!std::filesystem::remove(entry.path(), ec) || ec) {
      return absl::InternalError(
          absl::StrCat("cannot remove ", entry.path().string(), ": ", ec.message()));
    }
    ++removed;
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  return removed;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PreparedJob>> PreparedJob::Prepare(
    store::JobStore& store, int64_t job_id, const JobSpec& spec, int64_t now_ms,
    const std::function<void(const std::string&)>& log) {
  std::unique_ptr<PreparedJob> job(new PreparedJob());
  job->spec_ = spec;
  absl::StatusOr<std::unique_ptr<checkpoint::CheckpointDir>> source =
      checkpoint::CheckpointDir::Open(spec.source);
  if (!source.ok()) return source.status();
  job->source_ = std::move(*source);
  absl::StatusOr<TensorInventory> inventory = BuildInventory(*job->source_);
  if (!inventory.ok()) return inventory.status();
  job->inventory_ = std::move(*inventory);
  absl::StatusOr<Plan> plan = BuildPlan(spec, *job->source_, job->inventory_);
  if (!plan.ok()) return plan.status();
  job->plan_ = std::move(*plan);
  if (!store.HasPlan(job_id)) {
    if (absl::Status s = job->PlanJob(store, job_id, now_ms, log); !s.ok()) return s;
  }
  absl::StatusOr<std::vector<store::TaskRow>> tasks = store.ListTasks(job_id);
  if (!tasks.ok()) return tasks.status();
  job->stored_tasks_ = std::move(*tasks);
  if (absl::Status s = CheckPlanUnchanged(job->plan_, job->stored_tasks_); !s.ok()) return s;
  absl::StatusOr<std::vector<store::AmaxRow>> amax = store.ListAmax(job_id);
  if (!amax.ok()) return amax.status();
  for (const store::AmaxRow& row : *amax) {
    if (row.kind == "input") job->input_amax_[row.module] = static_cast<float>(row.value);
  }
  for (const std::string& dir : {spec.output, spec.materialize_bf16}) {
    std::error_code ec;
    if (!dir.empty() && !std::filesystem::create_directories(dir, ec) && ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create directory ", dir, ": ", ec.message()));
    }
  }
  return job;
}

absl::Status PreparedJob::PlanJob(store::JobStore& store, int64_t job_id, int64_t now_ms,
                                  const std::function<void(const std::string&)>& log) {
  if (spec_.kv_cache == KvCache::kFp8) {
    return absl::FailedPreconditionError(
        "kv_cache fp8 needs calibrated KV-cache scales: use kv_cache fp8_cast or none; "
        "calibration is not built yet");
  }
  std::vector<store::AmaxRow> rows;
  if (!spec_.calibration.amax_file.empty()) {
    absl::StatusOr<std::vector<store::AmaxRow>> loaded =
        LoadAmaxFile(spec_.calibration.amax_file, inventory_);
    if (!loaded.ok()) return loaded.status();
    rows = std::move(*loaded);
  }
  if (spec_.weight_format == WeightFormat::kNvfp4 && rows.empty()) {
    absl::StatusOr<std::vector<store::AmaxRow>> stored = store.ListAmax(job_id);
    if (!stored.ok()) return stored.status();
    if (stored->empty()) {
      return absl::FailedPreconditionError(
          "weight_format nvfp4 needs input amax: set calibration.amax_file or use w4a16_nvfp4; "
          "calibration is not built yet");
    }
  }
  if (absl::Status s = CheckDiskSpace(spec_, plan_); !s.ok()) return s;
  // Amax rows from a file carry no sample count, so merging them twice (a crash before SetPlan)
  // changes nothing.
  if (absl::Status s = store.MergeAmax(job_id, rows); !s.ok()) return s;
  if (absl::Status s = store.SetPlan(job_id, plan_.stages); !s.ok()) return s;
  int64_t tasks = 0;
  for (const store::StagePlan& stage : plan_.stages) tasks += stage.tasks.size();
  const std::string message = absl::StrCat(
      "planned ", plan_.recipe.modules.size(), " NVFP4 modules in ", tasks, " tasks; ",
      plan_.source_bytes, " source bytes -> about ", plan_.output_bytes, " output bytes");
  if (log) log(message);
  return store.AddEvent(job_id, "plan", message, now_ms);
}

absl::StatusOr<TaskOutput> PreparedJob::RunTask(const store::TaskRow& task,
                                                kernels::Backend* backend,
                                                const std::atomic<bool>* cancelled,
                                                std::function<void(uint64_t)> add_progress) const {
  StageContext ctx;
  ctx.spec = &spec_;
  ctx.source = source_.get();
  ctx.inventory = &inventory_;
  ctx.backend = backend;
  ctx.input_amax = &input_amax_;
  ctx.cancelled = cancelled;
  ctx.add_progress = std::move(add_progress);
  const std::string& kind = task.stage_kind;
  if (kind == "inspect") return RunInspectTask(spec_, stored_tasks_);
  if (kind == "export") return RunExportTask(ctx, plan_);
  if (kind == "dequant") {
    absl::StatusOr<DequantTask> payload = ParseDequantTask(task.payload_json);
    if (!payload.ok()) return payload.status();
    return RunDequantTask(ctx, *payload);
  }
  if (kind == "quantize" || kind == "verify") {
    absl::StatusOr<ShardTask> payload = ParseShardTask(task.payload_json);
    if (!payload.ok()) return payload.status();
    return kind == "quantize" ? RunQuantizeTask(ctx, *payload) : RunVerifyTask(ctx, *payload);
  }
  return absl::UnimplementedError(absl::StrCat("this quantd cannot run ", kind, " tasks"));
}

absl::StatusOr<int> PreparedJob::SweepTmpFiles() const {
  int removed = 0;
  for (const std::string& dir : {spec_.output, spec_.materialize_bf16}) {
    absl::StatusOr<int> n = SweepTmpFilesIn(dir);
    if (!n.ok()) return n.status();
    removed += *n;
  }
  return removed;
}

std::optional<int64_t> RetryDelayMs(absl::StatusCode code, int attempt) {
  const bool transient = code == absl::StatusCode::kUnavailable ||
                         code == absl::StatusCode::kResourceExhausted ||
                         code == absl::StatusCode::kCancelled;
  if (!transient || attempt >= kMaxAttempts) return std::nullopt;
  return int64_t{1000} << attempt;
}

absl::StatusOr<std::vector<store::AmaxRow>> LoadAmaxFile(const std::string& path,
                                                         const TensorInventory& inventory) {
  absl::StatusOr<std::string> text = checkpoint::ReadFile(path);
  if (!text.ok()) return text.status();
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a JSON object {module: input_amax}"));
  }
  std::set<std::string> modules;
  for (const LinearModule& m : inventory.linears) modules.insert(m.name);
  std::vector<store::AmaxRow> rows;
  for (const auto& [module, value] : j.items()) {
    // `quantd calibrate` also writes a routed w2's two measurements, "<w2>.unweighted" and
    // "<w2>.weighted", next to the exported "<w2>" (calibration/export_amax.h): not modules.
    if (absl::EndsWith(module, ".unweighted") || absl::EndsWith(module, ".weighted")) {
      const std::string base = module.substr(0, module.rfind('.'));
      if (modules.count(base) != 0 && j.contains(base)) continue;
    }
    if (modules.count(module) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", module, " is not a linear module of the source checkpoint"));
    }
    const double v = value.is_number() ? value.get<double>() : NAN;
    if (!isfinite(v) || v < 0 || v > FLT_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": amax of ", module, " is ", value.dump(), "; expected a finite float32 >= 0"));
    }
    rows.push_back(store::AmaxRow{module, "input", static_cast<float>(v), 0});
  }
  return rows;
}

absl::Status CheckPlanUnchanged(const Plan& plan, const std::vector<store::TaskRow>& stored) {
  const std::string prefix =
      "the source checkpoint changed since the job was planned (or the plan was built by another "
      "quantd version): ";
  size_t k = 0;
  for (const store::StagePlan& stage : plan.stages) {
    for (size_t i = 0; i < stage.tasks.size(); ++i, ++k) {
      const store::TaskPlan& t = stage.tasks[i];
      if (k >= stored.size()) {
        return absl::FailedPreconditionError(
            absl::StrCat(prefix, stage.kind, " task ", t.name, " is new"));
      }
      const store::TaskRow& s = stored[k];
      if (s.stage_kind != stage.kind || s.name != t.name) {
        return absl::FailedPreconditionError(absl::StrCat(prefix, "expected ", s.stage_kind,
                                                          " task ", s.name, ", the source gives ",
                                                          stage.kind, " task ", t.name));
      }
      if (s.payload_json != t.payload_json || s.bytes_total != t.bytes_total) {
        return absl::FailedPreconditionError(absl::StrCat(
            prefix, stage.kind, " task ", t.name, " now covers different tensors or bytes (",
            t.bytes_total, " bytes, stored ", s.bytes_total, ")"));
      }
    }
  }
  if (k != stored.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(prefix, stored[k].stage_kind, " task ", stored[k].name, " is gone"));
  }
  return absl::OkStatus();
}

}  // namespace quantd::pipeline
