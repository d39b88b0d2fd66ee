// Calibration data: the token sequences a job measures activations on, from the JSONL files its
// spec names (job/job_spec.h "calibration"). Every line of a file is one sample with exactly one of
//   {"text": STRING}                        prose: BOS (when add_bos) + its tokens, no template
//   {"messages": [{"role", "content", ...}]} a conversation, rendered by tokenizer/chat_encoding.h
//                                            (its BOS text only when add_bos)
//   {"input_ids": [ID, ...]}                 already tokenized, taken as is
// Other keys are ignored; blank lines are skipped.
//
// Each file contributes its `samples` (or an even share of num_samples, default 512 in all, the
// earlier files taking the remainder): its lines are shuffled by a fixed generator seeded from
// `seed` and the file's position, and taken in that order, skipping samples shorter than
// min_seq_len tokens, and truncating longer ones to seq_len (never padding). The same spec and
// files select the same tokens on every machine.
//
// Every line of every file is read and checked before any sample is tokenized: a missing file, a
// line that is not a JSON object, a sample with none (or more than one) of the three fields, a
// malformed conversation, input_ids outside the model's vocabulary, and fewer usable samples than
// asked are InvalidArgument errors naming the file and line, never quoting its content.
//
// The data set files are hostile input, so reading them is bounded: the files are streamed (a
// 16-byte index entry per line is kept, and only the selected lines are read again and parsed),
// one job reads at most kMaxCalibrationBytes and kMaxCalibrationLines in all its files, a line
// has at most kMaxCalibrationLineBytes, and a file named twice (by the same path or another) is
// refused. Samples given as input_ids need no tokenizer: the tokenizer.json is loaded only when a
// selected sample is text or a conversation.
#ifndef QUANTD_SERVER_CALIBRATION_CALIBRATION_DATA_H_
#define QUANTD_SERVER_CALIBRATION_CALIBRATION_DATA_H_

#include <stdint.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "server/job/job_spec.h"
#include "server/tokenizer/tokenizer.h"

namespace quantd::calibration {

inline constexpr int64_t kDefaultCalibrationSamples = 512;
// Budgets of one job's calibration data, all its files together.
inline constexpr uint64_t kMaxCalibrationBytes = uint64_t{2} << 30;
inline constexpr int64_t kMaxCalibrationLines = int64_t{4} << 20;
inline constexpr uint64_t kMaxCalibrationLineBytes = uint64_t{4} << 20;

// The tokenizer a calibration set is tokenized with, loaded when a sample first needs it.
class CalibrationTokenizer {
 public:
  // Loads DIR/tokenizer.json (tokenizer::Tokenizer::LoadDir) on first use.
  // Its files must resolve inside `roots` (checkpoint/source_roots.h).
  explicit CalibrationTokenizer(std::string dir, checkpoint::SourceRoots roots = std::nullopt)
      : dir_(std::move(dir)), roots_(std::move(roots)) {}
  // One already loaded, not owned.
  explicit CalibrationTokenizer(const tokenizer::Tokenizer& loaded) : tokenizer_(&loaded) {}

  // The tokenizer, or the error loading it gave (again on every call).
  absl::StatusOr<const tokenizer::Tokenizer*> Get();

 private:
  std::string dir_;
  checkpoint::SourceRoots roots_;
  const tokenizer::Tokenizer* tokenizer_ = nullptr;  // once loaded
  std::unique_ptr<tokenizer::Tokenizer> owned_;
  absl::Status error_;  // a failed load
};

struct CalibrationSample {
  std::string source;  // the dataset file
  int64_t line = 0;    // 1-based line in it
  std::vector<int32_t> ids;
  bool truncated = false;  // the sample had more than seq_len tokens
};

struct CalibrationFileStats {
  std::string path;
  int64_t lines = 0;     // samples in the file (blank lines not counted)
  int64_t asked = 0;     // samples to take
  int64_t taken = 0;     // samples taken: `asked`, or fewer with allow_fewer
  int64_t skipped = 0;   // visited but shorter than min_seq_len
};

struct CalibrationSet {
  std::vector<CalibrationSample> samples;  // file by file, each in its shuffled order
  std::vector<CalibrationFileStats> files;
};

// The files and per-file sample counts the spec asks for (the shorthand `dataset` expanded).
// InvalidArgument when the spec names no data set, or names one path twice.
absl::StatusOr<std::vector<job::CalibrationDataset>> ResolveCalibrationDatasets(
    const job::CalibrationSpec& spec);

// Reads, checks, selects and tokenizes the samples. `vocab`: input_ids must be below it (the
// model's vocab_size, the rows of its embedding). `add_bos` needs the tokenizer's bos_id() when a
// text or conversation is selected. `allow_fewer`: a file with fewer usable samples than asked
// gives those it has (its stats say how many) instead of an error. Each data set file must lie
// inside `roots` (the job's job::JobSpec::source_roots: judged by the file opened, as
// checkpoint::OpenRegularFile does; nullopt: anywhere), and errors name its field.
absl::StatusOr<CalibrationSet> LoadCalibrationSet(const job::CalibrationSpec& spec,
                                                  const checkpoint::SourceRoots& roots,
                                                  CalibrationTokenizer& tokenizer, int64_t vocab,
                                                  bool allow_fewer = false);

// Writes the selected tokens (`quantd dataset --out`): one line per sample, {"source": FILE,
// "line": N, "input_ids": [...]} (itself a valid calibration data set), written atomically.
// Returns the file's SHA-256 (lowercase hex).
absl::StatusOr<std::string> WriteCalibrationTokens(const CalibrationSet& set, const std::string& path);

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_CALIBRATION_DATA_H_
