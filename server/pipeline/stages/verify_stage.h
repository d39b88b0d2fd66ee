// Re-reads one output shard, checks the export rules that concern its tensors (verify_rules.h),
// then checks the file against the size and SHA-256 its quantize task recorded
// (StageContext::recorded_output): the size always, the SHA-256 of every byte read back when an
// earlier process recorded the task (RecordedOutput::written_by_this_process false) or the spec
// asks for it (verify.deep); this process hashed the bytes it wrote as it wrote them. Any
// violation fails the task (InvalidArgument listing every violation); bytes that differ from the
// recorded ones fail it with DataLoss.
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
  // One task per output shard (payload ShardTask), after the quantize task of its shard only, so
  // that it overlaps with the quantize tasks of later shards.
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
};

// The body of a verify task; it writes and records nothing.
absl::StatusOr<TaskOutput> RunVerifyTask(const StageContext& ctx, const ShardTask& task);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_VERIFY_STAGE_H_
