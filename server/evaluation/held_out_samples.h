// Held-out samples for evaluation: drawn from the job's calibration data sets, disjoint from the
// calibration samples. Each file's lines are visited in the seeded order calibration uses
// (calibration/calibration_data.h); calibration takes the first usable `samples` of a file, the
// evaluation takes the next ones (its count shared evenly over the files, the earlier files taking
// the remainder), with the same seq_len / min_seq_len / add_bos rules. The same spec and files give
// the same held-out tokens on every machine.
#ifndef QUANTD_SERVER_EVALUATION_HELD_OUT_SAMPLES_H_
#define QUANTD_SERVER_EVALUATION_HELD_OUT_SAMPLES_H_

#include <stdint.h>

#include <vector>

#include "absl/status/statusor.h"
#include "server/job/job_spec.h"
#include "server/calibration/calibration_data.h"

namespace quantd::evaluation {

// How many held-out samples evaluate.num_samples = `num_samples` asks for: itself, or
// kDefaultEvaluateSamples for 0 (the most LoadHeldOutSamples gives).
inline int64_t HeldOutSamplesAsked(int64_t num_samples) {
  return num_samples > 0 ? num_samples : job::kDefaultEvaluateSamples;
}

// The token ids of the held-out samples of evaluate.num_samples = `num_samples`:
//   > 0: exactly that many; InvalidArgument when a file has fewer usable lines left after its
//        calibration samples than its share, naming the file, its lines, how many calibration
//        takes and how many are left, and suggesting evaluate.enabled false;
//   0:   kDefaultEvaluateSamples, each file giving at most what it has left (so fewer when the
//        data holds fewer); InvalidArgument as above when no file has any left.
// InvalidArgument too when the spec names no data set. `roots`, `tokenizer` and `vocab` as
// calibration::LoadCalibrationSet's (the tokenizer is loaded only for text samples).
absl::StatusOr<std::vector<std::vector<int32_t>>> LoadHeldOutSamples(
    const job::CalibrationSpec& calibration, const checkpoint::SourceRoots& roots,
    int64_t num_samples, calibration::CalibrationTokenizer& tokenizer, int64_t vocab);

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_HELD_OUT_SAMPLES_H_
