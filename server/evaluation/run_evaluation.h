// One evaluation of a quantized checkpoint against its source on the held-out samples of a job
// spec (held_out_samples.h): every decoder layer, then the head, on one device, in one call
// (`quantd evaluate`). The evaluate stage runs the same steps (EvaluateLayer, EvaluateHead) as one
// task each (pipeline/stages/evaluate_stage.h).
#ifndef QUANTD_SERVER_EVALUATION_RUN_EVALUATION_H_
#define QUANTD_SERVER_EVALUATION_RUN_EVALUATION_H_

#include <stdint.h>

#include <atomic>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "server/compute/device.h"
#include "server/evaluation/quality_report.h"
#include "server/job/job_spec.h"
#include "server/model/v4_numerics.h"

namespace quantd::evaluation {

struct EvaluationRequest {
  const job::JobSpec* spec = nullptr;  // calibration data, evaluate.num_samples, numerics
  std::string source;         // checkpoint directories
  std::string quantized;
  std::string tokenizer_dir;  // holds tokenizer.json
  int64_t batch_bytes = int64_t{1} << 30;  // working memory per RunLayer call
  // Called with one progress line before the first layer and after each layer; may be empty.
  std::function<void(std::string_view)> progress;
  // Checked between batches: Cancelled once set. May be null.
  const std::atomic<bool>* cancelled = nullptr;
};

// The forward's numerics for a spec's calibration.numerics.
model::Numerics ForwardNumerics(const job::CalibrationSpec& calibration);

// The figures of `request` (QualityReport::seconds counts the forward passes, not the loading).
// Errors name the checkpoint, data file or layer.
absl::StatusOr<QualityReport> RunEvaluation(const EvaluationRequest& request,
                                            compute::Device& device);

// QualityReportToJson with the gate's verdict: "gate": {"passed", "broken": [lines]}.
nlohmann::json EvaluationJson(const QualityReport& report, const job::QualityGate& gate);

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_RUN_EVALUATION_H_
