#include "server/job/job_spec.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/excerpt.h"
#include "server/base/status_macros.h"
#include "server/base/utf8.h"
#include "server/compute/device_name.h"
#include "server/job/job_paths.h"

namespace quantd::job {
namespace {

constexpr const char* kRecipeNames[] = {"experts", "full", "custom"};
constexpr const char* kWeightFormatNames[] = {"nvfp4", "w4a16_nvfp4"};
constexpr const char* kExpertCastNames[] = {"lossless", "requantize"};
constexpr const char* kExportFormatNames[] = {"modelopt", "compressed-tensors"};
constexpr const char* kKvCacheNames[] = {"none", "fp8_cast", "fp8"};
constexpr const char* kCalibrationModeNames[] = {"data", "constant"};
constexpr const char* kW2InputNames[] = {"unweighted", "weighted", "max"};
constexpr const char* kExpertAmaxNames[] = {"per_expert", "layer_max"};
constexpr const char* kUncalibratedNames[] = {"layer_max", "model_max"};
constexpr const char* kCalibrationNumericsNames[] = {"official", "math"};

// Checks the fields of one message, naming the field in every error.
class Checker {
 public:
  explicit Checker(const std::string& origin) : origin_(origin) {}

  absl::Status Error(const std::string& field, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(origin_, ": field '", field, "' ", what));
  }

  absl::Status Required(const std::string& field, const std::string& value) const {
    return value.empty() ? Error(field, "is required") : absl::OkStatus();
  }

  // One of the first `count` of `names`; "" leaves the default in *out.
  template <typename Enum, size_t N>
  absl::Status Enumerated(const std::string& field, const std::string& value,
                          const char* const (&names)[N], size_t count, Enum* out) const {
    if (value.empty()) return absl::OkStatus();
    for (size_t i = 0; i < count; ++i) {
      if (value == names[i]) {
        *out = static_cast<Enum>(i);
        return absl::OkStatus();
      }
    }
    std::vector<std::string> allowed(names, names + count);
    return Error(field, absl::StrCat("must be one of \"", absl::StrJoin(allowed, "\", \""), "\""));
  }

  absl::Status NonNegative(const std::string& field, int64_t value, int64_t* out) const {
    if (value < 0) return Error(field, "must be a non-negative integer");
    *out = value;
    return absl::OkStatus();
  }

  // A number in [lo, hi] ((lo, hi] when `lo_open`); NaN is refused.
  absl::Status Bounded(const std::string& field, double x, double lo, double hi, bool lo_open,
                       std::optional<double>* out) const {
    if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
      return Error(field, absl::StrCat("must be a number ", lo_open ? "> " : ">= ", lo,
                                       hi < 1e300 ? absl::StrCat(" and <= ", hi) : ""));
    }
    *out = x;
    return absl::OkStatus();
  }

  // include / exclude: at most kMaxGlobs non-empty globs of valid UTF-8, each at most
  // kMaxGlobBytes long.
  absl::Status Globs(const std::string& field,
                     const google::protobuf::RepeatedPtrField<std::string>& globs,
                     std::vector<std::string>* out) const {
    if (static_cast<size_t>(globs.size()) > kMaxGlobs) {
      return Error(field, absl::StrCat("has ", globs.size(), " globs, more than ", kMaxGlobs));
    }
    for (int i = 0; i < globs.size(); ++i) {
      const std::string& glob = globs[i];
      if (glob.empty()) return Error(field, "must be an array of non-empty strings");
      if (glob.size() > kMaxGlobBytes) {
        return absl::InvalidArgumentError(absl::StrCat(origin_, ": field '", field, "' glob ", i,
                                                       " is ", glob.size(), " bytes, more than ",
                                                       kMaxGlobBytes));
      }
      if (base::FirstInvalidUtf8(glob).has_value()) {
        return absl::InvalidArgumentError(
            absl::StrCat(origin_, ": field '", field, "' glob ", i, " is not valid UTF-8"));
      }
    }
    out->assign(globs.begin(), globs.end());
    return absl::OkStatus();
  }

