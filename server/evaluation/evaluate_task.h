// The tasks of the evaluate stage, as planned and stored (payload JSON):
//   "layer<L>"  decoder layer L of both models over the held-out batches (its SQNR);
//   "head"      both heads over the last layer's outputs: the next-token figures and the gate's
//               verdict, recorded also when the gate is broken;
//   "gate"      fails the job with reason QUALITY_GATE when the head found the gate broken.
// Every payload carries the bound of the held-out samples and their tokens (the plan reads no
// data: the calibrate stage's tokens task tokenizes them), which sizes the tasks' memory.
#ifndef QUANTD_SERVER_EVALUATION_EVALUATE_TASK_H_
#define QUANTD_SERVER_EVALUATION_EVALUATE_TASK_H_

#include <stdint.h>

#include <string>

#include "absl/status/statusor.h"

namespace quantd::evaluation {

struct EvaluateTask {
  enum class Kind { kLayer, kHead, kGate };
  Kind kind = Kind::kLayer;
  int64_t layer = 0;    // kLayer: the decoder layer
  int64_t layers = 0;   // the model's decoder layers
  int64_t max_samples = 0;  // held-out samples, at most
  int64_t max_tokens = 0;   // their tokens, at most (max_samples x calibration.seq_len)

  // The task's name in its stage ("layer3", "head", "gate").
  std::string Name() const;
};

std::string ToJson(const EvaluateTask& task);
// InvalidArgument naming the field when `json` is not an evaluate task payload.
absl::StatusOr<EvaluateTask> ParseEvaluateTask(const std::string& json);

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_EVALUATE_TASK_H_
