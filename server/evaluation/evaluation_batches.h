// The held-out batches between decoder layers, once for each model: the source model's own
// activations and the quantized model's own (free-running). Both are grouped the same way
// (calibration/calibrate_layer.h PlanBatches: samples of one length, up to a working-memory
// budget per batch), so batch i of one is batch i of the other. Kept in host memory, in the
// batch type of calibration::ActivationStore, which holds them between the evaluate stage's tasks.
#ifndef QUANTD_SERVER_EVALUATION_EVALUATION_BATCHES_H_
#define QUANTD_SERVER_EVALUATION_EVALUATION_BATCHES_H_

#include <stdint.h>

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/calibration/activation_store.h"
#include "server/model/v4_weights.h"

namespace quantd::evaluation {

// One model's batches, each in host memory (BatchActivations::host; never spilled).
using Batches = calibration::ActivationStore::Batches;

struct EvaluationBatches {
  std::shared_ptr<const Batches> source;     // the source model's activations
  std::shared_ptr<const Batches> quantized;  // the quantized model's, batch for batch

  int64_t tokens() const;
  // The held-out samples (sequences) of the source model's batches.
  int64_t samples() const;
};

// What an evaluation step reports while it runs, and when it stops.
struct EvaluationHooks {
  // Called after each batch (or sequence) with the token rows it moved; may be empty.
  std::function<void(int64_t tokens)> on_batch;
  // Called while a layer loads (per expert) and inside each batch (per product): the task's sign
  // of life between batches that may take minutes at the real width. May be empty.
  std::function<void()> alive;
  // Checked between batches: Cancelled once set. May be null.
  const std::atomic<bool>* cancelled = nullptr;
};

// Both models' embeddings of `samples`, in batches of at most `batch_bytes` of working memory.
// InvalidArgument when the two checkpoints' configs differ in a dimension the forward uses or a
// sample is empty.
absl::StatusOr<EvaluationBatches> EmbedHeldOut(const model::V4Checkpoint& source,
                                               const model::V4Checkpoint& quantized,
                                               const std::vector<std::vector<int32_t>>& samples,
                                               int64_t batch_bytes);

// The batches' activations in host memory; FailedPrecondition naming `what` when they do not
// match batch for batch (count, shape) or one is spilled.
absl::Status CheckPaired(const EvaluationBatches& batches, const char* what);

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_EVALUATION_BATCHES_H_
