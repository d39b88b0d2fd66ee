// The spec's evaluate.gate applied to an evaluation's figures.
#ifndef QUANTD_SERVER_EVALUATION_QUALITY_GATE_H_
#define QUANTD_SERVER_EVALUATION_QUALITY_GATE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/evaluation/quality_report.h"
#include "server/job/job_spec.h"

namespace quantd::evaluation {

// One line per broken bound, naming the figure, its value and the bound: "mean_kl 0.41 >
// max_mean_kl 0.05". Empty when the gate passes (or sets no bound).
std::vector<std::string> BrokenBounds(const job::QualityGate& gate, const QualityReport& report);

// FailedPrecondition "quality gate: <the broken bounds>; lowest teacher-forced SQNR at layer L
// (X dB)" when a bound is broken, OK otherwise.
absl::Status CheckQualityGate(const job::QualityGate& gate, const QualityReport& report);

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_QUALITY_GATE_H_
