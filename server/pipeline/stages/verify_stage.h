// Re-reads one output shard (after export), checks the export rules that concern its tensors
// (verify_rules.h) and measures each NVFP4 module's error against the source (TaskOutput.stats).
// Any violation fails the task (InvalidArgument listing every violation).
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
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
  // The per-tensor statistics, in the completion's transaction.
  absl::Status Record(store::TaskRecord& txn, const store::TaskRow& task,
                      const TaskOutput& output) const override;
};

// The body of a verify task.
absl::StatusOr<TaskOutput> RunVerifyTask(const StageContext& ctx, const ShardTask& task);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_VERIFY_STAGE_H_
