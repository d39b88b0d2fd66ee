// input_scale of every NVFP4 module of a quantize task, from the calibrated amax table.
//
// input_scale = input_amax / 2688 in float32 (ModelOpt's NVFP4 activation scale). Members of a
// fusion group share one value, computed from the max of their amax. A routed expert
// (`<layer>.experts.<E>.<projection>`) without an amax row, one that no calibration token
// reached, takes the max over the same layer's experts of the same projection (gate/up:
// w1, w3, gate_proj, up_proj; down: w2, down_proj) and is reported in `filled`. Any other
// module without an amax row, a routed expert whose layer has no row for its projection, and an
// amax that is not finite and positive are errors that name the module.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_INPUT_SCALES_H_
#define QUANTD_SERVER_PIPELINE_STAGES_INPUT_SCALES_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"

namespace quantd::pipeline {

struct InputScales {
  std::map<std::string, float> scale;  // module -> input_scale
  std::vector<std::string> filled;     // routed experts whose amax came from their layer
};

// `amax` (module -> max |input|) may be nullptr: no table, every module is then missing.
absl::StatusOr<InputScales> ResolveInputScales(const ShardTask& task,
                                               const std::map<std::string, float>* amax);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_INPUT_SCALES_H_
