// Re-reads one output shard (after export), checks the export rules that concern its tensors
// (verify_rules.h) and measures each NVFP4 module's error against the source (TaskOutput.stats).
// Any violation fails the task (InvalidArgument listing every violation).
#ifndef QUANTD_SERVER_PIPELINE_STAGES_VERIFY_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_VERIFY_STAGE_H_

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

absl::StatusOr<TaskOutput> RunVerifyTask(const StageContext& ctx, const ShardTask& task);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_VERIFY_STAGE_H_
