// From the recorded amax table to the input amax the quantize stage consumes (module -> amax,
// the map PreparedJob keeps from calibration.amax_file), under the spec's calibration options
// (job/job_spec.h): which w2 input (w2_input), per-expert or per-layer values (expert_amax),
// how experts that no token reached are filled (uncalibrated). Routed experts' w1 and w3 always
// get the same value (the max of the two; TensorRT-LLM asserts they are equal), and every value
// is finite and positive.
#ifndef QUANTD_SERVER_CALIBRATION_EXPORT_AMAX_H_
#define QUANTD_SERVER_CALIBRATION_EXPORT_AMAX_H_

#include <stdint.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/calibration/amax_table.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/job/job_spec.h"
#include "server/model/v4_config.h"

namespace quantd::calibration {

struct ExportReport {
  // Routed expert projections (w1, w2, w3 rows) of the main layers that no calibration token
  // reached (or whose inputs were all zero), filled under `uncalibrated`.
  std::vector<std::string> filled;
  // Main layers none of whose experts was reached for some projection: filled from the model max
  // whatever `uncalibrated` says.
  std::vector<int64_t> layers_without_experts;
};

// The input amax of every module in `table`, and of w1/w2/w3 of every routed expert of the main
// layers of `config`. FailedPrecondition when a non-expert module's amax is 0, or when no routed
// expert of the model was reached at all (nothing to fill from).
absl::StatusOr<std::map<std::string, float>> ExportInputAmax(const AmaxTable& table,
                                                             const model::V4Config& config,
                                                             const job::CalibrationSpec& spec,
                                                             ExportReport* report);

// calibration.mode "constant": amax 2688 (input_scale 1.0) for every linear module of `inventory`.
std::map<std::string, float> ConstantInputAmax(const checkpoint::TensorInventory& inventory);

// The amax_file JSON ({module: amax}, sorted): `exported`, plus "<module>.unweighted" and
// "<module>.weighted" for every routed w2 of `table`.
std::string AmaxFileText(const std::map<std::string, float>& exported, const AmaxTable& table);
// AmaxFileText written atomically to `path`.
absl::Status WriteAmaxFile(const std::string& path, const std::map<std::string, float>& exported,
                           const AmaxTable& table);

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_EXPORT_AMAX_H_
