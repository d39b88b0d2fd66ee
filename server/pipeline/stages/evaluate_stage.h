// evaluate: the job's output against its source on held-out samples of the calibration data
// (server/evaluation/), planned for every job that calibrates on data (NeedsCalibration) unless
// its spec sets evaluate.enabled false. Its tasks (evaluation/evaluate_task.h) run one after the
// other:
//   - "layer<L>", one per decoder layer ("layer L+1 of N"): layer 0 after export and every verify
//     task, layer L after layer L-1. Runs EvaluateLayer on the previous layer's outputs of both
//     models (layer 0: the held-out samples embedded), keeps its outputs in the job's
//     evaluation::JobEvaluation, and records the layer's SQNR with its completion;
//   - "head", after the last layer: both heads, the next-token figures and the gate's verdict,
//     recorded with its completion whatever the verdict;
//   - "gate", after the head: fails the job with reason kQualityGateReason, naming the figure and
//     the worst layer, when spec.evaluate.gate is broken. The output stays on disk.
// Task bytes are held-out tokens (every layer and the head move all of them), as for calibrate.
//
// The held-out samples are selected at planning (evaluation/held_out_samples.h): too few of them
// fails the plan, not a task. Layer 0 selects them again and refuses to run when they changed.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_EVALUATE_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_EVALUATE_STAGE_H_

#include <stdint.h>

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

// The job's failure reason when its quality gate is broken.
inline constexpr std::string_view kQualityGateReason = "QUALITY_GATE";

// Whether a job of `spec` plans the evaluate stage.
bool NeedsEvaluation(const JobSpec& spec);

// Where a new process resumes the evaluate stage: the ids of the done evaluate tasks among the
// job's stored `tasks` that must run again. The activations between its layers lived only in the
// process that stopped, so while the stage is unfinished every done task of it runs again (from
// layer 0; each rerun replaces its recorded figures); none once the stage is finished.
std::vector<int64_t> EvaluateTasksToRedo(const std::vector<store::TaskRow>& tasks);

class EvaluateStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "evaluate";

  std::string_view kind() const override { return kKind; }
  // InvalidArgument when evaluate.enabled is true for a job that does not calibrate on data, or
  // the data holds too few held-out samples (evaluation/held_out_samples.h).
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  // Needs ctx.calibration (the source model) and ctx.evaluation.
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
  // A layer's figures (TaskOutput::evaluation_layer) or the job's (TaskOutput::evaluation)
  // replace those of an earlier run.
  absl::Status Record(store::TaskRecord& txn, const store::TaskRow& task,
                      const TaskOutput& output) const override;
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_EVALUATE_STAGE_H_
