// StageRegistry: the stages a job can have, in display order. The planner asks each for its tasks,
// PreparedJob dispatches a task to the stage of its kind, and reports and metric labels take their
// kinds from here. BuiltinStages() (stage_registry.cc) is the one list of quantd's stages; tests
// build registries of fake stages.
#ifndef QUANTD_SERVER_PIPELINE_STAGE_REGISTRY_H_
#define QUANTD_SERVER_PIPELINE_STAGE_REGISTRY_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/pipeline/stage.h"

namespace quantd::pipeline {

class StageRegistry {
 public:
  // `stages` in display order; their kinds must differ.
  explicit StageRegistry(std::vector<std::unique_ptr<Stage>> stages);

  const std::vector<std::unique_ptr<Stage>>& stages() const { return stages_; }
  // The stage of `kind`; nullptr when this registry has none.
  const Stage* Find(std::string_view kind) const;
  // Every kind, in display order.
  std::vector<std::string> kinds() const;

 private:
  std::vector<std::unique_ptr<Stage>> stages_;  // fixed at construction
};

// inspect, dequant, calibrate, quantize, export, verify, evaluate.
const StageRegistry& BuiltinStages();

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGE_REGISTRY_H_
