#include "server/pipeline/stages/layer_task_memory.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/calibration/calibrate_layer.h"
#include "server/model/v4_memory.h"

namespace quantd::pipeline {
namespace {

model::LayerMemory Layer(const checkpoint::TensorInventory& source, int64_t layer,
                         model::DecodedWidth width) {
  return model::EstimateLayerMemory(source, absl::StrCat("layers.", layer, "."), width);
}

}  // namespace

int64_t StreamBytes(const model::V4Config& config, int64_t tokens) {
  return tokens * (config.hc_mult * config.hidden_size * 4 + 4);
}

int64_t LargestBatchBytes(const model::V4Config& config, int64_t samples, int64_t seq_len) {
  return std::min(calibration::EstimateBatchBytes(config, samples, seq_len),
                  std::max(calibration::kDefaultBatchBytes,
                           calibration::EstimateBatchBytes(config, 1, seq_len)));
}

int64_t CalibrateLayerTaskBytes(const model::V4Config& config,
                                const checkpoint::TensorInventory& source, int64_t layer,
                                int64_t slice_tokens, int64_t batch_bytes) {
  return Layer(source, layer, model::DecodedWidth::kAsStored).resident_bytes() + batch_bytes +
         2 * StreamBytes(config, slice_tokens);
}

int64_t EvaluateLayerTaskBytes(const model::V4Config& config,
                               const checkpoint::TensorInventory& source, int64_t layer,
                               int64_t tokens, int64_t batch_bytes) {
  return Layer(source, layer, model::DecodedWidth::kAsStored).resident_bytes() +
         Layer(source, layer, model::DecodedWidth::kFloat32).resident_bytes() + batch_bytes +
         4 * StreamBytes(config, tokens);
}

int64_t EvaluateHeadTaskBytes(const model::V4Config& config, int64_t tokens, int64_t seq_len) {
  const int64_t head = config.vocab_size * config.hidden_size;
  return 2 * 4 * head + 2 * 4 * seq_len * config.vocab_size + 2 * StreamBytes(config, tokens);
}

}  // namespace quantd::pipeline
