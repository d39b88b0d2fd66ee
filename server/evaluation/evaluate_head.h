// The last evaluation step: both models' heads (hc_head, final norm, output projection) over
// their own last-layer activations, one sequence at a time (only one sequence's logits of each
// model are held), into the next-token figures of next_token_metrics.h. Cancelled once
// hooks.cancelled is set (checked between sequences).
#ifndef QUANTD_SERVER_EVALUATION_EVALUATE_HEAD_H_
#define QUANTD_SERVER_EVALUATION_EVALUATE_HEAD_H_

#include "absl/status/statusor.h"
#include "server/compute/device.h"
#include "server/evaluation/evaluation_batches.h"
#include "server/evaluation/next_token_metrics.h"
#include "server/model/v4_numerics.h"
#include "server/model/v4_weights.h"

namespace quantd::evaluation {

absl::StatusOr<NextTokenQuality> EvaluateHead(const model::V4Checkpoint& source,
                                              const model::V4Checkpoint& quantized,
                                              const EvaluationBatches& batches,
                                              compute::Device& device, model::Numerics numerics,
                                              const EvaluationHooks& hooks = {});

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_EVALUATE_HEAD_H_
