#include "server/evaluation/held_out_samples.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "server/calibration/calibration_data.h"

namespace quantd::evaluation {
namespace {

// How a file's lines divide: "F has L lines; calibration takes C of them (S shorter than
// min_seq_len = M skipped), K are left".
std::string FileLines(const calibration::CalibrationFileStats& stats, int64_t calibration,
                      int64_t left, int64_t min_seq_len) {
  return absl::StrCat(stats.path, " has ", stats.lines, " lines; calibration takes ", calibration,
                      " of them and ", stats.skipped, " are shorter than min_seq_len = ",
                      min_seq_len, ", which leaves ", left, " usable held-out samples");
}

constexpr char kDisable[] =
    ": lower evaluate.num_samples, add lines, calibrate on fewer samples, or set evaluate.enabled "
    "to false";

}  // namespace

absl::StatusOr<std::vector<std::vector<int32_t>>> LoadHeldOutSamples(
    const job::CalibrationSpec& calibration, const checkpoint::SourceRoots& roots,
    int64_t num_samples, calibration::CalibrationTokenizer& tokenizer, int64_t vocab) {
  if (num_samples < 0) {
    return absl::InvalidArgumentError("evaluate.num_samples must not be negative");
  }
  absl::StatusOr<std::vector<job::CalibrationDataset>> calibrated =
      calibration::ResolveCalibrationDatasets(calibration);
  if (!calibrated.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation draws its held-out samples from the calibration data: ",
                     calibrated.status().message()));
  }
  const bool exact = num_samples > 0;
  const int64_t wanted = HeldOutSamplesAsked(num_samples);
  // The same selection, each file asked for its calibration samples plus its held-out share.
  const int64_t files = static_cast<int64_t>(calibrated->size());
  job::CalibrationSpec extended = calibration;
  extended.dataset.clear();
  extended.datasets.clear();
  std::vector<int64_t> shares;
  for (int64_t f = 0; f < files; ++f) {
    shares.push_back(wanted / files + (f < wanted % files ? 1 : 0));
    extended.datasets.push_back({(*calibrated)[f].path, (*calibrated)[f].samples + shares[f]});
  }
  absl::StatusOr<calibration::CalibrationSet> set =
      calibration::LoadCalibrationSet(extended, roots, tokenizer, vocab, /*allow_fewer=*/true);
  if (!set.ok()) {
    return absl::Status(set.status().code(),
                        absl::StrCat("held-out samples: ", set.status().message()));
  }
  // set->samples holds each file's samples in order: skip its calibration samples.
  std::vector<std::vector<int32_t>> held_out;
  std::vector<std::string> lines;  // each file's lines, for the message when none is left
  size_t next = 0;
  for (int64_t f = 0; f < files; ++f) {
    const calibration::CalibrationFileStats& stats = set->files[f];
    const int64_t calibration_samples = (*calibrated)[f].samples;
    const int64_t left = std::max<int64_t>(0, stats.taken - calibration_samples);
    if (exact && left < shares[f]) {
      return absl::InvalidArgumentError(
          absl::StrCat("evaluate.num_samples ", num_samples, " asks ", shares[f], " of ",
                       FileLines(stats, calibration_samples, left, calibration.min_seq_len),
                       kDisable));
    }
    lines.push_back(FileLines(stats, calibration_samples, left, calibration.min_seq_len));
    for (int64_t k = 0; k < stats.taken; ++k, ++next) {
      if (k >= calibration_samples) held_out.push_back(std::move(set->samples[next].ids));
    }
  }
  if (held_out.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluate: the calibration data holds no held-out sample (",
                     absl::StrJoin(lines, "; "), ")", kDisable));
  }
  return held_out;
}

}  // namespace quantd::evaluation
