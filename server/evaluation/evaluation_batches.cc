#include "server/evaluation/evaluation_batches.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/calibration/calibrate_layer.h"

namespace quantd::evaluation {

int64_t EvaluationBatches::tokens() const {
  int64_t n = 0;
  if (source != nullptr) {
    for (const calibration::BatchActivations& b : *source) n += b.tokens;
  }
  return n;
}

int64_t EvaluationBatches::samples() const {
  int64_t n = 0;
  if (source != nullptr) {
    for (const calibration::BatchActivations& b : *source) n += b.host.sequences;
  }
  return n;
}

absl::StatusOr<EvaluationBatches> EmbedHeldOut(const model::V4Checkpoint& source,
                                               const model::V4Checkpoint& quantized,
                                               const std::vector<std::vector<int32_t>>& samples,
                                               int64_t batch_bytes) {
  const model::V4Config& a = source.config;
  const model::V4Config& b = quantized.config;
  if (a.num_hidden_layers != b.num_hidden_layers || a.hidden_size != b.hidden_size ||
      a.hc_mult != b.hc_mult || a.vocab_size != b.vocab_size ||
      a.n_routed_experts != b.n_routed_experts || a.compress_ratios != b.compress_ratios) {
    return absl::InvalidArgumentError(absl::StrCat(
        quantized.dir->dir(), "/config.json does not describe the model of ", source.dir->dir(),
        " (layers, hidden size, hc streams, vocabulary, experts or compress ratios differ)"));
  }
  ASSIGN_OR_RETURN(Batches embedded_source,
                   calibration::EmbedSlice(source, samples, batch_bytes));
  ASSIGN_OR_RETURN(Batches embedded_quantized,
                   calibration::EmbedSlice(quantized, samples, batch_bytes));
  EvaluationBatches batches;
  batches.source = std::make_shared<const Batches>(std::move(embedded_source));
  batches.quantized = std::make_shared<const Batches>(std::move(embedded_quantized));
  return batches;
}

absl::Status CheckPaired(const EvaluationBatches& batches, const char* what) {
  if (batches.source == nullptr || batches.quantized == nullptr ||
      batches.source->size() != batches.quantized->size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the two models' batches do not pair up"));
  }
  for (size_t i = 0; i < batches.source->size(); ++i) {
    const calibration::BatchActivations& a = (*batches.source)[i];
    const calibration::BatchActivations& b = (*batches.quantized)[i];
    if (!a.spill_path.empty() || !b.spill_path.empty() || a.host.sequences != b.host.sequences ||
        a.host.seq_len != b.host.seq_len || a.host.streams.size() != b.host.streams.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": batch ", i, " of the two models is not in host memory in the same shape"));
    }
  }
  return absl::OkStatus();
}

}  // namespace quantd::evaluation
