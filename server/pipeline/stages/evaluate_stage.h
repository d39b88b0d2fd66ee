// evaluate: the job's output against its source on held-out samples of the calibration data
// (server/evaluation/run_evaluation.h), planned for a job that calibrates (NeedsCalibration) and
// whose spec asks for it (EvaluateSpec::requested): one task "evaluate" after export and every
// verify task. It writes the figures with the gate's verdict as JSON to
// "<work dir>/evaluation.json" (the task's output file), and fails the job with reason
// kQualityGateReason when spec.evaluate.gate is broken; the output stays on disk.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_EVALUATE_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_EVALUATE_STAGE_H_

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

// The job's failure reason when its quality gate is broken.
inline constexpr std::string_view kQualityGateReason = "QUALITY_GATE";

class EvaluateStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "evaluate";

  std::string_view kind() const override { return kKind; }
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  // Needs ctx.calibration (its work directory holds the figures).
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_EVALUATE_STAGE_H_
