#include "server/evaluate_command.h"

#include <chrono>
#include <iostream>
#include <memory>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/checkpoint/atomic_file.h"
#include "server/compute/device.h"
#include "server/evaluation/evaluate_head.h"
#include "server/evaluation/evaluate_layer.h"
#include "server/evaluation/evaluation_batches.h"
#include "server/evaluation/held_out_samples.h"
#include "server/evaluation/quality_gate.h"
#include "server/evaluation/quality_report.h"
#include "server/model/tokenizer.h"
#include "server/model/v4_weights.h"
#include "server/pipeline/job_spec.h"

namespace quantd {
namespace {

constexpr int kFailure = 1;
constexpr int kUsage = 2;
constexpr int kGateBroken = 3;

int Fail(std::ostream& err, const absl::Status& status, int code) {
  err << "quantd evaluate: " << status.message() << "\n";
  return code;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int EvaluateMain(const EvaluateArgs& args, std::ostream& out, std::ostream& err) {
  absl::StatusOr<std::string> text =
      checkpoint::ReadFile(args.spec_path, pipeline::kMaxJobSpecBytes);
  if (!text.ok()) return Fail(err, text.status(), kUsage);
  absl::StatusOr<pipeline::JobSpec> spec = pipeline::ParseJobSpec(*text, args.spec_path);
  if (!spec.ok()) return Fail(err, spec.status(), kUsage);
  const std::string source_dir = args.source.empty() ? spec->source : args.source;
  const std::string quantized_dir = args.quantized.empty() ? spec->output : args.quantized;
  absl::StatusOr<std::unique_ptr<model::V4Checkpoint>> source =
      model::OpenV4Checkpoint(source_dir);
  if (!source.ok()) return Fail(err, source.status(), kFailure);
  absl::StatusOr<std::unique_ptr<model::V4Checkpoint>> quantized =
      model::OpenV4Checkpoint(quantized_dir);
  if (!quantized.ok()) return Fail(err, quantized.status(), kFailure);

  const std::string tokenizer_dir = args.tokenizer_dir.empty() ? source_dir : args.tokenizer_dir;
  absl::StatusOr<std::unique_ptr<model::Tokenizer>> tokenizer =
      model::Tokenizer::LoadDir(tokenizer_dir);
  if (!tokenizer.ok()) return Fail(err, tokenizer.status(), kFailure);
  const int64_t num_samples = spec->evaluate.num_samples > 0 ? spec->evaluate.num_samples
                                                             : pipeline::kDefaultEvaluateSamples;
  absl::StatusOr<std::vector<std::vector<int32_t>>> samples =
      evaluation::LoadHeldOutSamples(spec->calibration, num_samples, **tokenizer);
  if (!samples.ok()) return Fail(err, samples.status(), kFailure);
  absl::StatusOr<std::unique_ptr<compute::Device>> device =
      compute::OpenDevice("cpu", {.cpu_threads = args.threads});
  if (!device.ok()) return Fail(err, device.status(), kFailure);

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<evaluation::EvaluationBatches> batches =
      evaluation::EmbedHeldOut(**source, **quantized, *samples, args.batch_bytes);
  if (!batches.ok()) return Fail(err, batches.status(), kFailure);
  const model::Numerics numerics =
      spec->calibration.numerics == pipeline::CalibrationNumerics::kMath
          ? model::Numerics::kMath
          : model::Numerics::kOfficial;
  evaluation::QualityReport report;
  report.source = source_dir;
  report.quantized = quantized_dir;
  report.numerics = pipeline::CalibrationNumericsName(spec->calibration.numerics);
  report.samples = static_cast<int64_t>(samples->size());
  report.tokens = batches->tokens();
  const int64_t layers = (*source)->config.num_hidden_layers;
  err << absl::StrFormat("evaluating %d layers on %d held-out samples (%d tokens, %d batches), %s "
                         "numerics\n",
                         layers, report.samples, report.tokens, batches->source.size(),
                         report.numerics);
  for (int64_t layer = 0; layer < layers; ++layer) {
    absl::StatusOr<evaluation::LayerQuality> q = evaluation::EvaluateLayer(
        **source, **quantized, layer, *batches, **device, numerics);
    if (!q.ok()) return Fail(err, q.status(), kFailure);
    err << absl::StrFormat("layer %d of %d: SQNR %.2f dB free-running, %.2f dB teacher-forced "
                           "(load %.3f s, forward %.3f s)\n",
                           layer + 1, layers, q->free_running.Db(), q->teacher_forced.Db(),
                           q->load_seconds, q->forward_seconds);
    report.layers.push_back(*q);
  }
  absl::StatusOr<evaluation::NextTokenQuality> next =
      evaluation::EvaluateHead(**source, **quantized, *batches, **device, numerics);
  if (!next.ok()) return Fail(err, next.status(), kFailure);
  report.next_token = *next;
  report.seconds = SecondsSince(start);

  const absl::Status gate = evaluation::CheckQualityGate(spec->evaluate.gate, report);
  out << evaluation::FormatQualityReport(report);
  if (!args.out.empty()) {
    nlohmann::json json = evaluation::QualityReportToJson(report);
    json["gate"] = {{"passed", gate.ok()},
                    {"broken", evaluation::BrokenBounds(spec->evaluate.gate, report)}};
    if (absl::Status s = checkpoint::WriteFileAtomically(args.out, json.dump(2) + "\n"); !s.ok()) {
      return Fail(err, s, kFailure);
    }
  }
  if (!gate.ok()) return Fail(err, gate, kGateBroken);
  return 0;
}

void AddEvaluateCommand(CLI::App& app, int& rc) {
  auto args = std::make_shared<EvaluateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "evaluate", "Measure the quantized model against its source on held-out samples (CPU)");
  cmd->add_option("SPEC", args->spec_path, "job spec (JSON)")->required();
  cmd->add_option("--out", args->out, "write the figures as JSON");
  cmd->add_option("--source", args->source, "source checkpoint (default: the spec's source)");
  cmd->add_option("--quantized", args->quantized,
                  "quantized checkpoint (default: the spec's output)");
  cmd->add_option("--tokenizer", args->tokenizer_dir,
                  "directory with tokenizer.json (default: the source)");
  cmd->add_option("--batch-bytes", args->batch_bytes, "working memory per batch")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "CPU threads (0 = all cores)")->capture_default_str();
  cmd->callback([args, &rc] { rc = EvaluateMain(*args, std::cout, std::cerr); });
}

}  // namespace quantd