  // "devices": ["auto"] (or none) is every device; else distinct "cpu" / "cuda:N" names.
  absl::Status Devices(const google::protobuf::RepeatedPtrField<std::string>& devices,
                       std::vector<std::string>* out) const {
    if (devices.size() == 1 && devices[0] == "auto") return absl::OkStatus();
    for (const std::string& d : devices) {
      int index = 0;
      if (!compute::ParseDeviceName(d, &index)) {
        return Error("devices",
                     absl::StrCat("has ", base::Excerpt(d), "; expected \"cpu\" or \"cuda:N\""));
      }
      if (std::find(out->begin(), out->end(), d) != out->end()) {
        return Error("devices", absl::StrCat("lists ", base::Excerpt(d), " twice"));
      }
      out->push_back(d);
    }
    return absl::OkStatus();
  }

 private:
  const std::string& origin_;
};

absl::Status ValidateCalibration(const Checker& c, const v1::CalibrationSpec& p,
                                 CalibrationSpec* cs) {
  cs->amax_file = p.amax_file();
  cs->dataset = p.dataset();
  for (int i = 0; i < p.datasets_size(); ++i) {
    const std::string field = absl::StrCat("calibration.datasets[", i, "]");
    CalibrationDataset dataset;
    RETURN_IF_ERROR(c.Required(field + ".path", p.datasets(i).path()));
    dataset.path = p.datasets(i).path();
    RETURN_IF_ERROR(c.NonNegative(field + ".samples", p.datasets(i).samples(), &dataset.samples));
    cs->datasets.push_back(std::move(dataset));
  }
  if (!cs->dataset.empty() && !cs->datasets.empty()) {
    return c.Error("calibration.dataset", "cannot be combined with 'calibration.datasets'");
  }
  RETURN_IF_ERROR(c.NonNegative("calibration.num_samples", p.num_samples(), &cs->num_samples));
  RETURN_IF_ERROR(c.NonNegative("calibration.seq_len", p.seq_len(), &cs->seq_len));
  // 0 meant "the default" in release 0.1.0, whose state files store it so.
  if (cs->seq_len == 0) cs->seq_len = CalibrationSpec{}.seq_len;
  if (p.has_min_seq_len()) {
    RETURN_IF_ERROR(c.NonNegative("calibration.min_seq_len", p.min_seq_len(), &cs->min_seq_len));
  }
  RETURN_IF_ERROR(c.NonNegative("calibration.seed", p.seed(), &cs->seed));
  if (p.has_add_bos()) cs->add_bos = p.add_bos();
  cs->calibrate_all_experts = p.calibrate_all_experts();
  RETURN_IF_ERROR(c.Enumerated("calibration.mode", p.mode(), kCalibrationModeNames, 2, &cs->mode));
  RETURN_IF_ERROR(
      c.Enumerated("calibration.w2_input", p.w2_input(), kW2InputNames, 3, &cs->w2_input));
  RETURN_IF_ERROR(c.Enumerated("calibration.expert_amax", p.expert_amax(), kExpertAmaxNames, 2,
                               &cs->expert_amax));
  RETURN_IF_ERROR(c.Enumerated("calibration.uncalibrated", p.uncalibrated(), kUncalibratedNames, 2,
                               &cs->uncalibrated));
  RETURN_IF_ERROR(c.Enumerated("calibration.numerics", p.numerics(), kCalibrationNumericsNames, 2,
                               &cs->numerics));
  cs->amax_out = p.amax_out();
  if (p.has_checkpoint_seconds()) {
    RETURN_IF_ERROR(c.NonNegative("calibration.checkpoint_seconds", p.checkpoint_seconds(),
                                  &cs->checkpoint_seconds));
    if (cs->checkpoint_seconds > kMaxCheckpointSeconds) {
      return c.Error("calibration.checkpoint_seconds",
                     absl::StrCat("must be at most ", kMaxCheckpointSeconds, " (a year)"));
    }
  }
  if (cs->min_seq_len > cs->seq_len) {
    return c.Error("calibration.min_seq_len", "must not exceed 'calibration.seq_len'");
  }
  return absl::OkStatus();
}

