// Writes the BF16 copy of one source shard into spec.materialize_bf16 (same file name): FP8-block
// and MXFP4 weights dequantized exactly (the official formulas, RNE to BF16), their scale tensors
// dropped, every other tensor copied unchanged.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_DEQUANT_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_DEQUANT_STAGE_H_

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

class DequantStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "dequant";

  std::string_view kind() const override { return kKind; }
  // With spec.materialize_bf16: one task per source shard (payload DequantTask), after inspect.
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
};

// The body of a dequant task.
absl::StatusOr<TaskOutput> RunDequantTask(const StageContext& ctx, const DequantTask& task);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_DEQUANT_STAGE_H_
