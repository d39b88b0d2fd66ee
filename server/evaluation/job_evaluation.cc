#include "server/evaluation/job_evaluation.h"

#include <filesystem>
#include <iterator>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/calibration/calibrate_layer.h"
#include "server/evaluation/evaluate_task.h"
#include "server/model/v4_activations.h"

namespace quantd::evaluation {
namespace {

// The batches of a checkpoint (spilled: its files, verified by ResumeLayers) read into host
// memory.
absl::StatusOr<Batches> ReadIntoHost(const Batches& checkpointed) {
  Batches host;
  for (const calibration::BatchActivations& b : checkpointed) {
    calibration::BatchActivations h;
    h.tokens = b.tokens;
    ASSIGN_OR_RETURN(h.host, model::ReadActivations(b.spill_path));
    host.push_back(std::move(h));
  }
  return host;
}

}  // namespace

std::optional<EvaluateTask> EvaluateTaskOf(const store::TaskRow& row) {
  if (row.stage_kind != "evaluate") return std::nullopt;
  absl::StatusOr<EvaluateTask> task = ParseEvaluateTask(row.payload_json);
  if (!task.ok()) return std::nullopt;
  return *std::move(task);
}

absl::StatusOr<std::unique_ptr<JobEvaluation>> JobEvaluation::Create(
    const std::string& work_dir, int64_t checkpoint_seconds, calibration::MonotonicMs now_ms) {
  if (work_dir.empty()) {
    return absl::InvalidArgumentError("an evaluating job needs its work directory");
  }
  // No spill directory: every output stays in host memory.
  ASSIGN_OR_RETURN(std::unique_ptr<calibration::ActivationStore> store,
                   calibration::ActivationStore::Create("", 0));
  ASSIGN_OR_RETURN(std::unique_ptr<calibration::LayerCheckpoints> checkpoints,
                   calibration::LayerCheckpoints::Create(
                       (std::filesystem::path(work_dir) / "evaluate-layers").string(),
                       checkpoint_seconds, std::move(now_ms)));
  return std::unique_ptr<JobEvaluation>(
      new JobEvaluation(std::move(store), std::move(checkpoints)));
}

absl::StatusOr<const model::V4Checkpoint*> JobEvaluation::Quantized(
    const checkpoint::DirHandle& output) {
  absl::MutexLock lock(&mu_);
  if (quantized_ == nullptr) {
    ASSIGN_OR_RETURN(quantized_, model::OpenV4Checkpoint(output));
  }
  return quantized_.get();
}

absl::StatusOr<std::optional<calibration::CheckpointFile>> JobEvaluation::PutOutput(
    int64_t layer, Batches source, Batches quantized, const std::function<void()>& on_batch) {
  std::optional<calibration::CheckpointFile> file;
  if (checkpoints_->ShouldPersist(layer, /*all_spilled=*/false)) {
    // One list, the source's batches then the quantized model's, moved (not copied) and back.
    const size_t n = source.size();
    Batches both = std::move(source);
    both.insert(both.end(), std::make_move_iterator(quantized.begin()),
                std::make_move_iterator(quantized.end()));
    ASSIGN_OR_RETURN(file, checkpoints_->Persist(layer, /*slice=*/0, both, on_batch));
    source.assign(std::make_move_iterator(both.begin()),
                  std::make_move_iterator(both.begin() + n));
    quantized.assign(std::make_move_iterator(both.begin() + n),
                     std::make_move_iterator(both.end()));
  }
  Store(layer, std::move(source), std::move(quantized));
  return file;
}

void JobEvaluation::Store(int64_t layer, Batches source, Batches quantized) {
  for (const Batches* batches : {&source, &quantized}) {
    for (const calibration::BatchActivations& b : *batches) {
      activations_->ReserveHost(calibration::HostBytes(b.host));  // never refused: no spill dir
    }
  }
  activations_->Put(layer, kSourceSlot, std::move(source));
  activations_->Put(layer, kQuantizedSlot, std::move(quantized));
}

std::optional<EvaluationBatches> JobEvaluation::Output(int64_t layer) const {
  EvaluationBatches batches{activations_->Get(layer, kSourceSlot),
                            activations_->Get(layer, kQuantizedSlot)};
  if (batches.source == nullptr || batches.quantized == nullptr) return std::nullopt;
  return batches;
}

calibration::ResumePoint JobEvaluation::Resume(const std::vector<store::TaskRow>& tasks) {
  std::vector<calibration::LayerTask> layer_tasks;
  for (const store::TaskRow& row : tasks) {
    const std::optional<EvaluateTask> task = EvaluateTaskOf(row);
    if (!task.has_value()) continue;
    int64_t layer = task->layer;
    if (task->kind == EvaluateTask::Kind::kHead) layer = task->layers;
    if (task->kind == EvaluateTask::Kind::kGate) layer = task->layers + 1;
    layer_tasks.push_back({layer, /*slice=*/0, row});
  }
  calibration::ResumePoint point =
      calibration::ResumeLayers(layer_tasks, /*slices=*/1, *checkpoints_, *activations_);
  if (point.layer < 0) return point;
  const std::shared_ptr<const Batches> both = activations_->Get(point.layer, 0);
  absl::StatusOr<Batches> host = ReadIntoHost(*both);
  if (host.ok() && host->size() % 2 == 0) {
    const size_t n = host->size() / 2;
    Batches source(std::make_move_iterator(host->begin()),
                   std::make_move_iterator(host->begin() + n));
    Batches quantized(std::make_move_iterator(host->begin() + n),
                      std::make_move_iterator(host->end()));
    activations_->ReleaseLayer(point.layer);  // the checkpoint's files stay its own
    Store(point.layer, std::move(source), std::move(quantized));
    return point;
  }
  // Not two activation sets batch for batch, or unreadable: from layer 0, as without it.
  point.rejected.push_back(absl::StrCat(
      "layer ", point.layer, ": checkpoint not used: ",
      host.ok() ? std::string("it does not hold both models' batches")
                : std::string(host.status().message())));
  activations_->ReleaseLayer(point.layer);
  point.layer = -1;
  point.requeue.clear();
  for (const calibration::LayerTask& t : layer_tasks) {
    if (t.row.state == store::TaskState::kDone) point.requeue.push_back(t.row.id);
  }
  checkpoints_->RemoveAllBut(-1);
  return point;
}

void JobEvaluation::Restore(const std::vector<store::EvaluationLayerRow>& rows,
                            const std::vector<store::TaskRow>& tasks) {
  std::set<int64_t> done;
  for (const store::TaskRow& row : tasks) {
    const std::optional<EvaluateTask> task = EvaluateTaskOf(row);
    if (task.has_value() && task->kind == EvaluateTask::Kind::kLayer &&
        row.state == store::TaskState::kDone) {
      done.insert(task->layer);
    }
  }
  absl::MutexLock lock(&mu_);
  for (const store::EvaluationLayerRow& r : rows) {
    if (done.count(r.layer) != 0) layers_[r.layer] = r;
  }
}

void JobEvaluation::OnTaskDone(const store::TaskRow& row, const std::string& output_path,
                               const std::optional<store::EvaluationLayerRow>& layer,
                               const std::optional<store::EvaluationRow>& figures) {
  const std::optional<EvaluateTask> task = EvaluateTaskOf(row);
  if (!task.has_value()) return;
  absl::MutexLock lock(&mu_);
  switch (task->kind) {
    case EvaluateTask::Kind::kLayer:
      if (layer.has_value()) layers_[task->layer] = *layer;
      if (task->layer > 0) activations_->ReleaseLayer(task->layer - 1);
      if (!output_path.empty()) checkpoints_->OnBoundaryCommitted(task->layer);
      break;
    case EvaluateTask::Kind::kHead:
      if (figures.has_value()) figures_ = figures;
      activations_->ReleaseLayer(task->layers - 1);
      break;
    case EvaluateTask::Kind::kGate:
      checkpoints_->RemoveAllBut(-1);  // the stage is done: no restart needs a layer's outputs
      break;
  }
}

std::map<int64_t, store::EvaluationLayerRow> JobEvaluation::Layers() const {
  absl::MutexLock lock(&mu_);
  return layers_;
}

std::optional<store::EvaluationRow> JobEvaluation::Figures() const {
  absl::MutexLock lock(&mu_);
  return figures_;
}

}  // namespace quantd::evaluation