absl::Status ValidateEvaluate(const Checker& c, const v1::EvaluateSpec& p, EvaluateSpec* e) {
  if (p.has_enabled()) e->enabled = p.enabled();
  RETURN_IF_ERROR(c.NonNegative("evaluate.num_samples", p.num_samples(), &e->num_samples));
  const v1::QualityGate& g = p.gate();
  QualityGate& q = e->gate;
  constexpr double kNoLimit = std::numeric_limits<double>::max();
  if (g.has_max_mean_kl()) {
    RETURN_IF_ERROR(c.Bounded("evaluate.gate.max_mean_kl", g.max_mean_kl(), 0.0, kNoLimit, false,
                              &q.max_mean_kl));
  }
  if (g.has_min_top1_agreement()) {
    RETURN_IF_ERROR(c.Bounded("evaluate.gate.min_top1_agreement", g.min_top1_agreement(), 0.0,
                              1.0, false, &q.min_top1_agreement));
  }
  if (g.has_max_ppl_ratio()) {
    RETURN_IF_ERROR(c.Bounded("evaluate.gate.max_ppl_ratio", g.max_ppl_ratio(), 0.0, kNoLimit,
                              true, &q.max_ppl_ratio));
  }
  if (!e->on() &&
      (e->num_samples != 0 || q.max_mean_kl || q.min_top1_agreement || q.max_ppl_ratio)) {
    return c.Error("evaluate.enabled",
                   "is false: 'evaluate.num_samples' and 'evaluate.gate' would not be used");
  }
  return absl::OkStatus();
}

