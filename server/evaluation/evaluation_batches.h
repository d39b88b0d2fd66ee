// The held-out batches between decoder layers, once for each model: the source model's own
// activations and the quantized model's own (free-running). Both are grouped the same way
// (calibration/calibrate_layer.h EmbedSlice: samples of one length, up to a working-memory
// budget per batch), so batch i of one is batch i of the other. Kept in host memory.
#ifndef QUANTD_SERVER_EVALUATION_EVALUATION_BATCHES_H_
#define QUANTD_SERVER_EVALUATION_EVALUATION_BATCHES_H_

#include <stdint.h>

#include <vector>

#include "absl/status/statusor.h"
#include "server/model/v4_activations.h"
#include "server/model/v4_weights.h"

namespace quantd::evaluation {

struct EvaluationBatches {
  std::vector<model::V4Activations> source;     // the source model's activations
  std::vector<model::V4Activations> quantized;  // the quantized model's, batch for batch

  int64_t tokens() const;
};

// Both models' embeddings of `samples`, in batches of at most `batch_bytes` of working memory.
// InvalidArgument when the two checkpoints' configs differ in a dimension the forward uses or a
// sample is empty.
absl::StatusOr<EvaluationBatches> EmbedHeldOut(const model::V4Checkpoint& source,
                                               const model::V4Checkpoint& quantized,
                                               const std::vector<std::vector<int32_t>>& samples,
                                               int64_t batch_bytes);

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_EVALUATION_BATCHES_H_
