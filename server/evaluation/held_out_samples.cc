#include "server/evaluation/held_out_samples.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/pipeline/calibration_data.h"

namespace quantd::evaluation {

absl::StatusOr<std::vector<std::vector<int32_t>>> LoadHeldOutSamples(
    const pipeline::CalibrationSpec& calibration, int64_t num_samples,
    const model::Tokenizer& tokenizer) {
  if (num_samples <= 0) {
    return absl::InvalidArgumentError("evaluation needs at least one held-out sample");
  }
  absl::StatusOr<std::vector<pipeline::CalibrationDataset>> calibrated =
      pipeline::ResolveCalibrationDatasets(calibration);
  if (!calibrated.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation draws its held-out samples from the calibration data: ",
                     calibrated.status().message()));
  }
  // The same selection, each file asked for its calibration samples plus its held-out share.
  const int64_t files = static_cast<int64_t>(calibrated->size());
  pipeline::CalibrationSpec extended = calibration;
  extended.dataset.clear();
  extended.datasets.clear();
  for (int64_t f = 0; f < files; ++f) {
    const int64_t share = num_samples / files + (f < num_samples % files ? 1 : 0);
    extended.datasets.push_back({(*calibrated)[f].path, (*calibrated)[f].samples + share});
  }
  absl::StatusOr<pipeline::CalibrationSet> set =
      pipeline::LoadCalibrationSet(extended, tokenizer);
  if (!set.ok()) {
    return absl::Status(set.status().code(),
                        absl::StrCat("held-out samples (after the calibration samples of each "
                                     "file): ",
                                     set.status().message()));
  }
  // set->samples holds each file's samples in order: skip its calibration samples.
  std::vector<std::vector<int32_t>> held_out;
  size_t next = 0;
  for (int64_t f = 0; f < files; ++f) {
    const int64_t taken = extended.datasets[f].samples;
    for (int64_t k = 0; k < taken; ++k, ++next) {
      if (k >= (*calibrated)[f].samples) held_out.push_back(std::move(set->samples[next].ids));
    }
  }
  return held_out;
}

}  // namespace quantd::evaluation
