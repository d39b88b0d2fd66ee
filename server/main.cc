// quantd: the command-line entry point. Each subcommand registers its options and a callback that
// sets the exit code: 0 on success, 1 when the operation fails, 2 for usage errors.
#include <stdint.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "server/calibrate_command.h"
#include "server/evaluate_command.h"
#include "server/dataset_command.h"
#include "server/fixture/fixture.h"
#include "server/fixture/fixture_spec.h"
#include "server/pipeline/inspect.h"
#include "server/pipeline/stages/verify_rules.h"
#include "server/run_command.h"
#include "server/serve_command.h"
#include "server/tokenize_command.h"
#include "server/worker_command.h"

namespace {

constexpr int kFailure = 1;
constexpr int kUsage = 2;

int Fail(const std::string& command, const absl::Status& status, int code) {
  std::cerr << "quantd " << command << ": " << status.message() << "\n";
  return code;
}

struct MkfixtureArgs {
  std::string arch = "deepseek-v4";
  std::string preset = "tiny";
  uint64_t seed = 1;
  bool force = false;
  quantd::fixture::FixtureCuts cuts;  // --layers, --mtp, --experts, --vocab
  std::string out_dir;
};

int RunMkfixture(const MkfixtureArgs& a) {
  using quantd::fixture::Preset;
  absl::StatusOr<quantd::fixture::Arch> arch = quantd::fixture::ParseArch(a.arch);
  if (!arch.ok()) return Fail("mkfixture", arch.status(), kUsage);
  absl::StatusOr<Preset> preset = quantd::fixture::ParsePreset(*arch, a.preset);
  if (!preset.ok()) return Fail("mkfixture", preset.status(), kUsage);
  absl::StatusOr<quantd::fixture::FixtureConfig> config =
      quantd::fixture::MakeConfig(*arch, *preset, a.cuts);
  if (!config.ok()) return Fail("mkfixture", config.status(), kUsage);
  quantd::fixture::WriteOptions options;
  options.force = a.force;
  if (*preset == Preset::kBench || *preset == Preset::kPro || *preset == Preset::kFlash) {
    options.progress = &std::cerr;
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<quantd::fixture::FixtureSummary> s =
      quantd::fixture::WriteFixture(*config, a.seed, a.out_dir, options);
  if (!s.ok()) return Fail("mkfixture", s.status(), kFailure);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << absl::StrFormat("wrote %s %s (seed %d) to %s: %d shards, %d tensors, %d bytes, %.2f s\n",
                               a.arch, a.preset, a.seed, a.out_dir, s->shards.size(), s->tensors,
                               s->file_bytes, secs);
  return 0;
}

void AddMkfixture(CLI::App& app, int& rc) {
  auto args = std::make_shared<MkfixtureArgs>();
  CLI::App* cmd = app.add_subcommand(
      "mkfixture", "Write a synthetic DeepSeek-V4/V3 format checkpoint from a seed");
  cmd->add_option("--arch", args->arch, "deepseek-v4 or deepseek-v3")->capture_default_str();
  cmd->add_option("--preset", args->preset,
                  "tiny, small, bench, or the real DeepSeek-V4 dimensions: pro or flash")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "random seed")->capture_default_str();
  cmd->add_option("--layers", args->cuts.layers, "pro/flash: main layers (default 1)");
  cmd->add_flag("--mtp", args->cuts.mtp, "pro/flash: also write the MTP block");
  cmd->add_option("--experts", args->cuts.experts,
                  "pro/flash: routed experts per layer, at least 6 (default: the real count)");
  cmd->add_option("--vocab", args->cuts.vocab, "pro/flash: vocabulary size (default 129280)");
  cmd->add_flag("--force", args->force, "write into a non-empty OUT_DIR");
  cmd->add_option("OUT_DIR", args->out_dir, "output directory")->required();
  cmd->callback([args, &rc] { rc = RunMkfixture(*args); });
}

struct InspectArgs {
  bool json = false;
  std::string dir;
};

int RunInspect(const InspectArgs& a) {
  absl::StatusOr<nlohmann::json> report = quantd::pipeline::InspectCheckpoint(a.dir);
  if (!report.ok()) return Fail("inspect", report.status(), kFailure);
  if (a.json) {
    std::cout << report->dump(2) << "\n";
  } else {
    std::cout << quantd::pipeline::FormatInspectReport(*report);
  }
  return 0;
}

void AddInspect(CLI::App& app, int& rc) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* cmd = app.add_subcommand(
      "inspect", "Summarize a checkpoint: shards, dtypes, formats, what each recipe quantizes");
  cmd->add_flag("--json", args->json, "machine-readable output (keys: server/pipeline/inspect.h)");
  cmd->add_option("DIR", args->dir, "checkpoint directory")->required();
  cmd->callback([args, &rc] { rc = RunInspect(*args); });
}

struct VerifyArgs {
  bool json = false;
  bool deep = false;
  std::string dir;
};

// Exit 0 when every rule holds, 1 when any is broken (or the directory cannot be read).
int RunVerify(const VerifyArgs& a) {
  absl::StatusOr<quantd::pipeline::VerifyReport> report = quantd::pipeline::VerifyCheckpoint(a.dir, a.deep);
  if (!report.ok()) return Fail("verify", report.status(), kFailure);
  if (a.json) {
    std::cout << quantd::pipeline::VerifyReportToJson(*report).dump(2) << "\n";
  } else {
    std::cout << quantd::pipeline::FormatVerifyReport(*report);
  }
  return report->ok() ? 0 : kFailure;
}

void AddVerify(CLI::App& app, int& rc) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "verify", "Check an NVFP4 checkpoint (ModelOpt or compressed-tensors) against the export rules");
  cmd->add_flag("--json", args->json, "machine-readable report");
  cmd->add_flag("--deep", args->deep,
                "re-hash every file quantd_manifest.json lists (without it: sizes only)");
  cmd->add_option("DIR", args->dir, "checkpoint directory")->required();
  cmd->callback([args, &rc] { rc = RunVerify(*args); });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"quantd: converts FP8/MXFP4 checkpoints to NVFP4"};
  app.set_version_flag("--version", "quantd " QUANTD_VERSION);
  app.require_subcommand(1);
  int rc = 0;
  AddMkfixture(app, rc);
  AddInspect(app, rc);
  AddVerify(app, rc);
  quantd::AddRunCommand(app, rc);
  quantd::AddServeCommand(app, rc);
  quantd::AddWorkerCommand(app, rc);
  quantd::AddTokenizeCommand(app, rc);
  quantd::AddDatasetCommand(app, rc);
  quantd::AddCalibrateCommand(app, rc);
  quantd::AddEvaluateCommand(app, rc);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kUsage;
  }
  return rc;
}
