// The tasks of the calibrate stage, as planned and stored (payload JSON):
//   "tokens"         tokenizes the calibration set (and the held-out samples of a job that
//                    evaluates) once and stores it in the job's work directory;
//   "layer<L>.slice<S>"  decoder layer L over slice S of the batches (SliceBatches of the batches
//                    PlanBatches forms from the tokens file);
//   "amax_out"       writes calibration.amax_out once every layer is calibrated.
#ifndef QUANTD_SERVER_CALIBRATION_CALIBRATE_TASK_H_
#define QUANTD_SERVER_CALIBRATION_CALIBRATE_TASK_H_

#include <stdint.h>

#include <string>

#include "absl/status/statusor.h"

namespace quantd::calibration {

struct CalibrateTask {
  enum class Kind { kTokens, kLayer, kAmaxOut };
  Kind kind = Kind::kLayer;
  int64_t layer = 0;        // kLayer: the decoder layer
  int64_t layers = 0;       // the model's decoder layers
  int64_t slice = 0;        // kLayer: the slice
  int64_t slices = 1;       // slices per layer

  // The task's name in its stage ("tokens", "layer3.slice0", "amax_out").
  std::string Name() const;
};

std::string CalibrateTaskName(int64_t layer, int64_t slice);
std::string ToJson(const CalibrateTask& task);
// InvalidArgument naming the field when `json` is not a calibrate task payload.
absl::StatusOr<CalibrateTask> ParseCalibrateTask(const std::string& json);

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_CALIBRATE_TASK_H_
