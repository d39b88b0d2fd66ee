// A model::Observer that records calibration amax into an AmaxTable while one decoder layer runs:
// per linear (per routed expert and projection) max |x| of the input the forward shows (BF16
// values in official numerics, before the FP8 activation simulation) and the rows that reached
// it; for routed w2 the weighted and the unweighted input (only the unweighted one for the rows
// calibrate_all_experts adds, which carry no routing weight). It checks what the clamped SwiGLU
// implies: an unweighted w2 input never exceeds limit·silu(limit) (10·silu(10) ≈ 99.9955 in
// DeepSeek-V4), up to the model dtype's rounding. A violation, or a non-finite input, is kept as
// the observer's status, naming the layer, module and expert; the caller checks it after the
// layer ran.
#ifndef QUANTD_SERVER_CALIBRATION_AMAX_OBSERVER_H_
#define QUANTD_SERVER_CALIBRATION_AMAX_OBSERVER_H_

#include <stdint.h>

#include "absl/status/status.h"
#include "server/calibration/amax_table.h"
#include "server/model/v4_observer.h"

namespace quantd::calibration {

// The largest unweighted w2 input the clamped SwiGLU allows: limit·silu(limit) rounded up by one
// BF16 ulp (the official forward rounds it to BF16). 0 when `swiglu_limit` is 0 (no clamp).
float UnweightedW2Bound(float swiglu_limit);

class AmaxObserver final : public model::Observer {
 public:
  // Records into `table` (not owned; must outlive the observer) for decoder layer `layer`.
  AmaxObserver(AmaxTable* table, int64_t layer, float swiglu_limit);

  void OnLinearInput(const model::LinearInput& input) override;
  // KV cache amax is not recorded (kv_cache "fp8" is not supported yet).
  void OnKvCache(const model::KvCacheInput& /*input*/) override {}

  // OK, or the first bound violation / non-finite input seen.
  const absl::Status& status() const { return status_; }
  // Wall time spent recording so far.
  double record_seconds() const { return record_seconds_; }

 private:
  AmaxTable* table_;        // where amax goes
  int64_t layer_;           // named in errors
  float w2_bound_;          // UnweightedW2Bound(swiglu_limit); 0: unchecked
  absl::Status status_;     // first error seen
  double record_seconds_ = 0.0;  // accumulated time in OnLinearInput
};

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_AMAX_OBSERVER_H_
