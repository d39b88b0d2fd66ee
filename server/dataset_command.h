// `quantd dataset --spec SPEC.json --out FILE [--tokenizer DIR]`: shows what a job would calibrate
// on. Reads the spec's calibration data sets (calibration/calibration_data.h) with the tokenizer of
// DIR (default: the spec's source checkpoint), prints per-file counts, token totals and a
// histogram of sample lengths, and writes the selected token ids to FILE (one {"source", "line",
// "input_ids"} object per line: itself a calibration data set), with its SHA-256.
//
// Exit codes: 0 written, 1 the data sets or the tokenizer failed a check (the message names the
// file and line), 2 usage or an invalid spec.
#ifndef QUANTD_SERVER_DATASET_COMMAND_H_
#define QUANTD_SERVER_DATASET_COMMAND_H_

#include <iosfwd>
#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace quantd {

struct DatasetArgs {
  std::string spec_path;      // --spec
  std::string out_path;       // --out
  std::string tokenizer_dir;  // --tokenizer; "" = the spec's source
};

// Runs the command; the report goes to `out`, errors to `err`. Returns the exit code.
int DatasetMain(const DatasetArgs& args, std::ostream& out, std::ostream& err);

// Registers the `dataset` subcommand; its callback stores the exit code in `rc`.
void AddDatasetCommand(CLI::App& app, int& rc);

}  // namespace quantd

#endif  // QUANTD_SERVER_DATASET_COMMAND_H_
