// Writes the checkpoint-level files of spec.output once every shard is written:
// model.safetensors.index.json (from the output shards' headers), config.json with the
// quantization_config of spec.export_format, hf_quant_config.json (ModelOpt format), and the
// source's tokenizer, generation and other non-weight files copied unchanged.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_EXPORT_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_EXPORT_STAGE_H_

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

// `plan` is the job's plan (rebuilt deterministically from the spec and the source); export
// reads its output shard names and the recipe's selection (for exclude_modules).
absl::StatusOr<TaskOutput> RunExportTask(const StageContext& ctx, const Plan& plan);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_EXPORT_STAGE_H_
