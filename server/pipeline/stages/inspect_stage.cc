#include "server/pipeline/stages/inspect_stage.h"

#include <memory>

#include "server/base/status_macros.h"
#include "server/pipeline/prepared_job.h"

namespace quantd::pipeline {

using checkpoint::BuildInventory;
using checkpoint::TensorInventory;

absl::StatusOr<std::vector<store::TaskPlan>> InspectStage::Plan(const PlanInput&) const {
  return std::vector<store::TaskPlan>{{std::string(kKind), "{}", 0, "", {}, {}}};
}

absl::StatusOr<TaskOutput> InspectStage::Run(const store::TaskRow&, compute::Device&,
                                             const StageContext& ctx) const {
  ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointDir> source,
                   checkpoint::CheckpointDir::Open(ctx.spec->source, ctx.spec->source_roots));
  ASSIGN_OR_RETURN(TensorInventory inventory, BuildInventory(*source));
  ASSIGN_OR_RETURN(pipeline::Plan plan, BuildPlan(*ctx.spec, *source, inventory));
  RETURN_IF_ERROR(CheckPlanUnchanged(plan, *ctx.stored_tasks));
  RETURN_IF_ERROR(
      CheckDiskSpace(*ctx.spec, plan, ctx.work_dir != nullptr ? *ctx.work_dir : std::string()));
  return TaskOutput{};
}

}  // namespace quantd::pipeline
