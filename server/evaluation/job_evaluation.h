// The runtime state of one job's evaluate stage in this process (owned by its
// pipeline::PreparedJob, shared by the worker threads; thread-safe):
//   - the job's output opened as a DeepSeek-V4 model (on first use, by the first evaluate task,
//     which runs after export);
//   - both models' activations between decoder layers (a calibration::ActivationStore in host
//     memory: slot kSourceSlot and kQuantizedSlot of each layer);
//   - the layer checkpoints (calibration/layer_checkpoint.h, "<work_dir>/evaluate-layers", on
//     the job's calibration.checkpoint_seconds): both models' outputs of a layer kept on disk at a
//     boundary, so that a restart resumes after it (Resume). A layer's checkpoint is the one
//     "slice" 0 of its layer task, whose batches are the source model's, then the quantized
//     model's, batch for batch;
//   - the figures of the evaluate tasks whose completion was committed (or, at a restart, of the
//     layer tasks that stay done: Restore), which the head and gate tasks read.
// The stage's tasks run one after the other (each depends on the one before). The scheduler
// reports each finished evaluate task (OnTaskDone, after its completion is committed): a layer's
// releases the activations of the layer before (and, checkpointed, the earlier checkpoints), the
// head's those of the last layer, the gate's every checkpoint (the stage is done).
//
// Held-out activations never spill: two copies (one per model) of num_samples x seq_len tokens of
// hc_mult x hidden_size floats (DeepSeek-V4 Pro, 32 x 512 tokens: 2 x 1.9 GB). A resumed layer's
// checkpoint is read back into host memory.
#ifndef QUANTD_SERVER_EVALUATION_JOB_EVALUATION_H_
#define QUANTD_SERVER_EVALUATION_JOB_EVALUATION_H_

#include <stdint.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/calibration/activation_store.h"
#include "server/calibration/layer_checkpoint.h"
#include "server/evaluation/evaluate_task.h"
#include "server/evaluation/evaluation_batches.h"
#include "server/model/v4_weights.h"
#include "server/store/job_store.h"

namespace quantd::evaluation {

// The stored task's payload when it is an evaluate task (pipeline::EvaluateStage::kKind);
// nullopt for another stage's task or a payload that does not parse (the stage refuses it when it
// runs).
std::optional<EvaluateTask> EvaluateTaskOf(const store::TaskRow& row);

class JobEvaluation {
 public:
  // `work_dir`: the job's own directory, where the checkpoints go (created).
  // `checkpoint_seconds`: calibration.checkpoint_seconds. `now_ms`: the checkpoints' clock.
  static absl::StatusOr<std::unique_ptr<JobEvaluation>> Create(
      const std::string& work_dir, int64_t checkpoint_seconds,
      calibration::MonotonicMs now_ms = calibration::SteadyNowMs);

  // The job's output checkpoint as a V4 model, opened on the first call beneath `output`, the
  // handle the job wrote it through (never through the spec's path again).
  absl::StatusOr<const model::V4Checkpoint*> Quantized(const checkpoint::DirHandle& output)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Stores both models' outputs of `layer` (replacing an earlier run's). When the checkpoint
  // policy says so (LayerCheckpoints::ShouldPersist), first writes them to the layer's checkpoint
  // and returns it (the task's output, committed with its completion); nullopt otherwise.
  // `on_batch` (may be empty) is called after each checkpointed batch.
  absl::StatusOr<std::optional<calibration::CheckpointFile>> PutOutput(
      int64_t layer, Batches source, Batches quantized,
      const std::function<void()>& on_batch = nullptr);
  // Both models' outputs of `layer`; nullopt when they are not in this process.
  std::optional<EvaluationBatches> Output(int64_t layer) const;

  // At a restart, before Restore (files only): where the stage resumes among the job's stored
  // `tasks` (calibration::ResumeLayers over its layer tasks, the head and the gate counted as
  // layers N and N+1 that never checkpoint, so that the stage is finished only with them and
  // they are requeued when done after the resume layer). The resume layer's checkpoint is read
  // back into host memory; one that cannot be is not trusted (the stage resumes from layer 0).
  // The caller requeues ResumePoint::requeue.
  calibration::ResumePoint Resume(const std::vector<store::TaskRow>& tasks);
  // At (re)start, after the requeues: the committed figures of the layers (JobStore::
  // ListEvaluationLayers) whose layer task is DONE among `tasks`.
  void Restore(const std::vector<store::EvaluationLayerRow>& rows,
               const std::vector<store::TaskRow>& tasks) ABSL_LOCKS_EXCLUDED(mu_);

  // An evaluate task's completion was committed with its output: a layer's figures (`layer`) and
  // checkpoint manifest (`output_path`, "" when it kept none), or the head's figures (`figures`).
  void OnTaskDone(const store::TaskRow& task, const std::string& output_path,
                  const std::optional<store::EvaluationLayerRow>& layer,
                  const std::optional<store::EvaluationRow>& figures) ABSL_LOCKS_EXCLUDED(mu_);
  // The committed figures of every layer so far, by layer.
  std::map<int64_t, store::EvaluationLayerRow> Layers() const ABSL_LOCKS_EXCLUDED(mu_);
  // The head's committed figures; nullopt before it finished in this process.
  std::optional<store::EvaluationRow> Figures() const ABSL_LOCKS_EXCLUDED(mu_);

  const calibration::LayerCheckpoints& checkpoints() const { return *checkpoints_; }

  static constexpr int64_t kSourceSlot = 0;     // ActivationStore slice of the source model
  static constexpr int64_t kQuantizedSlot = 1;  // and of the quantized model

 private:
  JobEvaluation(std::unique_ptr<calibration::ActivationStore> store,
                std::unique_ptr<calibration::LayerCheckpoints> checkpoints)
      : activations_(std::move(store)),
        checkpoints_(std::move(checkpoints)) {}
  // Stores both models' host outputs of `layer`, reserving their bytes.
  void Store(int64_t layer, Batches source, Batches quantized);

  const std::unique_ptr<calibration::ActivationStore> activations_;  // thread-safe itself
  const std::unique_ptr<calibration::LayerCheckpoints> checkpoints_;  // thread-safe itself

  mutable absl::Mutex mu_;  // guards the members below
  std::unique_ptr<model::V4Checkpoint> quantized_ ABSL_GUARDED_BY(mu_);  // opened on first use
  std::map<int64_t, store::EvaluationLayerRow> layers_ ABSL_GUARDED_BY(mu_);
  std::optional<store::EvaluationRow> figures_ ABSL_GUARDED_BY(mu_);
};

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_JOB_EVALUATION_H_
