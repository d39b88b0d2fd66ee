// The per-layer calibration figures of a JobReport (quantd.proto LayerReport), summarised from the
// job's amax table (store::JobStore::ListAmax): rows of kind "input" named by official module
// name, e.g. "layers.3.attn.wq_a", "layers.3.ffn.shared_experts.w1", "layers.3.ffn.experts.5.w1";
// a routed w2's weighted input under "layers.L.ffn.experts.E.w2", its unweighted input under
// "layers.L.ffn.experts.E.w2.unweighted"; `samples` counts the tokens that reached the module (0
// for rows read from calibration.amax_file). Rows outside "layers.N." (head, mtp.*) and of other
// kinds ("kv") are not summarised.
#ifndef QUANTD_SERVER_SCHEDULER_CALIBRATION_REPORT_H_
#define QUANTD_SERVER_SCHEDULER_CALIBRATION_REPORT_H_

#include <stdint.h>

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "quantd/v1/quantd.pb.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {

// A module's decoder layer and the rest of its name: "layers.3.attn.wq_a" -> (3, "attn.wq_a");
// nullopt for a module outside "layers.N." (head, mtp.*).
std::optional<std::pair<int64_t, absl::string_view>> LayerOfModule(absl::string_view module);

// Appends one LayerReport per decoder layer that has input amax rows, in layer order. Per layer:
// each projection's min / median / max over the routed experts (one value for any other module);
// calibrated_tokens, the most tokens any non-routed module of the layer saw; routed_experts, the
// experts with a row or quantized by one of the job's quantize `tasks` (their payload lists the
// modules); uncalibrated_experts, those whose amax the export fills in: quantized without a row
// (the calibration records only experts some token reached), or with rows that count no token
// when the layer's rows count tokens at all (token_counts).
void AddLayerCalibration(const std::vector<store::AmaxRow>& amax,
                         const std::vector<store::TaskRow>& tasks, v1::JobReport* report);

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_CALIBRATION_REPORT_H_
