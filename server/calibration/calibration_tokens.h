// The token ids a calibration runs on: the spec's calibration data sets tokenized with the
// source's tokenizer (calibration/calibration_data.h), checked against the model's vocabulary. The
// calibrate stage stores them once per job in a tokens file (checksummed: the SHA-256 is the
// tokenize task's recorded output), so that a resumed job calibrates on exactly the same tokens
// whatever happened to the data set files since.
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

// Writes `ids` to `path` atomically: a little-endian binary "QDTOKEN1", the sample count, each
// sample's length, then all ids as int32.
absl::Status WriteTokensFile(const std::string& path, const SampleIds& ids);
// Reads a file WriteTokensFile wrote, after checking its SHA-256 against `sha256` (lowercase
// hex). DataLoss naming the file when it differs or the file is malformed; ids must be < vocab.
absl::StatusOr<SampleIds> ReadTokensFile(const std::string& path, const std::string& sha256,
                                         int64_t vocab);

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_CALIBRATION_TOKENS_H_
