// `quantd evaluate SPEC.json [--out FILE]`: the quantized model (the spec's output) against its
// source on held-out samples, layer by layer on the CPU, without the daemon
// (server/evaluation/). The held-out samples come from the spec's calibration data, after the
// calibration samples (evaluation/held_out_samples.h), evaluate.num_samples of them (default
// 32). Both models run with calibration.numerics; NVFP4 modules of the output decode their
// weights, and quantize their inputs as a W4A4 runtime does when they have an input_scale. In
// `official` numerics only FP8 / MXFP4 modules simulate DeepSeek's FP8 activation quantization,
// so a BF16 or W4A16 module differs from its FP8 source there even when its weight is exact, as
// it does in a reader that runs it in BF16; `math` numerics compare the weights alone.
//
// Prints per layer the hidden-state SQNR, free-running and teacher-forced, then the next-token
// KL (mean, p99), top-1 agreement and both perplexities; --out writes the same as JSON
// (evaluation/quality_report.h) with the gate's verdict. --source / --quantized replace the
// spec's source / output directories (to evaluate another output, or a checkpoint against
// itself). Progress goes to stderr.
//
// Exit codes: 0 evaluated (and the gate, if any, passed), 1 evaluation failed (the message names
// the layer / file), 2 usage or an invalid spec, 3 the quality gate is broken (the message names
// each figure out of bounds and the layer with the lowest teacher-forced SQNR).
#ifndef QUANTD_SERVER_EVALUATE_COMMAND_H_
#define QUANTD_SERVER_EVALUATE_COMMAND_H_

#include <stdint.h>

#include <iosfwd>
#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace quantd {

struct EvaluateArgs {
  std::string spec_path;       // SPEC.json
  std::string out;             // --out: the figures as JSON; "" = printed only
  std::string source;          // --source; "" = the spec's source
  std::string quantized;       // --quantized; "" = the spec's output
  std::string tokenizer_dir;   // --tokenizer; "" = the source's
  int64_t batch_bytes = int64_t{1} << 30;  // --batch-bytes: working memory per RunLayer call
  int threads = 0;             // --threads; 0 = all cores
};

// Runs the command; the figures go to `out`, progress and errors to `err`.
int EvaluateMain(const EvaluateArgs& args, std::ostream& out, std::ostream& err);

// Registers the `evaluate` subcommand; its callback stores the exit code in `rc`.
void AddEvaluateCommand(CLI::App& app, int& rc);

}  // namespace quantd

#endif  // QUANTD_SERVER_EVALUATE_COMMAND_H_
