#include "server/evaluation/run_evaluation.h"

#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "server/base/status_macros.h"
#include "server/evaluation/evaluate_head.h"
#include "server/evaluation/evaluate_layer.h"
#include "server/evaluation/evaluation_batches.h"
#include "server/evaluation/held_out_samples.h"
#include "server/evaluation/quality_gate.h"
#include "server/model/v4_weights.h"

namespace quantd::evaluation {

model::Numerics ForwardNumerics(const job::CalibrationSpec& calibration) {
  return calibration.numerics == job::CalibrationNumerics::kMath ? model::Numerics::kMath
                                                                 : model::Numerics::kOfficial;
}

absl::StatusOr<QualityReport> RunEvaluation(const EvaluationRequest& request,
                                            compute::Device& device) {
  const job::JobSpec& spec = *request.spec;
  const auto progress = [&request](const std::string& line) {
    if (request.progress) request.progress(line);
  };
  ASSIGN_OR_RETURN(std::unique_ptr<model::V4Checkpoint> source,
                   model::OpenV4Checkpoint(request.source));
  ASSIGN_OR_RETURN(std::unique_ptr<model::V4Checkpoint> quantized,
                   model::OpenV4Checkpoint(request.quantized));
  calibration::CalibrationTokenizer tokenizer(request.tokenizer_dir);
  ASSIGN_OR_RETURN(const std::vector<std::vector<int32_t>> samples,
                   LoadHeldOutSamples(spec.calibration, spec.source_roots,
                                      spec.evaluate.num_samples, tokenizer,
                                      source->config.vocab_size));

  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(EvaluationBatches batches,
                   EmbedHeldOut(*source, *quantized, samples, request.batch_bytes));
  const model::Numerics numerics = ForwardNumerics(spec.calibration);
  QualityReport report;
  report.source = request.source;
  report.quantized = request.quantized;
  report.numerics = job::CalibrationNumericsName(spec.calibration.numerics);
  report.samples = static_cast<int64_t>(samples.size());
  report.tokens = batches.tokens();
  const int64_t layers = source->config.num_hidden_layers;
  progress(absl::StrFormat("evaluating %d layers on %d held-out samples (%d tokens, %d batches), "
                           "%s numerics",
                           layers, report.samples, report.tokens, batches.source->size(),
                           report.numerics));
  EvaluationHooks hooks;
  hooks.cancelled = request.cancelled;
  for (int64_t layer = 0; layer < layers; ++layer) {
    ASSIGN_OR_RETURN(LayerEvaluation step, EvaluateLayer(*source, *quantized, layer, batches,
                                                         device, numerics, hooks));
    const LayerQuality& q = step.quality;
    progress(absl::StrFormat("layer %d of %d: SQNR %.2f dB free-running, %.2f dB teacher-forced "
                             "(load %.3f s, decode %.3f s, forward %.3f s)",
                             layer + 1, layers, q.free_running.Db(), q.teacher_forced.Db(),
                             q.load_seconds, q.decode_seconds, q.forward_seconds));
    report.layers.push_back(q);
    batches.source = std::make_shared<const Batches>(std::move(step.source));
    batches.quantized = std::make_shared<const Batches>(std::move(step.quantized));
  }
  ASSIGN_OR_RETURN(report.next_token,
                   EvaluateHead(*source, *quantized, batches, device, numerics, hooks));
  report.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

nlohmann::json EvaluationJson(const QualityReport& report, const job::QualityGate& gate) {
  nlohmann::json json = QualityReportToJson(report);
  const std::vector<std::string> broken = BrokenBounds(gate, report);
  json["gate"] = {{"passed", broken.empty()}, {"broken", broken}};
  return json;
}

}  // namespace quantd::evaluation
