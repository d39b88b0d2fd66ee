#include "server/pipeline/stages/evaluate_stage.h"

#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "server/base/status_macros.h"
#include "server/calibration/job_calibration.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/sha256.h"
#include "server/evaluation/quality_gate.h"
#include "server/evaluation/run_evaluation.h"
#include "server/pipeline/stages/calibrate_stage.h"
#include "server/pipeline/stages/export_stage.h"
#include "server/pipeline/stages/verify_stage.h"

namespace quantd::pipeline {

absl::StatusOr<std::vector<store::TaskPlan>> EvaluateStage::Plan(const PlanInput& input) const {
  std::vector<store::TaskPlan> tasks;
  if (!NeedsCalibration(*input.spec) || !input.spec->evaluate.requested()) return tasks;
  std::vector<store::TaskRef> after = {
      {std::string(ExportStage::kKind), std::string(ExportStage::kKind)}};
  for (const OutputShard& shard : input.output_shards) {
    after.push_back({std::string(VerifyStage::kKind), shard.task.shard});
  }
  tasks.push_back({std::string(kKind), "{}", 0, "held-out samples", {}, std::move(after)});
  return tasks;
}

absl::StatusOr<TaskOutput> EvaluateStage::Run(const store::TaskRow& /*task*/,
                                              compute::Device& device,
                                              const StageContext& ctx) const {
  if (ctx.calibration == nullptr) {
    return absl::InternalError("an evaluate task ran without the job's calibration state");
  }
  evaluation::EvaluationRequest request;
  request.spec = ctx.spec;
  request.source = ctx.spec->source;
  request.quantized = ctx.spec->output;
  request.tokenizer_dir = ctx.spec->source;
  request.progress = [&ctx](std::string_view) {
    if (ctx.add_progress) ctx.add_progress(0);  // the heartbeat, once per layer
  };
  request.cancelled = ctx.cancelled;
  ASSIGN_OR_RETURN(const evaluation::QualityReport report,
                   evaluation::RunEvaluation(request, device));

  const std::string text = evaluation::EvaluationJson(report, ctx.spec->evaluate.gate).dump(2);
  TaskOutput out;
  out.path = (std::filesystem::path(ctx.calibration->work_dir()) / "evaluation.json").string();
  RETURN_IF_ERROR(checkpoint::WriteFileAtomically(out.path, text + "\n"));
  if (absl::Status gate = evaluation::CheckQualityGate(ctx.spec->evaluate.gate, report);
      !gate.ok()) {
    return WithJobReason(gate, kQualityGateReason);
  }
  out.bytes = text.size() + 1;
  checkpoint::Sha256 hash;
  hash.Update(text.data(), text.size());
  hash.Update("\n", 1);
  out.sha256 = hash.HexDigest();
  return out;
}

}  // namespace quantd::pipeline
