#include "server/calibration/job_calibration.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <utility>

#include "server/base/status_macros.h"
#include "server/calibration/amax_rows.h"
#include "server/calibration/calibrate_task.h"

namespace quantd::calibration {

int64_t DefaultActivationBudget() {
  const int64_t pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? pages * page / 4 : int64_t{1} << 32;
}

absl::StatusOr<std::unique_ptr<JobCalibration>> JobCalibration::Create(
    const job::JobSpec& spec, std::shared_ptr<const checkpoint::CheckpointDir> source,
    const std::string& work_dir, int64_t host_budget_bytes, MonotonicMs now_ms) {
  if (work_dir.empty()) {
    return absl::InvalidArgumentError("a calibrating job needs its work directory");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ActivationStore> activations,
                   ActivationStore::Create(work_dir, host_budget_bytes > 0
                                                         ? host_budget_bytes
                                                         : DefaultActivationBudget()));
  ASSIGN_OR_RETURN(std::unique_ptr<LayerCheckpoints> checkpoints,
                   LayerCheckpoints::Create(
                       (std::filesystem::path(work_dir) / "calibrate-layers").string(),
                       spec.calibration.checkpoint_seconds, std::move(now_ms)));
  return std::unique_ptr<JobCalibration>(new JobCalibration(
      spec, std::move(source), work_dir, std::move(activations), std::move(checkpoints)));
}

JobCalibration::JobCalibration(const job::JobSpec& spec,
                               std::shared_ptr<const checkpoint::CheckpointDir> source,
                               std::string work_dir,
                               std::unique_ptr<ActivationStore> activations,
                               std::unique_ptr<LayerCheckpoints> checkpoints)
    : spec_(spec),
      source_(std::move(source)),
      work_dir_(work_dir),
      tokens_path_((std::filesystem::path(work_dir) / "tokens.bin").string()),
      activations_(std::move(activations)),
      checkpoints_(std::move(checkpoints)) {}

absl::StatusOr<const model::V4Checkpoint*> JobCalibration::Checkpoint() {
  absl::MutexLock lock(&mu_);
  if (ckpt_ == nullptr) {
    ASSIGN_OR_RETURN(ckpt_, model::OpenV4Checkpoint(source_));
  }
  return ckpt_.get();
}

absl::StatusOr<std::shared_ptr<const JobTokens>> JobCalibration::Tokens(int64_t vocab) {
  absl::MutexLock lock(&mu_);
  if (tokens_ == nullptr) {
    if (tokens_sha256_.empty()) {
      return absl::FailedPreconditionError("the calibration tokens task has not finished");
    }
    ASSIGN_OR_RETURN(JobTokens tokens, ReadTokensFile(tokens_path_, tokens_sha256_, vocab));
    tokens_ = std::make_shared<const JobTokens>(std::move(tokens));
  }
  return tokens_;
}

void JobCalibration::MergeRows(const std::vector<store::AmaxRow>& rows) {
  for (const store::AmaxRow& r : rows) {
    if (r.kind != "input") continue;
    auto [it, inserted] = amax_.emplace(r.module, r);
    if (inserted) continue;
    it->second.value = std::max(it->second.value, r.value);
    it->second.samples += r.samples;
  }
}

void JobCalibration::PutTaskRows(int64_t task_id, std::vector<store::AmaxRow> rows) {
  auto [it, inserted] = task_amax_.try_emplace(task_id);
  it->second = std::move(rows);
  if (inserted) {
    MergeRows(it->second);
    return;
  }
  amax_.clear();
  for (const auto& [id, task_rows] : task_amax_) MergeRows(task_rows);
}

ResumePoint JobCalibration::Resume(const std::vector<store::TaskRow>& tasks) {
  std::vector<LayerTask> layer_tasks;
  int64_t slices = 1;
  for (const store::TaskRow& t : tasks) {
    if (t.stage_kind != "calibrate") continue;
    absl::StatusOr<CalibrateTask> task = ParseCalibrateTask(t.payload_json);
    if (!task.ok() || task->kind != CalibrateTask::Kind::kLayer) continue;
    slices = task->slices;
    layer_tasks.push_back({task->layer, task->slice, t});
  }
  return ResumeLayers(layer_tasks, slices, *checkpoints_, *activations_);
}

void JobCalibration::Restore(const std::vector<store::TaskAmaxRow>& rows,
                             const std::vector<store::TaskRow>& tasks) {
  absl::MutexLock lock(&mu_);
  std::map<int64_t, std::vector<store::AmaxRow>> by_task;
  for (const store::TaskAmaxRow& r : rows) by_task[r.task_id].push_back(r.amax);
  for (auto& [task_id, task_rows] : by_task) PutTaskRows(task_id, std::move(task_rows));
  for (const store::TaskRow& t : tasks) {
    if (t.stage_kind != "calibrate" || t.state != store::TaskState::kDone) continue;
    absl::StatusOr<CalibrateTask> task = ParseCalibrateTask(t.payload_json);
    if (!task.ok()) continue;  // the stage refuses it when it runs
    if (task->kind == CalibrateTask::Kind::kTokens) tokens_sha256_ = t.output_sha256;
    if (task->kind == CalibrateTask::Kind::kLayer) done_[task->layer].insert(task->slice);
  }
}

void JobCalibration::OnTaskDone(const store::TaskRow& row,
                                const std::vector<store::AmaxRow>& amax,
                                const std::string& output_path,
                                const std::string& output_sha256) {
  absl::StatusOr<CalibrateTask> task = ParseCalibrateTask(row.payload_json);
  if (!task.ok()) return;
  absl::MutexLock lock(&mu_);
  switch (task->kind) {
    case CalibrateTask::Kind::kTokens:
      tokens_sha256_ = output_sha256;
      tokens_ = nullptr;  // a rerun wrote the file again: read it again
      break;
    case CalibrateTask::Kind::kLayer: {
      PutTaskRows(row.id, amax);
      std::set<int64_t>& done = done_[task->layer];
      done.insert(task->slice);
      std::set<int64_t>& checkpointed = checkpointed_[task->layer];
      if (!output_path.empty()) checkpointed.insert(task->slice);
      if (static_cast<int64_t>(done.size()) < task->slices) break;
      // Layer L is done: nobody reads L-1's activations any more.
      if (task->layer > 0) activations_->ReleaseLayer(task->layer - 1);
      if (task->layer + 1 == task->layers) {
        checkpoints_->RemoveAllBut(-1);  // calibrated: no restart needs a layer's outputs
      } else if (static_cast<int64_t>(checkpointed.size()) == task->slices) {
        checkpoints_->OnBoundaryCommitted(task->layer);
      }
      break;
    }
    case CalibrateTask::Kind::kAmaxOut:
      break;
  }
}

AmaxTable JobCalibration::Table() const {
  std::vector<store::AmaxRow> rows;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [module, row] : amax_) rows.push_back(row);
  }
  return FromAmaxRows(rows);
}

}  // namespace quantd::calibration
