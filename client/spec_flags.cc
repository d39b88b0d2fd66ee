#include "client/spec_flags.h"

#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/atomic_file.h"
#include "server/job/job_paths.h"
#include "server/job/job_spec.h"

namespace quantd::client {
namespace {

// `path` made absolute against the current directory ("" stays "").
absl::StatusOr<std::string> Absolute(const std::string& path, const char* field) {
  if (path.empty()) return path;
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::absolute(path, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": cannot make '", path, "' absolute: ", ec.message()));
  }
  return abs.lexically_normal().string();
}

// Checks an evaluate flag's value: finite and within [min, max] (above min when `open_min`).
absl::Status CheckBound(const char* flag, double value, double min, double max, bool open_min) {
  const bool ok = std::isfinite(value) && (open_min ? value > min : value >= min) && value <= max;
  if (ok) return absl::OkStatus();
  std::string range;
  if (max != std::numeric_limits<double>::max()) {
    range = absl::StrCat("in [", min, ", ", max, "]");
  } else {
    range = absl::StrCat(open_min ? "a finite number > " : "a finite number >= ", min);
  }
  return absl::InvalidArgumentError(absl::StrCat(flag, " ", value, ": must be ", range));
}

// Applies the evaluate flags to `spec`.
absl::Status ApplyEvaluateFlags(const SpecFlags& f, v1::JobSpec* spec) {
  constexpr double kNoLimit = std::numeric_limits<double>::max();
  v1::EvaluateSpec* e = spec->mutable_evaluate();
  if (f.eval_samples) {
    if (*f.eval_samples < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--eval-samples ", *f.eval_samples, ": must not be negative"));
    }
    e->set_num_samples(*f.eval_samples);
  }
  if (f.gate_max_kl) {
    RETURN_IF_ERROR(CheckBound("--gate-max-kl", *f.gate_max_kl, 0, kNoLimit, false));
    e->mutable_gate()->set_max_mean_kl(*f.gate_max_kl);
  }
  if (f.gate_min_top1) {
    RETURN_IF_ERROR(CheckBound("--gate-min-top1", *f.gate_min_top1, 0, 1, false));
    e->mutable_gate()->set_min_top1_agreement(*f.gate_min_top1);
  }
  if (f.gate_max_ppl_ratio) {
    RETURN_IF_ERROR(CheckBound("--gate-max-ppl-ratio", *f.gate_max_ppl_ratio, 0, kNoLimit, true));
    e->mutable_gate()->set_max_ppl_ratio(*f.gate_max_ppl_ratio);
  }
  if (f.no_evaluate) {
    for (const auto& [given, flag] :
         {std::pair<bool, const char*>{f.eval_samples.has_value(), "--eval-samples"},
          {f.gate_max_kl.has_value(), "--gate-max-kl"},
          {f.gate_min_top1.has_value(), "--gate-min-top1"},
          {f.gate_max_ppl_ratio.has_value(), "--gate-max-ppl-ratio"}}) {
      if (given) {
        return absl::InvalidArgumentError(
            absl::StrCat("--no-evaluate cannot be combined with ", flag));
      }
    }
    e->set_enabled(false);
  }
  return absl::OkStatus();
}

}  // namespace

