// The token ids a calibration runs on: the spec's calibration data sets tokenized with the
// source's tokenizer (calibration/calibration_data.h), checked against the model's vocabulary. The
// calibrate stage's tokens task stores them once per job in a tokens file (checksummed: the
// SHA-256 is the task's recorded output), with the held-out samples the evaluate stage runs on,
// so that a resumed job calibrates and evaluates on exactly the same tokens whatever happened to
// the data set files since. Tokenizing is a task on a worker, never part of planning: the plan
// sizes its tasks with CalibrationTokenBound, which reads nothing.
#ifndef QUANTD_SERVER_CALIBRATION_CALIBRATION_TOKENS_H_
#define QUANTD_SERVER_CALIBRATION_CALIBRATION_TOKENS_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/job/job_spec.h"

namespace quantd::calibration {

// One token id list per sample, in the calibration set's order.
using SampleIds = std::vector<std::vector<int32_t>>;

// Tokenizes spec.calibration with DIR/tokenizer.json of `tokenizer_dir`, loaded only when a
// selected sample is text or a conversation (input_ids need none). An id >= `vocab` (the model's
// vocab_size) is InvalidArgument naming the data set file and line, unless `fold_ids` (synthetic
// fixtures only: id mod vocab).
absl::StatusOr<SampleIds> TokenizeCalibration(const job::JobSpec& spec,
                                              const std::string& tokenizer_dir, int64_t vocab,
                                              bool fold_ids);

// Total tokens of `ids`.
int64_t TokenCount(const SampleIds& ids);

// The most ids a job's tokens file holds, calibration and held-out samples together
// (WriteTokensFile refuses more).
inline constexpr int64_t kMaxJobTokens = int64_t{1} << 26;

// At most how many samples and tokens a selection gives, known without reading a data set.
struct TokenBound {
  int64_t samples = 0;
  int64_t tokens = 0;
};
// `samples` samples of at most `seq_len` tokens each, neither above kMaxJobTokens.
TokenBound BoundOf(int64_t samples, int64_t seq_len);
// The bound of the spec's calibration data sets: the samples asked of each file, each at most
// seq_len tokens. InvalidArgument as ResolveCalibrationDatasets.
absl::StatusOr<TokenBound> CalibrationTokenBound(const job::CalibrationSpec& spec);

// A job's tokens: the calibration samples and, for a job that evaluates, its held-out samples
// (evaluation/held_out_samples.h; empty otherwise).
struct JobTokens {
  SampleIds calibration;
  SampleIds held_out;
};

// Writes `tokens` to `path` atomically: a little-endian binary "QDTOKEN2", the calibration and
// held-out sample counts, each sample's length, then all ids as int32. InvalidArgument, writing
// nothing, when they hold more than kMaxJobTokens ids.
absl::Status WriteTokensFile(const std::string& path, const JobTokens& tokens);
// Reads a file WriteTokensFile wrote, after checking its SHA-256 against `sha256` (lowercase
// hex). DataLoss naming the file when it differs or the file is malformed; ids must be < vocab.
absl::StatusOr<JobTokens> ReadTokensFile(const std::string& path, const std::string& sha256,
                                         int64_t vocab);

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_CALIBRATION_TOKENS_H_
