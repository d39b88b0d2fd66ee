#include "server/evaluation/evaluation_batches.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/calibration/calibrate_layer.h"

namespace quantd::evaluation {
namespace {

absl::StatusOr<std::vector<model::V4Activations>> Embed(
    const model::V4Checkpoint& ckpt, const std::vector<std::vector<int32_t>>& samples,
    int64_t batch_bytes) {
  ASSIGN_OR_RETURN(std::vector<calibration::BatchActivations> batches,
                   calibration::EmbedSlice(ckpt, samples, batch_bytes));
  std::vector<model::V4Activations> out;
  out.reserve(batches.size());
  for (calibration::BatchActivations& b : batches) out.push_back(std::move(b.host));
  return out;
}

}  // namespace

int64_t EvaluationBatches::tokens() const {
  int64_t n = 0;
  for (const model::V4Activations& a : source) n += a.tokens();
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
  EvaluationBatches batches;
  ASSIGN_OR_RETURN(batches.source, Embed(source, samples, batch_bytes));
  ASSIGN_OR_RETURN(batches.quantized, Embed(quantized, samples, batch_bytes));
  return batches;
}

}  // namespace quantd::evaluation
