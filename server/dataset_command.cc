#include "server/dataset_command.h"

#include <stdint.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "server/calibration/calibration_data.h"
#include "server/checkpoint/atomic_file.h"
#include "server/job/job_spec.h"
#include "server/tokenizer/tokenizer.h"

namespace quantd {
namespace {

constexpr int kFailure = 1;
constexpr int kUsage = 2;

int Fail(std::ostream& err, const absl::Status& status, int code) {
  err << "quantd dataset: " << status.message() << "\n";
  return code;
}

// Sample lengths in power-of-two buckets [2^k, 2^(k+1)), the empty ones left out.
void PrintHistogram(const calibration::CalibrationSet& set, std::ostream& out) {
  std::vector<int64_t> counts(32, 0);
  for (const calibration::CalibrationSample& s : set.samples) {
    int bucket = 0;
    while ((int64_t{2} << bucket) <= static_cast<int64_t>(s.ids.size())) ++bucket;
    ++counts[bucket];
  }
  out << "token lengths:\n";
  for (int b = 0; b < 32; ++b) {
    if (counts[b] == 0) continue;
    const std::string range = absl::StrFormat("[%d, %d)", int64_t{1} << b, int64_t{2} << b);
    out << absl::StrFormat("  %-16s %d\n", range, counts[b]);
  }
}

}  // namespace

int DatasetMain(const DatasetArgs& args, std::ostream& out, std::ostream& err) {
  absl::StatusOr<std::string> text = checkpoint::ReadFile(args.spec_path, job::kMaxJobSpecBytes);
  if (!text.ok()) return Fail(err, text.status(), kUsage);
  absl::StatusOr<job::JobSpec> spec = job::ParseJobSpec(*text, args.spec_path);
  if (!spec.ok()) return Fail(err, spec.status(), kUsage);
  const std::string tokenizer_dir = args.tokenizer_dir.empty() ? spec->source : args.tokenizer_dir;
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tokenizer =
      tokenizer::Tokenizer::LoadDir(tokenizer_dir);
  if (!tokenizer.ok()) return Fail(err, tokenizer.status(), kFailure);
  // The tool shows what the tokenizer makes of the data: input_ids are checked against it.
  calibration::CalibrationTokenizer loaded(**tokenizer);
  absl::StatusOr<calibration::CalibrationSet> set =
      calibration::LoadCalibrationSet(spec->calibration, spec->source_roots, loaded,
                                      (*tokenizer)->vocab_size());
  if (!set.ok()) return Fail(err, set.status(), kFailure);
  absl::StatusOr<std::string> sha256 = calibration::WriteCalibrationTokens(*set, args.out_path);
  if (!sha256.ok()) return Fail(err, sha256.status(), kFailure);

  for (const calibration::CalibrationFileStats& f : set->files) {
    int64_t truncated = 0;
    for (const calibration::CalibrationSample& s : set->samples)
      truncated += s.source == f.path && s.truncated;
    out << absl::StrFormat("%s: %d samples, %d selected, %d skipped (under %d tokens), %d truncated to %d\n",
                           f.path, f.lines, f.asked, f.skipped, spec->calibration.min_seq_len, truncated,
                           spec->calibration.seq_len);
  }
  int64_t tokens = 0, shortest = INT64_MAX, longest = 0;
  for (const calibration::CalibrationSample& s : set->samples) {
    const int64_t n = static_cast<int64_t>(s.ids.size());
    tokens += n;
    shortest = std::min(shortest, n);
    longest = std::max(longest, n);
  }
  const double samples = static_cast<double>(set->samples.size());
  out << absl::StrFormat("total: %d samples, %d tokens (mean %.1f, min %d, max %d)\n",
                         set->samples.size(), tokens, tokens / samples, shortest, longest);
  PrintHistogram(*set, out);
  out << absl::StrFormat("wrote %s (sha256 %s)\n", args.out_path, *sha256);
  return 0;
}

void AddDatasetCommand(CLI::App& app, int& rc) {
  auto args = std::make_shared<DatasetArgs>();
  CLI::App* cmd = app.add_subcommand(
      "dataset", "Show and write the calibration tokens a job spec selects");
  cmd->add_option("--spec", args->spec_path, "job spec (JSON)")->required();
  cmd->add_option("--out", args->out_path, "where to write the selected token ids (JSONL)")->required();
  cmd->add_option("--tokenizer", args->tokenizer_dir,
                  "directory with tokenizer.json (default: the spec's source)");
  cmd->callback([args, &rc] { rc = DatasetMain(*args, std::cout, std::cerr); });
}

}  // namespace quantd
