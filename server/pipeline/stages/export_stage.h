// Writes the checkpoint-level files of spec.output once every shard is written:
// model.safetensors.index.json (from the output shards' headers), config.json with the
// quantization_config of spec.export_format, hf_quant_config.json (ModelOpt format), and the
// source's tokenizer, generation and other non-weight files copied unchanged; last,
// quantd_manifest.json with the size and SHA-256 of every file of the output (output_manifest.h).
#ifndef QUANTD_SERVER_PIPELINE_STAGES_EXPORT_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_EXPORT_STAGE_H_

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

class ExportStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "export";

  std::string_view kind() const override { return kKind; }
  // One task, "export", after every quantize task and every dequant task (it indexes their shards).
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  // Uses ctx.plan.
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
};

// `plan` is the job's plan (rebuilt deterministically from the spec and the source); export
// reads its output shard names and the recipe's selection (for exclude_modules).
absl::StatusOr<TaskOutput> RunExportTask(const StageContext& ctx, const Plan& plan);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_EXPORT_STAGE_H_
