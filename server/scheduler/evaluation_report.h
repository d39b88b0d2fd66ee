// The evaluation figures of a JobReport (quantd.proto EvaluationReport and LayerReport fields
// 10-12), from what the evaluate stage recorded (store::JobStore::ListEvaluationLayers,
// GetEvaluation): per decoder layer the free-running and teacher-forced SQNR in dB (+inf where
// the two models' outputs are identical), and once the head task recorded them the job's
// next-token figures, the gate's verdict, the (at most 3) layers with the lowest teacher-forced
// SQNR, and the wall time of the evaluate and calibrate stages.
#ifndef QUANTD_SERVER_SCHEDULER_EVALUATION_REPORT_H_
#define QUANTD_SERVER_SCHEDULER_EVALUATION_REPORT_H_

#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "quantd/v1/quantd.pb.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {

// Layers with the lowest teacher-forced SQNR the report lists.
inline constexpr size_t kWorstEvaluatedLayers = 3;

// Sets the evaluation fields of `report` from the recorded `layers` (evaluated = true on the
// LayerReport of each, added in layer order where calibration gave none) and `figures` (the
// evaluation field, left unset when nullopt). `calibration_seconds`: the calibrate stage's wall
// time, 0 when the job has none.
void AddEvaluation(const std::vector<store::EvaluationLayerRow>& layers,
                   const std::optional<store::EvaluationRow>& figures, double calibration_seconds,
                   v1::JobReport* report);

// AddEvaluation with what `store` recorded for job `job_id` (the calibrate stage's wall time from
// its started and finished times).
absl::Status AddStoredEvaluation(store::JobStore& store, int64_t job_id, v1::JobReport* report);

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_EVALUATION_REPORT_H_
