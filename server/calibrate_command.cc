#include "server/calibrate_command.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/calibration/activation_store.h"
#include "server/calibration/amax_table.h"
#include "server/calibration/calibrate_layer.h"
#include "server/calibration/calibration_data.h"
#include "server/calibration/calibration_tokens.h"
#include "server/calibration/export_amax.h"
#include "server/calibration/layer_checkpoint.h"
#include "server/checkpoint/atomic_file.h"
#include "server/compute/device.h"
#include "server/job/job_spec.h"
#include "server/model/v4_weights.h"

namespace quantd {
namespace {

constexpr int kFailure = 1;
constexpr int kUsage = 2;

int Fail(std::ostream& err, const absl::Status& status, int code) {
  err << "quantd calibrate: " << status.message() << "\n";
  return code;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The process's peak resident set so far, in KiB.
int64_t PeakRssKib() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

// The process's resident set now, in KiB (0 when /proc is not readable).
int64_t RssKib() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

}  // namespace

int CalibrateMain(const CalibrateArgs& args, std::ostream& out, std::ostream& err) {
  absl::StatusOr<std::string> text = checkpoint::ReadFile(args.spec_path, job::kMaxJobSpecBytes);
  if (!text.ok()) return Fail(err, text.status(), kUsage);
  absl::StatusOr<job::JobSpec> spec = job::ParseJobSpec(*text, args.spec_path);
  if (!spec.ok()) return Fail(err, spec.status(), kUsage);
  const job::CalibrationSpec& cs = spec->calibration;
  const std::string amax_out = args.amax_out.empty() ? cs.amax_out : args.amax_out;
  if (amax_out.empty()) {
    return Fail(err, absl::InvalidArgumentError("give --amax-out or calibration.amax_out"), kUsage);
  }
  if (args.slices < 1) return Fail(err, absl::InvalidArgumentError("--slices must be >= 1"), kUsage);
  absl::StatusOr<std::unique_ptr<model::V4Checkpoint>> ckpt = model::OpenV4Checkpoint(spec->source);
  if (!ckpt.ok()) return Fail(err, ckpt.status(), kFailure);
  const model::V4Config& config = (*ckpt)->config;

  if (cs.mode == job::CalibrationMode::kConstant) {
    const std::map<std::string, float> amax = calibration::ConstantInputAmax((*ckpt)->inventory);
    if (absl::Status s = calibration::WriteAmaxFile(amax_out, amax, calibration::AmaxTable());
        !s.ok()) {
      return Fail(err, s, kFailure);
    }
    out << absl::StrFormat("wrote %s: constant amax 2688 (input_scale 1.0) for %d modules\n",
                           amax_out, amax.size());
    return 0;
  }

  absl::StatusOr<calibration::SampleIds> ids = calibration::TokenizeCalibration(
      *spec, args.tokenizer_dir.empty() ? spec->source : args.tokenizer_dir, config.vocab_size,
      args.fold_token_ids);
  if (!ids.ok()) return Fail(err, ids.status(), kFailure);
  absl::StatusOr<std::unique_ptr<compute::Device>> device =
      compute::OpenDevice("cpu", {.cpu_threads = args.threads});
  if (!device.ok()) return Fail(err, device.status(), kFailure);

  // The samples in batches, the batches in contiguous slices (calibrate_layer.h PlanBatches): the
  // same code path as the daemon's calibrate stage, run here one slice after the other.
  const int64_t n = static_cast<int64_t>(ids->size());
  int64_t tokens = 0;
  for (const std::vector<int32_t>& s : *ids) tokens += static_cast<int64_t>(s.size());
  absl::StatusOr<std::vector<calibration::BatchActivations>> batches =
      calibration::EmbedSlice(**ckpt, *ids, args.batch_bytes);
  if (!batches.ok()) return Fail(err, batches.status(), kFailure);
  const int64_t b = static_cast<int64_t>(batches->size());
  std::vector<std::vector<calibration::BatchActivations>> embedded(args.slices);
  for (int64_t s = 0; s < args.slices; ++s) {
    const auto [first, end] = calibration::SliceBatches(b, s, args.slices);
    for (int64_t i = first; i < end; ++i) embedded[s].push_back(std::move((*batches)[i]));
  }
  // Between layers the outputs stay in memory, or are spilled under --spill-dir.
  absl::StatusOr<std::unique_ptr<calibration::ActivationStore>> store =
      calibration::ActivationStore::Create(args.spill_dir, /*host_budget_bytes=*/0);
  if (!store.ok()) return Fail(err, store.status(), kFailure);
  std::unique_ptr<calibration::LayerCheckpoints> checkpoints;
  if (!args.checkpoint_dir.empty()) {
    absl::StatusOr<std::unique_ptr<calibration::LayerCheckpoints>> created =
        calibration::LayerCheckpoints::Create(args.checkpoint_dir, /*checkpoint_seconds=*/0);
    if (!created.ok()) return Fail(err, created.status(), kFailure);
    checkpoints = *std::move(created);
  }
  err << absl::StrFormat(
      "calibrating %d layers on %d samples (%d tokens, %d batches) in %d slices, %s numerics\n",
      config.num_hidden_layers, n, tokens, b, args.slices,
      job::CalibrationNumericsName(cs.numerics));

  calibration::AmaxTable table;
  calibration::SliceOptions options;
  options.numerics = cs.numerics == job::CalibrationNumerics::kMath ? model::Numerics::kMath
                                                                    : model::Numerics::kOfficial;
  options.spill_dir = (*store)->spill_dir();
  options.keep_in_host = [&store](int64_t bytes) { return (*store)->ReserveHost(bytes); };
  options.all_experts = cs.calibrate_all_experts;
  const auto start = std::chrono::steady_clock::now();
  const int64_t layers = config.num_hidden_layers;
  for (int64_t layer = 0; layer < layers; ++layer) {
    calibration::SliceTiming timing;
    double persist_seconds = 0;
    int64_t persist_bytes = 0;
    options.discard_output = layer + 1 == layers;
    for (int64_t s = 0; s < args.slices; ++s) {
      options.slice = absl::StrCat("layer ", layer, " slice ", s, " of ", args.slices);
      options.slice_index = s;
      std::shared_ptr<const calibration::ActivationStore::Batches> previous =
          layer == 0 ? nullptr : (*store)->Get(layer - 1, s);
      absl::StatusOr<calibration::SliceResult> r = calibration::CalibrateLayerSlice(
          **ckpt, layer, layer == 0 ? embedded[s] : *previous, **device, options);
      if (!r.ok()) return Fail(err, r.status(), kFailure);
      if (absl::Status m = table.Merge(r->amax); !m.ok()) return Fail(err, m, kFailure);
      if (!options.discard_output) (*store)->Put(layer, s, std::move(r->output));
      if (checkpoints != nullptr && !options.discard_output) {
        const auto persist_start = std::chrono::steady_clock::now();
        absl::StatusOr<calibration::CheckpointFile> file =
            checkpoints->Persist(layer, s, *(*store)->Get(layer, s));
        if (!file.ok()) return Fail(err, file.status(), kFailure);
        persist_seconds += SecondsSince(persist_start);
        persist_bytes += file->batch_bytes + static_cast<int64_t>(file->bytes);
      }
      timing.load += r->timing.load;
      timing.decode += r->timing.decode;
      timing.forward += r->timing.forward;
      timing.record += r->timing.record;
      timing.spill += r->timing.spill;
    }
    if (layer == 0) embedded.clear();
    if (layer > 0) (*store)->ReleaseLayer(layer - 1);
    const double elapsed = SecondsSince(start);
    const double rate = static_cast<double>(tokens) * (layer + 1) / elapsed;
    err << absl::StrFormat(
        "layer %d of %d: %.0f tokens/s, ETA %.1f s (load %.3f s, decode %.3f s, forward %.3f s, "
        "record %.3f s, spill %.3f s; RSS %d KiB, peak %d KiB)\n",
        layer + 1, layers, rate, elapsed / (layer + 1) * (layers - layer - 1), timing.load,
        timing.decode, timing.forward, timing.record, timing.spill, RssKib(), PeakRssKib());
    if (checkpoints != nullptr && !options.discard_output) {
      checkpoints->OnBoundaryCommitted(layer);
      err << absl::StrFormat("layer %d of %d checkpoint: %d bytes in %.3f s\n", layer + 1, layers,
                             persist_bytes, persist_seconds);
    }
  }
  if (checkpoints != nullptr) checkpoints->RemoveAllBut(-1);
  const double seconds = SecondsSince(start);
  store->reset();

  calibration::ExportReport report;
  absl::StatusOr<std::map<std::string, float>> amax =
      calibration::ExportInputAmax(table, config, cs, &report);
  if (!amax.ok()) return Fail(err, amax.status(), kFailure);
  if (absl::Status s = calibration::WriteAmaxFile(amax_out, *amax, table); !s.ok()) {
    return Fail(err, s, kFailure);
  }
  if (!args.table_out.empty()) {
    if (absl::Status s = checkpoint::WriteFileAtomically(args.table_out, table.Serialize());
        !s.ok()) {
      return Fail(err, s, kFailure);
    }
  }
  out << absl::StrFormat(
      "calibrated %d layers on %d tokens in %.2f s (%.0f layer-tokens/s, %.0f tokens/s through "
      "the model); %d modules, %d uncalibrated expert projections filled (%s); peak RSS %d KiB; "
      "wrote %s\n",
      layers, tokens, seconds, tokens * layers / seconds, tokens / seconds, amax->size(),
      report.filled.size(), job::UncalibratedFillName(cs.uncalibrated), PeakRssKib(), amax_out);
  return 0;
}

void AddCalibrateCommand(CLI::App& app, int& rc) {
  auto args = std::make_shared<CalibrateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate", "Measure input amax layer by layer on the CPU and write an amax file");
  cmd->add_option("SPEC", args->spec_path, "job spec (JSON)")->required();
  cmd->add_option("--amax-out", args->amax_out, "amax file to write (default calibration.amax_out)");
  cmd->add_option("--table-out", args->table_out, "also write the raw amax table (JSON)");
  cmd->add_option("--tokenizer", args->tokenizer_dir,
                  "directory with tokenizer.json (default: the spec's source)");
  cmd->add_option("--spill-dir", args->spill_dir, "keep activations between layers in files here");
  cmd->add_option("--checkpoint-dir", args->checkpoint_dir,
                  "also checkpoint every layer's outputs here, as a restartable job does (timed)");
  cmd->add_option("--slices", args->slices, "data-parallel slices of the samples")
      ->capture_default_str();
  cmd->add_option("--batch-bytes", args->batch_bytes, "working memory per batch")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "CPU threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("--fold-token-ids", args->fold_token_ids,
                "map token ids into a smaller model vocabulary (synthetic fixtures only)");
  cmd->callback([args, &rc] { rc = CalibrateMain(*args, std::cout, std::cerr); });
}

}  // namespace quantd
