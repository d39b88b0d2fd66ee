#include "server/evaluate_command.h"

#include <iostream>
#include <memory>
#include <string_view>

#include "CLI/CLI.hpp"
#include "server/checkpoint/atomic_file.h"
#include "server/compute/device.h"
#include "server/evaluation/quality_gate.h"
#include "server/evaluation/quality_report.h"
#include "server/evaluation/run_evaluation.h"
#include "server/job/job_spec.h"

namespace quantd {
namespace {

constexpr int kFailure = 1;
constexpr int kUsage = 2;
constexpr int kGateBroken = 3;

int Fail(std::ostream& err, const absl::Status& status, int code) {
  err << "quantd evaluate: " << status.message() << "\n";
  return code;
}

}  // namespace

int EvaluateMain(const EvaluateArgs& args, std::ostream& out, std::ostream& err) {
  absl::StatusOr<std::string> text = checkpoint::ReadFile(args.spec_path, job::kMaxJobSpecBytes);
  if (!text.ok()) return Fail(err, text.status(), kUsage);
  absl::StatusOr<job::JobSpec> spec = job::ParseJobSpec(*text, args.spec_path);
  if (!spec.ok()) return Fail(err, spec.status(), kUsage);
  evaluation::EvaluationRequest request;
  request.spec = &*spec;
  request.source = args.source.empty() ? spec->source : args.source;
  request.quantized = args.quantized.empty() ? spec->output : args.quantized;
  request.tokenizer_dir = args.tokenizer_dir.empty() ? request.source : args.tokenizer_dir;
  request.batch_bytes = args.batch_bytes;
  request.progress = [&err](std::string_view line) { err << line << "\n"; };
  absl::StatusOr<std::unique_ptr<compute::Device>> device =
      compute::OpenDevice("cpu", {.cpu_threads = args.threads});
  if (!device.ok()) return Fail(err, device.status(), kFailure);
  absl::StatusOr<evaluation::QualityReport> report =
      evaluation::RunEvaluation(request, **device);
  if (!report.ok()) return Fail(err, report.status(), kFailure);

  const absl::Status gate = evaluation::CheckQualityGate(spec->evaluate.gate, *report);
  out << evaluation::FormatQualityReport(*report);
  if (!args.out.empty()) {
    const nlohmann::json json = evaluation::EvaluationJson(*report, spec->evaluate.gate);
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