// Every path at most kMaxPathBytes of valid UTF-8; errors name the field, never quote it.
absl::Status CheckPaths(const std::string& origin, const JobSpec& spec) {
  std::vector<std::pair<std::string, const std::string*>> paths = {
      {"source", &spec.source},
      {"output", &spec.output},
      {"materialize_bf16", &spec.materialize_bf16},
      {"calibration.amax_file", &spec.calibration.amax_file},
      {"calibration.dataset", &spec.calibration.dataset},
      {"calibration.amax_out", &spec.calibration.amax_out}};
  for (size_t i = 0; i < spec.calibration.datasets.size(); ++i) {
    paths.emplace_back(absl::StrCat("calibration.datasets[", i, "].path"),
                       &spec.calibration.datasets[i].path);
  }
  for (const auto& [field, path] : paths) {
    if (absl::Status s = CheckPathText(absl::StrCat("field '", field, "'"), *path); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* RecipeKindName(RecipeKind k) { return kRecipeNames[static_cast<int>(k)]; }
const char* WeightFormatName(WeightFormat f) { return kWeightFormatNames[static_cast<int>(f)]; }
const char* ExpertCastName(ExpertCast c) { return kExpertCastNames[static_cast<int>(c)]; }
const char* ExportFormatName(ExportFormat f) { return kExportFormatNames[static_cast<int>(f)]; }
const char* KvCacheName(KvCache k) { return kKvCacheNames[static_cast<int>(k)]; }
const char* CalibrationModeName(CalibrationMode m) {
  return kCalibrationModeNames[static_cast<int>(m)];
}
const char* W2InputName(W2Input w) { return kW2InputNames[static_cast<int>(w)]; }
const char* ExpertAmaxName(ExpertAmax e) { return kExpertAmaxNames[static_cast<int>(e)]; }
const char* UncalibratedFillName(UncalibratedFill u) {
  return kUncalibratedNames[static_cast<int>(u)];
}
const char* CalibrationNumericsName(CalibrationNumerics n) {
  return kCalibrationNumericsNames[static_cast<int>(n)];
}

absl::StatusOr<JobSpec> ValidateJobSpec(const v1::JobSpec& p, const std::string& origin) {
  const Checker c(origin);
  JobSpec spec;
  RETURN_IF_ERROR(c.Required("source", p.source()));
  spec.source = p.source();
  RETURN_IF_ERROR(c.Required("output", p.output()));
  spec.output = p.output();
  // "custom" is implied by include and is not accepted as a value.
  RETURN_IF_ERROR(c.Enumerated("recipe", p.recipe(), kRecipeNames, 2, &spec.recipe));
  RETURN_IF_ERROR(c.Globs("include", p.include(), &spec.include));
  RETURN_IF_ERROR(c.Globs("exclude", p.exclude(), &spec.exclude));
  if (!spec.include.empty()) {
    if (!p.recipe().empty()) return c.Error("include", "cannot be combined with 'recipe'");
    spec.recipe = RecipeKind::kCustom;
  }
  RETURN_IF_ERROR(
      c.Enumerated("weight_format", p.weight_format(), kWeightFormatNames, 2, &spec.weight_format));
  RETURN_IF_ERROR(
      c.Enumerated("expert_cast", p.expert_cast(), kExpertCastNames, 2, &spec.expert_cast));
  RETURN_IF_ERROR(
      c.Enumerated("export_format", p.export_format(), kExportFormatNames, 2, &spec.export_format));
  RETURN_IF_ERROR(c.Enumerated("kv_cache", p.kv_cache(), kKvCacheNames, 3, &spec.kv_cache));
  spec.materialize_bf16 = p.materialize_bf16();
  RETURN_IF_ERROR(ValidateCalibration(c, p.calibration(), &spec.calibration));
  RETURN_IF_ERROR(ValidateEvaluate(c, p.evaluate(), &spec.evaluate));
  spec.verify.deep = p.verify().deep();
  RETURN_IF_ERROR(c.Devices(p.devices(), &spec.devices));
  RETURN_IF_ERROR(
      c.NonNegative("host_memory_bytes", p.host_memory_bytes(), &spec.host_memory_bytes));
  spec.overwrite = p.overwrite();
  RETURN_IF_ERROR(CheckPaths(origin, spec));
  // Whether output or materialize_bf16 overlap the source is decided on the resolved paths
  // (job_paths.h: ResolveJobPaths), not on their spelling here.
  return spec;
}

v1::JobSpec JobSpecToProto(const JobSpec& spec) {
  v1::JobSpec out;
  out.set_source(spec.source);
  out.set_output(spec.output);
  out.set_recipe(RecipeKindName(spec.recipe));
  for (const std::string& g : spec.include) out.add_include(g);
  for (const std::string& g : spec.exclude) out.add_exclude(g);
  out.set_weight_format(WeightFormatName(spec.weight_format));
  out.set_expert_cast(ExpertCastName(spec.expert_cast));
  out.set_export_format(ExportFormatName(spec.export_format));
  out.set_kv_cache(KvCacheName(spec.kv_cache));
  out.set_materialize_bf16(spec.materialize_bf16);
  v1::CalibrationSpec* c = out.mutable_calibration();
  c->set_amax_file(spec.calibration.amax_file);
  c->set_dataset(spec.calibration.dataset);
  c->set_num_samples(spec.calibration.num_samples);
  c->set_seq_len(spec.calibration.seq_len);
  c->set_calibrate_all_experts(spec.calibration.calibrate_all_experts);
  for (const CalibrationDataset& d : spec.calibration.datasets) {
    v1::CalibrationDataset* dataset = c->add_datasets();
    dataset->set_path(d.path);
    dataset->set_samples(d.samples);
  }
  c->set_min_seq_len(spec.calibration.min_seq_len);
  c->set_seed(spec.calibration.seed);
  c->set_add_bos(spec.calibration.add_bos);
  c->set_mode(CalibrationModeName(spec.calibration.mode));
  c->set_w2_input(W2InputName(spec.calibration.w2_input));
  c->set_expert_amax(ExpertAmaxName(spec.calibration.expert_amax));
  c->set_uncalibrated(UncalibratedFillName(spec.calibration.uncalibrated));
  c->set_numerics(CalibrationNumericsName(spec.calibration.numerics));
  c->set_amax_out(spec.calibration.amax_out);
  c->set_checkpoint_seconds(spec.calibration.checkpoint_seconds);
  v1::EvaluateSpec* e = out.mutable_evaluate();
  if (spec.evaluate.enabled.has_value()) e->set_enabled(*spec.evaluate.enabled);
  e->set_num_samples(spec.evaluate.num_samples);
  const QualityGate& gate = spec.evaluate.gate;
  v1::QualityGate* g = e->mutable_gate();
  if (gate.max_mean_kl) g->set_max_mean_kl(*gate.max_mean_kl);
  if (gate.min_top1_agreement) g->set_min_top1_agreement(*gate.min_top1_agreement);
  if (gate.max_ppl_ratio) g->set_max_ppl_ratio(*gate.max_ppl_ratio);
  if (spec.verify.deep) out.mutable_verify()->set_deep(true);
  for (const std::string& d : spec.devices) out.add_devices(d);
  out.set_host_memory_bytes(spec.host_memory_bytes);
  out.set_overwrite(spec.overwrite);
  return out;
}

}  // namespace quantd::job
