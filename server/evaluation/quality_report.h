// The figures of one evaluation: per-layer hidden-state SQNR (free-running and teacher-forced),
// the next-token figures, and what was evaluated; as JSON and as the text `quantd evaluate`
// prints. SQNR is written in dB, null in JSON (and "inf" in text) where the two models' values
// are identical.
#ifndef QUANTD_SERVER_EVALUATION_QUALITY_REPORT_H_
#define QUANTD_SERVER_EVALUATION_QUALITY_REPORT_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "server/evaluation/evaluate_layer.h"
#include "server/evaluation/next_token_metrics.h"

namespace quantd::evaluation {

struct QualityReport {
  std::string source;     // checkpoint directories
  std::string quantized;
  std::string numerics;   // "official" | "math"
  int64_t samples = 0;    // held-out samples
  int64_t tokens = 0;
  std::vector<LayerQuality> layers;
  NextTokenQuality next_token;
  double seconds = 0.0;   // wall time of the whole evaluation
};

// The layer whose teacher-forced SQNR is lowest (where the quantized model loses the most on
// its own); -1 when no layer differs (every SQNR infinite) or there are none.
int64_t WorstLayer(const QualityReport& report);
// The at most `n` layers with the lowest finite teacher-forced SQNR, lowest first (ties: lower
// layer first).
std::vector<int64_t> WorstLayers(const QualityReport& report, size_t n);

nlohmann::json QualityReportToJson(const QualityReport& report);
std::string FormatQualityReport(const QualityReport& report);

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_QUALITY_REPORT_H_