void AddSpecFlags(CLI::App* cmd, SpecFlags* f) {
  cmd->add_option("--spec", f->spec_file,
                  "JSON job spec as `quantd run` takes it; the flags below override its fields");
  cmd->add_option_function<std::string>(
      "--source", [f](const std::string& v) { f->source = v; }, "source checkpoint directory");
  cmd->add_option_function<std::string>(
      "--output", [f](const std::string& v) { f->output = v; }, "output directory");
  cmd->add_option_function<std::string>(
      "--recipe", [f](const std::string& v) { f->recipe = v; }, "experts | full");
  cmd->add_option_function<std::vector<std::string>>(
      "--include", [f](const std::vector<std::string>& v) { f->include = v; },
      "module glob of a custom recipe (repeatable)");
  cmd->add_option_function<std::vector<std::string>>(
      "--exclude", [f](const std::vector<std::string>& v) { f->exclude = v; },
      "module glob to leave unquantized (repeatable)");
  cmd->add_option_function<std::string>(
      "--weight-format", [f](const std::string& v) { f->weight_format = v; },
      "nvfp4 | w4a16_nvfp4");
  cmd->add_option_function<std::string>(
      "--expert-cast", [f](const std::string& v) { f->expert_cast = v; }, "lossless | requantize");
  cmd->add_option_function<std::string>(
      "--export-format", [f](const std::string& v) { f->export_format = v; },
      "modelopt | compressed-tensors");
  cmd->add_option_function<std::string>(
      "--kv-cache", [f](const std::string& v) { f->kv_cache = v; }, "none | fp8_cast | fp8");
  cmd->add_option_function<std::string>(
      "--materialize-bf16", [f](const std::string& v) { f->materialize_bf16 = v; },
      "directory for a BF16 copy of the source");
  cmd->add_option_function<std::string>(
      "--amax-file", [f](const std::string& v) { f->amax_file = v; },
      "JSON {module: input_amax} from an earlier calibration");
  cmd->add_option_function<std::string>(
      "--dataset", [f](const std::string& v) { f->dataset = v; }, "calibration dataset");
  cmd->add_option_function<int64_t>(
      "--num-samples", [f](const int64_t& v) { f->num_samples = v; }, "calibration samples");
  cmd->add_option_function<int64_t>(
      "--seq-len", [f](const int64_t& v) { f->seq_len = v; }, "calibration sequence length");
  cmd->add_flag("--calibrate-all-experts", f->calibrate_all_experts,
                "calibrate every routed expert");
  cmd->add_option_function<std::vector<std::string>>(
      "--calibration-dataset",
      [f](const std::vector<std::string>& v) { f->calibration_datasets = v; },
      "PATH[:SAMPLES]: a JSONL file of calibration samples (repeatable; not with --dataset)");
  cmd->add_option_function<int64_t>(
      "--min-seq-len", [f](const int64_t& v) { f->min_seq_len = v; },
      "calibration samples with fewer tokens are skipped");
  cmd->add_option_function<int64_t>(
      "--seed", [f](const int64_t& v) { f->seed = v; }, "picks the calibration samples");
  cmd->add_flag("--no-bos", f->no_bos, "no BOS before calibration samples");
  cmd->add_option_function<std::string>(
      "--calibration-mode", [f](const std::string& v) { f->calibration_mode = v; },
      "data | constant");
  cmd->add_option_function<std::string>(
      "--w2-input", [f](const std::string& v) { f->w2_input = v; },
      "unweighted | weighted | max: the input a routed w2's amax comes from");
  cmd->add_option_function<std::string>(
      "--expert-amax", [f](const std::string& v) { f->expert_amax = v; },
      "per_expert | layer_max");
  cmd->add_option_function<std::string>(
      "--uncalibrated", [f](const std::string& v) { f->uncalibrated = v; },
      "layer_max | model_max: the amax of experts no calibration token reached");
  cmd->add_option_function<std::string>(
      "--numerics", [f](const std::string& v) { f->numerics = v; },
      "official | math: the calibration forward's rounding");
  cmd->add_option_function<std::string>(
      "--amax-out", [f](const std::string& v) { f->amax_out = v; },
      "file to write the measured amax table to (the --amax-file format)");
  cmd->add_option_function<std::vector<std::string>>(
      "--device", [f](const std::vector<std::string>& v) { f->devices = v; },
      "cpu | cuda:N (repeatable); default: every device of the daemon");
  cmd->add_option_function<int64_t>(
      "--host-memory-bytes", [f](const int64_t& v) { f->host_memory_bytes = v; },
      "host memory budget of the job");
  cmd->add_flag("--overwrite", f->overwrite,
                "use a non-empty output directory; files quantd did not write are never "
                "replaced or deleted");
  cmd->add_option_function<int64_t>(
      "--eval-samples", [f](const int64_t& v) { f->eval_samples = v; },
      "held-out samples the evaluate stage compares on (0: 32, or all there are)");
  cmd->add_flag("--no-evaluate", f->no_evaluate,
                "skip the evaluate stage (on by default for a job that calibrates on data)");
  cmd->add_option_function<double>(
      "--gate-max-kl", [f](const double& v) { f->gate_max_kl = v; },
      "fail the job (QUALITY_GATE) when the mean next-token KL exceeds this (nats)");
  cmd->add_option_function<double>(
      "--gate-min-top1", [f](const double& v) { f->gate_min_top1 = v; },
      "fail the job when the top-1 agreement is below this fraction");
  cmd->add_option_function<double>(
      "--gate-max-ppl-ratio", [f](const double& v) { f->gate_max_ppl_ratio = v; },
      "fail the job when perplexity quantized / source exceeds this");
}

