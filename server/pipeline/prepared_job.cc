#include "server/pipeline/prepared_job.h"

#include <float.h>
#include <math.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/base/thread_budget.h"
#include "server/calibration/export_amax.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/json_file.h"
#include "server/checkpoint/sha256.h"
#include "server/job/job_paths.h"
#include "server/model/v4_config.h"
#include "server/model/v4_config_check.h"
#include "server/pipeline/stages/calibrate_stage.h"

namespace quantd::pipeline {

using checkpoint::BuildInventory;
using checkpoint::LinearModule;
using checkpoint::TensorInventory;

using job::CalibrationMode;
using job::CheckJobPathsUnchanged;
using job::JobSpec;
using job::KvCache;
using job::WeightFormat;

namespace {

// Removes the *.tmp files directly inside the directory `marker` claimed (left by interrupted
// tasks), except the foreign ones. Returns how many.
absl::StatusOr<int> SweepTmpFilesIn(const OutputMarker& marker) {
  ASSIGN_OR_RETURN(const std::vector<checkpoint::DirEntry> entries, marker.dir().List());
  int removed = 0;
  for (const checkpoint::DirEntry& entry : entries) {
    if (entry.type != S_IFREG || !absl::EndsWith(entry.name, ".tmp") ||
        marker.IsForeign(entry.name)) {
      continue;
    }
    absl::Status s = marker.dir().Remove(entry.name);
    if (absl::IsNotFound(s)) continue;
    RETURN_IF_ERROR(s);
    ++removed;
  }
  return removed;
}

// The top-level names a job writes into the directory of `field`: the shards of `shard_stage`,
// the index and configs, and (conservatively: export copies a subset) every top-level entry of
// the source.
absl::StatusOr<std::vector<std::string>> NamesWritten(const Plan& plan, const char* shard_stage,
                                                      const std::string& source_dir) {
  std::vector<std::string> names = {checkpoint::kIndexFileName, "config.json",
                                    "hf_quant_config.json"};
  for (const store::StagePlan& stage : plan.stages) {
    if (stage.kind != shard_stage) continue;
    for (const store::TaskPlan& t : stage.tasks) names.push_back(t.name);
  }
  std::error_code ec;
  for (std::filesystem::directory_iterator it(source_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot list ", source_dir, ": ", ec.message()));
  }
  return names;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PreparedJob>> PreparedJob::LoadSource(
    const JobSpec& spec, StoredJob stored, const PlanLimits& limits, const StageRegistry& stages) {
  std::unique_ptr<PreparedJob> job(new PreparedJob());
  job->stages_ = &stages;
  job->spec_ = spec;
  job->stored_ = std::move(stored);
  if (job->stored_.planned) {
    for (const std::unique_ptr<Stage>& stage : stages.stages()) {
      stage->AdaptSpec(job->stored_.tasks, job->spec_);
    }
  }
  RETURN_IF_ERROR(CheckJobPathsUnchanged(job->spec_));
  const std::string config_path = job->spec_.source + "/config.json";
  {
    const base::ScopedInput reading(job->spec_.source);
    ASSIGN_OR_RETURN(job->source_dir_, checkpoint::DirHandle::Open("source", job->spec_.source));
    ASSIGN_OR_RETURN(job->source_, checkpoint::CheckpointDir::Open(job->spec_.source,
                                                                   job->spec_.source_roots));
    ASSIGN_OR_RETURN(job->inventory_, BuildInventory(*job->source_));
  }
  base::ThreadBudgetCheck();  // where a cancelled or late planning stops (base/thread_budget.h)
  if (job->inventory_.arch == checkpoint::ModelArch::kDeepseekV4) {
    const base::ScopedInput reading(config_path);
    // A config.json that is not a DeepSeek-V4 model's is refused by the stages that run the
    // forward; the others do not read it.
    if (absl::StatusOr<model::V4Config> config =
            model::ParseV4Config(job->source_->config(), config_path);
        config.ok()) {
      RETURN_IF_ERROR(model::CheckV4ConfigAgainstTensors(*config, job->inventory_, config_path));
    }
  }
  {
    const base::ScopedInput reading(config_path);
    ASSIGN_OR_RETURN(job->plan_,
                     BuildPlan(job->spec_, *job->source_, job->inventory_, stages, limits));
  }
  base::ThreadBudgetCheck();
  return job;
}

absl::StatusOr<std::unique_ptr<PreparedJob>> PreparedJob::Load(const JobSpec& spec,
                                                                StoredJob stored,
                                                                const PlanLimits& limits,
                                                                const StageRegistry& stages) {
  ASSIGN_OR_RETURN(std::unique_ptr<PreparedJob> job,
                   LoadSource(spec, std::move(stored), limits, stages));
  if (job->stored_.planned) {
    RETURN_IF_ERROR(CheckPlanUnchanged(job->plan_, job->stored_.tasks));
    ASSIGN_OR_RETURN(job->changed_outputs_, FindChangedOutputs(job->stored_.tasks, stages));
  } else {
    if (!spec.calibration.amax_file.empty()) {
      ASSIGN_OR_RETURN(job->file_amax_,
                       LoadAmaxFile(spec.calibration.amax_file, job->inventory_,
                                    spec.source_roots));
    }
    RETURN_IF_ERROR(CheckDiskSpace(spec, job->plan_, job->stored_.work_dir));
  }
  RETURN_IF_ERROR(job->ClaimOutputDirs());
  const std::set<int64_t> changed = job->ChangedTaskIds();
  StageJobInput input;
  input.spec = &job->spec_;
  input.stored = &job->stored_;
  input.source = job->source_;
  input.changed_outputs = &changed;
  for (const std::unique_ptr<Stage>& stage : stages.stages()) {
    ASSIGN_OR_RETURN(std::unique_ptr<StageJob> opened, stage->OpenJob(input));
    if (opened != nullptr) job->stage_jobs_.emplace(std::string(stage->kind()), std::move(opened));
  }
  return job;
}

absl::StatusOr<std::unique_ptr<PreparedJob>> PreparedJob::OpenForWorker(
    const JobSpec& spec, StoredJob stored, const std::vector<store::AmaxRow>& amax,
    const PlanLimits& limits, const StageRegistry& stages) {
  if (!stored.planned) return absl::FailedPreconditionError("the job has no stored plan yet");
  ASSIGN_OR_RETURN(std::unique_ptr<PreparedJob> job,
                   LoadSource(spec, std::move(stored), limits, stages));
  RETURN_IF_ERROR(CheckPlanUnchanged(job->plan_, job->stored_.tasks));
  for (const auto& [field, path, handle] :
       {std::tuple{"output", &job->spec_.output, &job->output_dir_},
        std::tuple{"materialize_bf16", &job->spec_.materialize_bf16,
                   &job->materialize_bf16_dir_}}) {
    if (path->empty()) continue;
    ASSIGN_OR_RETURN(std::unique_ptr<OutputMarker> marker,
                     OutputMarker::Join(field, *path, job->stored_.identity));
    *handle = &marker->dir();
    job->markers_.push_back(std::move(marker));
  }
  job->stored_tasks_ = job->stored_.tasks;
  for (const store::AmaxRow& row : amax) {
    if (row.kind == "input") job->input_amax_[row.module] = static_cast<float>(row.value);
  }
  return job;
}

void PreparedJob::NoteRecorded(const store::TaskRow& done) const {
  if (done.state != store::TaskState::kDone || done.output_path.empty()) return;
  absl::MutexLock lock(&completed_mu_);
  completed_[{done.stage_kind, done.name}] =
      RecordedOutput{done.output_path, done.output_bytes.value_or(0), done.output_sha256};
}

std::set<int64_t> PreparedJob::ChangedTaskIds() const {
  std::set<int64_t> ids;
  for (const auto& [id, reason] : changed_outputs_) ids.insert(id);
  return ids;
}

absl::Status PreparedJob::ClaimOutputDirs() {
  const std::set<int64_t> changed = ChangedTaskIds();
  struct Dir {
    const char* field;
    const std::string* path;
    const char* shard_stage;
  };
  for (const Dir& d : {Dir{"output", &spec_.output, "quantize"},
                       Dir{"materialize_bf16", &spec_.materialize_bf16, "dequant"}}) {
    if (d.path->empty()) continue;
    ASSIGN_OR_RETURN(std::vector<std::string> names,
                     NamesWritten(plan_, d.shard_stage, spec_.source));
    OwnFiles own;
    own.written.insert(names.begin(), names.end());
    std::error_code ec;
    const std::filesystem::path dir =
        std::filesystem::weakly_canonical(std::filesystem::absolute(*d.path), ec);
    for (const store::TaskRow& t : stored_.tasks) {
      if (t.state != store::TaskState::kDone || t.output_path.empty() || changed.count(t.id)) {
        continue;
      }
      const std::filesystem::path output =
          std::filesystem::weakly_canonical(std::filesystem::absolute(t.output_path), ec);
      if (!ec && output.parent_path() == dir && std::filesystem::is_regular_file(output, ec)) {
        own.outputs.insert(output.filename().string());
      }
    }
    ASSIGN_OR_RETURN(std::unique_ptr<OutputMarker> marker,
                     OutputMarker::Claim(d.field, *d.path, stored_.identity, spec_.overwrite, own));
    RETURN_IF_ERROR(marker->RefuseForeign(names));
    (d.path == &spec_.output ? output_dir_ : materialize_bf16_dir_) = &marker->dir();
    markers_.push_back(std::move(marker));
  }
  return absl::OkStatus();
}

absl::Status PreparedJob::Attach(store::JobStore& store, int64_t now_ms,
                                 const std::function<void(const std::string&)>& log) {
  const int64_t job_id = stored_.identity.job_id;
  if (!stored_.planned) {
    if (absl::Status s = PlanJob(store, now_ms, log); !s.ok()) {
      // The job fails before any task ran: the directories it claimed go back as they were.
      for (const std::unique_ptr<OutputMarker>& marker : markers_) marker->Withdraw();
      return s;
    }
  }
  for (const std::unique_ptr<OutputMarker>& marker : markers_) {
    if (marker->adopted() && log) {
      log("adopted an output directory without a marker: it holds only outputs this job "
          "finished, written before quantd marked its directories");
    }
  }
  if (!changed_outputs_.empty()) {
    std::vector<int64_t> ids;
    for (const auto& [id, reason] : changed_outputs_) {
      ids.push_back(id);
      if (log) log(reason);
    }
    const std::string reason =
        changed_outputs_.size() == 1
            ? changed_outputs_.front().second
            : absl::StrCat(changed_outputs_.size(), " task outputs are gone or changed");
    ASSIGN_OR_RETURN(int requeued, store.RequeueDoneTasks(job_id, ids, reason, now_ms));
    if (log) log(absl::StrCat("requeued ", requeued, " done task(s) to rebuild their output"));
  }
  ASSIGN_OR_RETURN(stored_tasks_, store.ListTasks(job_id));
  // (A calibrating job's quantize tasks export their input amax from its calibrate stage's
  // table instead.)
  ASSIGN_OR_RETURN(const std::vector<store::AmaxRow> amax, store.ListAmax(job_id));
  for (const store::AmaxRow& row : amax) {
    if (row.kind == "input") input_amax_[row.module] = static_cast<float>(row.value);
  }
  StageJobAttach attach;
  attach.store = &store;
  attach.job_id = job_id;
  attach.now_ms = now_ms;
  attach.log = &log;
  attach.tasks = &stored_tasks_;
  for (const std::unique_ptr<Stage>& stage : stages_->stages()) {
    if (StageJob* job = StageJobOf(stage->kind()); job != nullptr) {
      RETURN_IF_ERROR(job->Attach(attach));
    }
  }
  return absl::OkStatus();
}

StageJob* PreparedJob::StageJobOf(std::string_view kind) const {
  const auto it = stage_jobs_.find(kind);
  return it == stage_jobs_.end() ? nullptr : it->second.get();
}

absl::Status PreparedJob::PlanJob(store::JobStore& store, int64_t now_ms,
                                  const std::function<void(const std::string&)>& log) {
  const int64_t job_id = stored_.identity.job_id;
  if (spec_.kv_cache == KvCache::kFp8) {
    return absl::FailedPreconditionError(
        "kv_cache fp8 needs calibrated KV-cache scales: use kv_cache fp8_cast or none; "
        "calibration is not built yet");
  }
  std::vector<store::AmaxRow> rows = file_amax_;
  if (spec_.weight_format == WeightFormat::kNvfp4 && rows.empty() &&
      spec_.calibration.mode == CalibrationMode::kConstant) {
    // ModelOpt's constant-amax recipe: input_scale 1.0, no forward pass.
    for (const auto& [module, amax] : calibration::ConstantInputAmax(inventory_)) {
      rows.push_back(store::AmaxRow{module, "input", amax, 0});
    }
  }
  if (spec_.weight_format == WeightFormat::kNvfp4 && rows.empty() && !NeedsCalibration(spec_)) {
    absl::StatusOr<std::vector<store::AmaxRow>> stored = store.ListAmax(job_id);
    if (!stored.ok()) return stored.status();
    if (stored->empty()) {
      return absl::FailedPreconditionError(
          "weight_format nvfp4 needs input amax: give calibration data (calibration.dataset or "
          "datasets), calibration.amax_file or calibration.mode constant, or use w4a16_nvfp4");
    }
  }
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
                                                compute::Device& device,
                                                const std::atomic<bool>* cancelled,
                                                std::function<void(uint64_t)> add_progress) const {
  const Stage* stage = stages_->Find(task.stage_kind);
  if (stage == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("this quantd cannot run ", task.stage_kind, " tasks"));
  }
  // A directory of the job renamed or replaced since it was opened fails the task, and so the
  // job, naming the field: before the task writes, and before its output is recorded.
  RETURN_IF_ERROR(CheckDirsUnchanged());
  StageContext ctx;
  ctx.spec = &spec_;
  ctx.source = source_.get();
  ctx.inventory = &inventory_;
  ctx.plan = &plan_;
  ctx.source_dir = &source_dir_;
  ctx.output_dir = output_dir_;
  ctx.materialize_bf16_dir = materialize_bf16_dir_;
  ctx.work_dir = &stored_.work_dir;
  ctx.stored_tasks = &stored_tasks_;
  ctx.backend = &device.backend();
  ctx.input_amax = &input_amax_;
  ctx.job = StageJobOf(task.stage_kind);
  ctx.job_of = [this](std::string_view kind) { return StageJobOf(kind); };
  ctx.cancelled = cancelled;
  ctx.add_progress = std::move(add_progress);
  ctx.recorded_output = [this](std::string_view kind, const std::string& name) {
    return RecordedOutputOf(kind, name);
  };
  ASSIGN_OR_RETURN(TaskOutput output, stage->Run(task, device, ctx));
  RETURN_IF_ERROR(CheckDirsUnchanged());
  return output;
}

absl::Status PreparedJob::CheckDirsUnchanged() const {
  RETURN_IF_ERROR(source_dir_.CheckUnchanged());
  for (const std::unique_ptr<OutputMarker>& marker : markers_) {
    RETURN_IF_ERROR(marker->dir().CheckUnchanged());
  }
  for (const auto& [kind, job] : stage_jobs_) RETURN_IF_ERROR(job->CheckDirsUnchanged());
  return absl::OkStatus();
}

std::optional<RecordedOutput> PreparedJob::RecordedOutputOf(std::string_view kind,
                                                            const std::string& name) const {
  {
    absl::MutexLock lock(&completed_mu_);
    auto it = completed_.find({std::string(kind), name});
    if (it != completed_.end()) return it->second;
  }
  for (const store::TaskRow& t : stored_tasks_) {
    if (t.stage_kind != kind || t.name != name) continue;
    if (t.state != store::TaskState::kDone || t.output_path.empty()) return std::nullopt;
    return RecordedOutput{t.output_path, t.output_bytes.value_or(0), t.output_sha256};
  }
  return std::nullopt;
}

absl::Status PreparedJob::CompleteTask(store::JobStore& store, const store::TaskLease& lease,
                                       const store::TaskRow& task, const TaskOutput& output,
                                       int64_t now_ms, bool written_here) const {
  const Stage* stage = stages_->Find(task.stage_kind);
  if (stage == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("this quantd cannot record ", task.stage_kind, " tasks"));
  }
  RETURN_IF_ERROR(store.CompleteTask(
      lease, output.path, static_cast<int64_t>(output.bytes), output.sha256, now_ms,
      [&](store::TaskRecord& txn) { return stage->Record(txn, task, output); }));
  if (StageJob* job = StageJobOf(task.stage_kind); job != nullptr) job->TaskDone(task, output);
  if (!output.path.empty()) {
    absl::MutexLock lock(&completed_mu_);
    completed_[{task.stage_kind, task.name}] = RecordedOutput{
        output.path, static_cast<int64_t>(output.bytes), output.sha256, written_here};
  }
  return absl::OkStatus();
}

absl::StatusOr<int> PreparedJob::SweepTmpFiles() const {
  int removed = 0;
  for (const std::unique_ptr<OutputMarker>& marker : markers_) {
    ASSIGN_OR_RETURN(int n, SweepTmpFilesIn(*marker));
    removed += n;
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
                                                         const TensorInventory& inventory,
                                                         const checkpoint::SourceRoots& roots) {
  absl::StatusOr<nlohmann::json> parsed =
      checkpoint::ReadJsonFile(path, kMaxAmaxFileBytes, roots, "calibration.amax_file");
  if (!parsed.ok()) return parsed.status();
  const nlohmann::json& j = *parsed;
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a JSON object {module: input_amax}"));
  }
  std::set<std::string> modules;
  for (const LinearModule& m : inventory.linears) modules.insert(m.name);
  std::vector<store::AmaxRow> rows;
  // The file may not be what the caller says it is (a secret they cannot read themselves): a
  // key is quoted only once it is known to be a module name, a value never.
  int64_t entry = 0;
  for (const auto& [module, value] : j.items()) {
    ++entry;
    // `quantd calibrate` also writes a routed w2's two measurements, "<w2>.unweighted" and
    // "<w2>.weighted", next to the exported "<w2>" (calibration/export_amax.h): not modules.
    if (absl::EndsWith(module, ".unweighted") || absl::EndsWith(module, ".weighted")) {
      const std::string base = module.substr(0, module.rfind('.'));
      if (modules.count(base) != 0 && j.contains(base)) continue;
    }
    if (modules.count(module) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": the key of entry ", entry, " (", module.size(),
                       " bytes) is not a linear module of the source checkpoint"));
    }
    const double v = value.is_number() ? value.get<double>() : NAN;
    if (!isfinite(v) || v < 0 || v > FLT_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": amax of ", module, " is not a finite float32 >= 0"));
    }
    rows.push_back(store::AmaxRow{module, "input", static_cast<float>(v), 0});
  }
  return rows;
}

absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> FindChangedOutputs(
    const std::vector<store::TaskRow>& tasks, const StageRegistry& stages) {
  std::vector<std::pair<int64_t, std::string>> changed;
  for (const store::TaskRow& t : tasks) {
    if (t.state != store::TaskState::kDone || t.output_path.empty()) continue;
    if (const Stage* stage = stages.Find(t.stage_kind);
        stage != nullptr && stage->ChecksOwnOutput(t)) {
      continue;
    }
    const std::string what = absl::StrCat(t.stage_kind, " ", t.name, ": output ", t.output_path);
    std::error_code ec;
    const std::filesystem::file_status st = std::filesystem::status(t.output_path, ec);
    if (std::filesystem::is_directory(st)) continue;
    if (!std::filesystem::exists(st)) {
      changed.emplace_back(t.id, absl::StrCat(what, " is gone"));
      continue;
    }
    const uintmax_t size = std::filesystem::file_size(t.output_path, ec);
    if (ec || !t.output_bytes.has_value() || size != static_cast<uintmax_t>(*t.output_bytes)) {
      changed.emplace_back(t.id, absl::StrCat(what, " has ", ec ? 0 : size, " bytes, recorded ",
                                              t.output_bytes.value_or(0)));
      continue;
    }
    // Hashing every output of a large model takes minutes: a cancelled or late planning stops
    // between chunks.
    ASSIGN_OR_RETURN(const std::string sha256,
                     checkpoint::Sha256File(t.output_path, [](uint64_t) {
                       return base::ThreadBudgetPoll() == base::BudgetLimit::kNone
                                  ? absl::OkStatus()
                                  : absl::CancelledError("planning stopped");
                     }));
    if (sha256 != t.output_sha256) {
      changed.emplace_back(t.id, absl::StrCat(what, " no longer has the recorded SHA-256"));
    }
  }
  return changed;
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
