// Writes the BF16 copy of one source shard into spec.materialize_bf16 (same file name): FP8-block
// and MXFP4 weights dequantized exactly (the official formulas, RNE to BF16), their scale tensors
// dropped, every other tensor copied unchanged.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_DEQUANT_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_DEQUANT_STAGE_H_

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

absl::StatusOr<TaskOutput> RunDequantTask(const StageContext& ctx, const DequantTask& task);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_DEQUANT_STAGE_H_
