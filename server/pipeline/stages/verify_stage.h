// Re-reads one output shard (after export) whole: its size and SHA-256 must be those the quantize
// task recorded for the file it wrote and measured (DataLoss otherwise: the statistics would not
// describe it), then the export rules that concern its tensors (verify_rules.h) and the BF16
// modules against their decoded source. Any violation fails the task (InvalidArgument listing
// every violation). The error statistics are the quantize task's (nvfp4_error.h).
#ifndef QUANTD_SERVER_PIPELINE_STAGES_VERIFY_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_VERIFY_STAGE_H_

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

class VerifyStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "verify";

  std::string_view kind() const override { return kKind; }
  // One task per output shard (payload ShardTask), after the quantize task of its shard and export.
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  // Checks the shard against the output the quantize task of the shard recorded (task.inputs).
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
};

// The body of a verify task: `written` is the quantize task's recorded output of the shard.
absl::StatusOr<TaskOutput> RunVerifyTask(const StageContext& ctx, const ShardTask& task,
                                         const store::TaskInput& written);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_VERIFY_STAGE_H_
