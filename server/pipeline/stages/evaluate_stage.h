// evaluate: the job's output against its source on held-out samples of the calibration data
// (server/evaluation/), planned for every job that calibrates on data (NeedsCalibration) unless
// its spec sets evaluate.enabled false. Its tasks (evaluation/evaluate_task.h) run one after the
// other:
//   - "layer<L>", one per decoder layer ("layer L+1 of N"): layer 0 after export and every verify
//     task, layer L after layer L-1. Runs EvaluateLayer on the previous layer's outputs of both
//     models (layer 0: the held-out samples embedded), keeps its outputs in the job's
//     evaluation::JobEvaluation, and records the layer's SQNR with its completion. At a layer
//     boundary (calibration.checkpoint_seconds, as for calibrate: 0 = every layer) both outputs
//     are also checkpointed on disk, and the task's output is the checkpoint's manifest;
//   - "head", after the last layer: both heads, the next-token figures and the gate's verdict,
//     recorded with its completion whatever the verdict;
//   - "gate", after the head: fails the job with reason kQualityGateReason, naming the figure and
//     the worst layer, when spec.evaluate.gate is broken. The output stays on disk.
// Task bytes are held-out tokens, the plan's bound (every layer and the head move all of them), as
// for calibrate.
//
// The stage keeps each evaluating job's evaluation::JobEvaluation (both models' activations,
// figures so far) in its StageJob (OpenJob), with layer checkpoints of its own
// ("<work_dir>/evaluate-layers"). A restart with the stage unfinished resumes after the last layer
// whose checkpoint verifies (OpenJob verifies and loads it, JobEvaluation::Resume; also when every
// layer is done and the head is not; the layer tasks' outputs are checked there, not with the
// job's other outputs: ChecksOwnOutput): Attach requeues the done tasks after it (the head too,
// whose figures lived in the process that stopped) and logs the layer; the tasks up to it keep
// their recorded figures. Without such a layer the stage runs again from layer 0; either way the
// figures equal an uninterrupted run's.
//
// Planning reads no data: the held-out samples (evaluation/held_out_samples.h) are selected and
// tokenized by the calibrate stage's tokens task, the job's first task after inspect, into the
// job's tokens file (job_tokens.h): too few of them fails that task, long before evaluation.
// Layer 0 reads them from that file (checked against its recorded SHA-256).
#ifndef QUANTD_SERVER_PIPELINE_STAGES_EVALUATE_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_EVALUATE_STAGE_H_

#include <stdint.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

// The job's failure reason when its quality gate is broken.
inline constexpr std::string_view kQualityGateReason = "QUALITY_GATE";

// Whether a job of `spec` plans the evaluate stage.
bool NeedsEvaluation(const job::JobSpec& spec);

class EvaluateStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "evaluate";

  std::string_view kind() const override { return kKind; }
  // InvalidArgument when evaluate.enabled is true for a job that does not calibrate on data, or
  // the data holds too few held-out samples (evaluation/held_out_samples.h).
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  // Two boundaries of every held-out token, for both models.
  absl::StatusOr<uint64_t> CheckpointBytes(
      const PlanInput& input, const std::vector<store::TaskPlan>& tasks) const override;
  // Needs the job the stage opened (OpenJob) and the calibrate stage's (the source model).
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
  // A layer's figures or the job's (the head's result) replace those of an earlier run.
  absl::Status Record(store::TaskRecord& txn, const store::TaskRow& task,
                      const TaskOutput& output) const override;
  // An evaluating job's evaluation, and on a later start where it resumes (above).
  absl::StatusOr<std::unique_ptr<StageJob>> OpenJob(const StageJobInput& input) const override;
  // A job planned by a release without this stage (no evaluate task stored, evaluate.enabled
  // unset) keeps its plan: evaluate.enabled becomes false.
  void AdaptSpec(const std::vector<store::TaskRow>& stored, job::JobSpec& spec) const override;
  // The layer tasks, whose output is a layer checkpoint.
  bool ChecksOwnOutput(const store::TaskRow& task) const override;
  std::string_view progress_unit() const override { return "tokens"; }
  // The stage runs one task at a time: its label ("layer 3 of 8").
  std::string ProgressStep(const std::vector<const store::TaskRow*>& running) const override;
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_EVALUATE_STAGE_H_
