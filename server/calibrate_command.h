// `quantd calibrate SPEC.json --amax-out FILE`: the layer-by-layer calibration of the spec's
// source (a DeepSeek-V4 checkpoint) on the CPU, without the daemon. The spec's calibration data
// sets are tokenized (calibration/calibration_data.h), embedded, and moved through the decoder
// layers in order; each layer's inputs are recorded by calibration/amax_observer.h and the table is
// exported under the spec's calibration options (calibration/export_amax.h) as an amax_file
// that `quantd run` reads through calibration.amax_file. `calibration.mode: "constant"` writes
// amax 2688 (input_scale 1.0) for every linear module with no forward pass.
//
// --slices N splits the batches (samples of one length, up to --batch-bytes of working memory)
// into N data-parallel slices, run one after the other and merged: the table is the same for
// every N (not for another --batch-bytes: a sequence's forward may differ in the last bit with
// the sequences that share its GEMMs). --spill-dir keeps the activations between layers in files
// there instead of host memory. --fold-token-ids maps ids into a smaller model vocabulary (id
// mod vocab_size): for synthetic fixtures only, whose vocabulary is smaller than the tokenizer's.
// Progress goes to stderr ("layer k of N", tokens/s, ETA, per-layer load/forward/record/spill).
//
// Exit codes: 0 written, 1 calibration failed (the message names the layer / file), 2 usage or
// an invalid spec.
#ifndef QUANTD_SERVER_CALIBRATE_COMMAND_H_
#define QUANTD_SERVER_CALIBRATE_COMMAND_H_

#include <stdint.h>

#include <iosfwd>
#include <string>

#include "server/calibration/calibrate_layer.h"

namespace CLI {
class App;
}  // namespace CLI

namespace quantd {

struct CalibrateArgs {
  std::string spec_path;        // SPEC.json
  std::string amax_out;         // --amax-out; "" = the spec's calibration.amax_out
  std::string table_out;        // --table-out: the raw amax table (calibration/amax_table.h)
  std::string tokenizer_dir;    // --tokenizer; "" = the spec's source
  std::string spill_dir;        // --spill-dir; "" = activations in host memory
  // --checkpoint-dir; "" = none: every layer's outputs are also checkpointed there as a calibrating
  // job's are (calibration/layer_checkpoint.h), timed, to measure what a boundary costs.
  std::string checkpoint_dir;
  int64_t slices = 1;           // --slices
  int64_t batch_bytes = calibration::kDefaultBatchBytes;  // --batch-bytes: per RunLayer call
  int threads = 0;              // --threads; 0 = all cores
  bool fold_token_ids = false;  // --fold-token-ids
};

// Runs the command; the summary goes to `out`, progress and errors to `err`.
int CalibrateMain(const CalibrateArgs& args, std::ostream& out, std::ostream& err);

// Registers the `calibrate` subcommand; its callback stores the exit code in `rc`.
void AddCalibrateCommand(CLI::App& app, int& rc);

}  // namespace quantd

#endif  // QUANTD_SERVER_CALIBRATE_COMMAND_H_
