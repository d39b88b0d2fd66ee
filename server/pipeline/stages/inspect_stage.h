// inspect: the job's first task. Re-reads the source headers, checks that they still give the
// stored plan and that the output fits on disk, before any task writes.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_INSPECT_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_INSPECT_STAGE_H_

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

class InspectStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "inspect";

  std::string_view kind() const override { return kKind; }
  // One task, "inspect", depending on nothing.
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  // Uses ctx.spec and ctx.stored_tasks; reads the source afresh (not ctx.source).
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_INSPECT_STAGE_H_
