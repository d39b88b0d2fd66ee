#include "server/pipeline/stage_registry.h"

#include <utility>

#include "server/pipeline/stages/calibrate_stage.h"
#include "server/pipeline/stages/dequant_stage.h"
#include "server/pipeline/stages/evaluate_stage.h"
#include "server/pipeline/stages/export_stage.h"
#include "server/pipeline/stages/inspect_stage.h"
#include "server/pipeline/stages/quantize_stage.h"
#include "server/pipeline/stages/verify_stage.h"

namespace quantd::pipeline {

StageRegistry::StageRegistry(std::vector<std::unique_ptr<Stage>> stages)
    : stages_(std::move(stages)) {}

const Stage* StageRegistry::Find(std::string_view kind) const {
  for (const std::unique_ptr<Stage>& stage : stages_) {
    if (stage->kind() == kind) return stage.get();
  }
  return nullptr;
}

std::vector<std::string> StageRegistry::kinds() const {
  std::vector<std::string> out;
  for (const std::unique_ptr<Stage>& stage : stages_) out.emplace_back(stage->kind());
  return out;
}

const StageRegistry& BuiltinStages() {
  static const StageRegistry* const registry = [] {
    std::vector<std::unique_ptr<Stage>> stages;
    // Display order. A new stage: its file under stages/ and one line here.
    stages.push_back(std::make_unique<InspectStage>());
    stages.push_back(std::make_unique<DequantStage>());
    stages.push_back(std::make_unique<CalibrateStage>());
    stages.push_back(std::make_unique<QuantizeStage>());
    stages.push_back(std::make_unique<ExportStage>());
    stages.push_back(std::make_unique<VerifyStage>());
    stages.push_back(std::make_unique<EvaluateStage>());
    return new StageRegistry(std::move(stages));
  }();
  return *registry;
}

}  // namespace quantd::pipeline
