// Writes one output shard into spec.output: the task's copy_tensors unchanged and its modules as
// NVFP4 (spec.export_format's tensor names, plan.h Nvfp4ModuleTensors), fusion groups sharing one
// weight_scale_2 and one input_scale. MXFP4 experts use the lossless cast unless
// spec.expert_cast is requantize.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_QUANTIZE_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_QUANTIZE_STAGE_H_

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

absl::StatusOr<TaskOutput> RunQuantizeTask(const StageContext& ctx, const ShardTask& task);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_QUANTIZE_STAGE_H_