absl::StatusOr<v1::CalibrationDataset> ParseDatasetFlag(const std::string& value) {
  v1::CalibrationDataset dataset;
  dataset.set_path(value);
  const size_t colon = value.rfind(':');
  if (colon == std::string::npos || colon + 1 == value.size()) return dataset;
  const std::string count = value.substr(colon + 1);
  if (!std::all_of(count.begin(), count.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return dataset;
  }
  int64_t samples = 0;
  if (!absl::SimpleAtoi(count, &samples)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--calibration-dataset ", value, ": the sample count is out of range"));
  }
  dataset.set_path(value.substr(0, colon));
  dataset.set_samples(samples);
  return dataset;
}

absl::StatusOr<v1::JobSpec> BuildSpec(const SpecFlags& f) {
  v1::JobSpec spec;
  if (!f.spec_file.empty()) {
    absl::StatusOr<std::string> text = checkpoint::ReadFile(f.spec_file, job::kMaxJobSpecBytes);
    if (!text.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot read --spec file: ", text.status().message()));
    }
    absl::StatusOr<v1::JobSpec> parsed = job::ParseJobSpecJson(*text, f.spec_file);
    if (!parsed.ok()) return parsed.status();
    spec = *std::move(parsed);
  }
  v1::CalibrationSpec* cal = spec.mutable_calibration();
  if (f.source) spec.set_source(*f.source);
  if (f.output) spec.set_output(*f.output);
  if (f.recipe) spec.set_recipe(*f.recipe);
  if (f.include) spec.mutable_include()->Assign(f.include->begin(), f.include->end());
  if (f.exclude) spec.mutable_exclude()->Assign(f.exclude->begin(), f.exclude->end());
  if (f.weight_format) spec.set_weight_format(*f.weight_format);
  if (f.expert_cast) spec.set_expert_cast(*f.expert_cast);
  if (f.export_format) spec.set_export_format(*f.export_format);
  if (f.kv_cache) spec.set_kv_cache(*f.kv_cache);
  if (f.materialize_bf16) spec.set_materialize_bf16(*f.materialize_bf16);
  if (f.amax_file) cal->set_amax_file(*f.amax_file);
  if (f.dataset) cal->set_dataset(*f.dataset);
  if (f.num_samples) cal->set_num_samples(*f.num_samples);
  if (f.seq_len) cal->set_seq_len(*f.seq_len);
  if (f.calibrate_all_experts) cal->set_calibrate_all_experts(true);
  if (f.calibration_datasets) {
    cal->clear_datasets();
    for (const std::string& value : *f.calibration_datasets) {
      absl::StatusOr<v1::CalibrationDataset> dataset = ParseDatasetFlag(value);
      if (!dataset.ok()) return dataset.status();
      *cal->add_datasets() = *std::move(dataset);
    }
  }
  if (f.min_seq_len) cal->set_min_seq_len(*f.min_seq_len);
  if (f.seed) cal->set_seed(*f.seed);
  if (f.no_bos) cal->set_add_bos(false);
  if (f.calibration_mode) cal->set_mode(*f.calibration_mode);
  if (f.w2_input) cal->set_w2_input(*f.w2_input);
  if (f.expert_amax) cal->set_expert_amax(*f.expert_amax);
  if (f.uncalibrated) cal->set_uncalibrated(*f.uncalibrated);
  if (f.numerics) cal->set_numerics(*f.numerics);
  if (f.amax_out) cal->set_amax_out(*f.amax_out);
  if (f.devices) spec.mutable_devices()->Assign(f.devices->begin(), f.devices->end());
  if (f.host_memory_bytes) spec.set_host_memory_bytes(*f.host_memory_bytes);
  if (f.overwrite) spec.set_overwrite(true);
  RETURN_IF_ERROR(ApplyEvaluateFlags(f, &spec));

  if (spec.source().empty()) {
    return absl::InvalidArgumentError("submit needs --source (or \"source\" in the --spec file)");
  }
  if (spec.output().empty()) {
    return absl::InvalidArgumentError("submit needs --output (or \"output\" in the --spec file)");
  }
  // Paths are the daemon's; make relative ones absolute against this directory.
  struct PathField {
    std::string name;
    std::string* value;
  };
  std::vector<PathField> paths = {{"source", spec.mutable_source()},
                                  {"output", spec.mutable_output()},
                                  {"materialize_bf16", spec.mutable_materialize_bf16()},
                                  {"calibration.amax_file", cal->mutable_amax_file()},
                                  {"calibration.dataset", cal->mutable_dataset()},
                                  {"calibration.amax_out", cal->mutable_amax_out()}};
  for (int i = 0; i < cal->datasets_size(); ++i) {
    paths.push_back({absl::StrCat("calibration.datasets[", i, "].path"),
                     cal->mutable_datasets(i)->mutable_path()});
  }
  for (const PathField& p : paths) {
    // Checked here too: the proto would refuse invalid UTF-8 before the daemon could name the field.
    if (absl::Status s = job::CheckPathText(p.name, *p.value); !s.ok()) return s;
    absl::StatusOr<std::string> abs = Absolute(*p.value, p.name.c_str());
    if (!abs.ok()) return abs.status();
    *p.value = *std::move(abs);
  }
  return spec;
}

}  // namespace quantd::client
