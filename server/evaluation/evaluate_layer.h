// One evaluation step: decoder layer `layer` of the source and of the quantized model over the
// held-out batches. Loads the layer of each model (only those two resident), then for every
// batch runs
//   source layer    on the source activations     -> the reference output,
//   quantized layer on the quantized activations  -> free-running output (errors accumulate),
//   quantized layer on the source activations     -> teacher-forced output (this layer's error),
// records the SQNR of both against the reference over every hidden-state value (all hc
// streams), and hands back the two models' own outputs (the next layer's input). The input is
// left as it is, so a failed step can run again on it.
#ifndef QUANTD_SERVER_EVALUATION_EVALUATE_LAYER_H_
#define QUANTD_SERVER_EVALUATION_EVALUATE_LAYER_H_

#include <stdint.h>

#include "absl/status/statusor.h"
#include "server/compute/device.h"
#include "server/evaluation/evaluation_batches.h"
#include "server/evaluation/sqnr.h"
#include "server/model/v4_numerics.h"
#include "server/model/v4_weights.h"

namespace quantd::evaluation {

struct LayerQuality {
  int64_t layer = 0;
  Sqnr free_running;    // quantized model on its own activations vs the source model
  Sqnr teacher_forced;  // quantized layer on the source's activations vs the source layer
  double load_seconds = 0.0;     // both layers' weights read and decoded
  double decode_seconds = 0.0;   // routed experts decoded inside the layer runs
  double forward_seconds = 0.0;  // the three layer runs over every batch, less decoding
};

struct LayerEvaluation {
  LayerQuality quality;
  Batches source;     // the source layer's output, batch for batch, in host memory
  Batches quantized;  // the quantized layer's free-running output
};

// Errors name the layer and the checkpoint; Cancelled once hooks.cancelled is set.
absl::StatusOr<LayerEvaluation> EvaluateLayer(const model::V4Checkpoint& source,
                                              const model::V4Checkpoint& quantized, int64_t layer,
                                              const EvaluationBatches& input,
                                              compute::Device& device, model::Numerics numerics,
                                              const EvaluationHooks& hooks = {});

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_EVALUATE_LAYER_H_
