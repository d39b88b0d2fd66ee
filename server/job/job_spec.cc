#include "server/job/job_spec.h"

#include <limits>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/compute/device_name.h"
#include "server/job/job_paths.h"

namespace quantd::job {
namespace {

using nlohmann::json;

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

// Reads the fields of one JSON object, naming the field in every error, and rejects keys that
// nobody read.
class FieldReader {
 public:
  FieldReader(const json& object, std::string prefix, std::string origin)
      : object_(object), prefix_(std::move(prefix)), origin_(std::move(origin)) {}

  absl::Status Error(const std::string& field, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(origin_, ": field '", prefix_, field, "' ", what));
  }

  const json* Get(const std::string& field) {
    seen_.push_back(field);
    auto it = object_.find(field);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }

  absl::Status String(const std::string& field, bool required, std::string* out) {
    const json* v = Get(field);
    if (v == nullptr) return required ? Error(field, "is required") : absl::OkStatus();
    if (!v->is_string()) return Error(field, "must be a string");
    *out = v->get<std::string>();
    if (required && out->empty()) return Error(field, "must not be empty");
    return absl::OkStatus();
  }

  template <typename Enum, size_t N>
  absl::Status Enumerated(const std::string& field, const char* const (&names)[N], size_t count,
                          Enum* out, bool* present = nullptr) {
    const json* v = Get(field);
    if (present != nullptr) *present = v != nullptr;
    if (v == nullptr) return absl::OkStatus();
    if (v->is_string()) {
      const std::string s = v->get<std::string>();
      for (size_t i = 0; i < count; ++i) {
        if (s == names[i]) {
          *out = static_cast<Enum>(i);
          return absl::OkStatus();
        }
      }
    }
    std::vector<std::string> allowed(names, names + count);
    return Error(field, absl::StrCat("must be one of \"", absl::StrJoin(allowed, "\", \""), "\""));
  }

  absl::Status StringList(const std::string& field, std::vector<std::string>* out) {
    const json* v = Get(field);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_array()) return Error(field, "must be an array of strings");
    for (const json& item : *v) {
      if (!item.is_string() || item.get<std::string>().empty()) {
        return Error(field, "must be an array of non-empty strings");
      }
      out->push_back(item.get<std::string>());
    }
    return absl::OkStatus();
  }

  absl::Status NonNegativeInt(const std::string& field, int64_t* out) {
    const json* v = Get(field);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_number_integer() || v->get<int64_t>() < 0) {
      return Error(field, "must be a non-negative integer");
    }
    *out = v->get<int64_t>();
    return absl::OkStatus();
  }

  // A number in [lo, hi] (an absent field leaves *out unset).
  absl::Status BoundedNumber(const std::string& field, double lo, double hi, bool lo_open,
                             std::optional<double>* out) {
    const json* v = Get(field);
    if (v == nullptr) return absl::OkStatus();
    const double x = v->is_number() ? v->get<double>() : 0.0;
    if (!v->is_number() || !(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
      return Error(field, absl::StrCat("must be a number ", lo_open ? "> " : ">= ", lo,
                                       hi < 1e300 ? absl::StrCat(" and <= ", hi) : ""));
    }
    *out = x;
    return absl::OkStatus();
  }

  absl::Status Bool(const std::string& field, bool* out) {
    const json* v = Get(field);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_boolean()) return Error(field, "must be true or false");
    *out = v->get<bool>();
    return absl::OkStatus();
  }

  // Any key that no reader asked for is an error.
  absl::Status RejectUnknown() const {
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (std::find(seen_.begin(), seen_.end(), it.key()) == seen_.end()) {
        return Error(it.key(), "is not a known field");
      }
    }
    return absl::OkStatus();
  }

 private:
  const json& object_;             // the object being read
  std::string prefix_;             // "calibration." for nested fields
  std::string origin_;             // file name or "request", for errors
  std::vector<std::string> seen_;  // fields asked for so far
};

#define QUANTD_RETURN_IF_ERROR(expr)       \
  do {                                     \
    if (absl::Status _s = (expr); !_s.ok()) \
      return _s;                           \
  } while (0)

absl::Status ParseDevices(FieldReader& r, std::vector<std::string>* devices) {
  const json* v = r.Get("devices");
  if (v == nullptr) return absl::OkStatus();
  if (v->is_string() && v->get<std::string>() == "auto") return absl::OkStatus();
  if (!v->is_array() || v->empty()) {
    return r.Error("devices", "must be \"auto\" or a non-empty array like [\"cpu\", \"cuda:0\"]");
  }
  for (const json& d : *v) {
    int index = 0;
    if (!d.is_string() || !compute::ParseDeviceName(d.get<std::string>(), &index)) {
      return r.Error("devices", absl::StrCat("has ", d.dump(), "; expected \"cpu\" or \"cuda:N\""));
    }
    if (std::find(devices->begin(), devices->end(), d.get<std::string>()) != devices->end()) {
      return r.Error("devices", absl::StrCat("lists ", d.dump(), " twice"));
    }
    devices->push_back(d.get<std::string>());
  }
  return absl::OkStatus();
}

// "calibration.datasets": [{"path": JSONL, "samples": N}, ...].
absl::Status ParseCalibrationDatasets(FieldReader& c, const std::string& origin,
                                      std::vector<CalibrationDataset>* datasets) {
  const json* v = c.Get("datasets");
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_array() || v->empty()) {
    return c.Error("datasets", "must be a non-empty array of {\"path\": ..., \"samples\": N}");
  }
  for (size_t i = 0; i < v->size(); ++i) {
    const json& entry = (*v)[i];
    if (!entry.is_object()) return c.Error(absl::StrCat("datasets[", i, "]"), "must be an object");
    FieldReader d(entry, absl::StrCat("calibration.datasets[", i, "]."), origin);
    CalibrationDataset dataset;
    QUANTD_RETURN_IF_ERROR(d.String("path", true, &dataset.path));
    QUANTD_RETURN_IF_ERROR(d.NonNegativeInt("samples", &dataset.samples));
    QUANTD_RETURN_IF_ERROR(d.RejectUnknown());
    datasets->push_back(std::move(dataset));
  }
  return absl::OkStatus();
}

// The size limits of the header comment; errors name the field, never quote it.
absl::Status CheckLimits(const std::string& origin, const JobSpec& spec) {
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
  for (const auto& [field, globs] :
       {std::pair<const char*, const std::vector<std::string>*>{"include", &spec.include},
        {"exclude", &spec.exclude}}) {
    if (globs->size() > kMaxGlobs) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ": field '", field, "' has ",
                                                     globs->size(), " globs, more than ",
                                                     kMaxGlobs));
    }
    for (size_t i = 0; i < globs->size(); ++i) {
      if ((*globs)[i].size() > kMaxGlobBytes) {
        return absl::InvalidArgumentError(absl::StrCat(origin, ": field '", field, "' glob ", i,
                                                       " is ", (*globs)[i].size(),
                                                       " bytes, more than ", kMaxGlobBytes));
      }
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

absl::StatusOr<JobSpec> ParseJobSpec(const std::string& json_text, const std::string& origin) {
  if (json_text.size() > kMaxJobSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": ", json_text.size(),
                                                   " bytes, more than the limit of ",
                                                   kMaxJobSpecBytes, " for a job spec"));
  }
  json doc = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(origin, ": not valid JSON"));
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": a job spec must be a JSON object"));
  }
  JobSpec spec;
  FieldReader r(doc, "", origin);
  QUANTD_RETURN_IF_ERROR(r.String("source", true, &spec.source));
  QUANTD_RETURN_IF_ERROR(r.String("output", true, &spec.output));
  bool recipe_given = false;
  // "custom" is implied by include and is not accepted as a value.
  QUANTD_RETURN_IF_ERROR(r.Enumerated("recipe", kRecipeNames, 2, &spec.recipe, &recipe_given));
  QUANTD_RETURN_IF_ERROR(r.StringList("include", &spec.include));
  QUANTD_RETURN_IF_ERROR(r.StringList("exclude", &spec.exclude));
  if (!spec.include.empty()) {
    if (recipe_given) return r.Error("include", "cannot be combined with 'recipe'");
    spec.recipe = RecipeKind::kCustom;
  }
  QUANTD_RETURN_IF_ERROR(r.Enumerated("weight_format", kWeightFormatNames, 2, &spec.weight_format));
  QUANTD_RETURN_IF_ERROR(r.Enumerated("expert_cast", kExpertCastNames, 2, &spec.expert_cast));
  QUANTD_RETURN_IF_ERROR(r.Enumerated("export_format", kExportFormatNames, 2, &spec.export_format));
  QUANTD_RETURN_IF_ERROR(r.Enumerated("kv_cache", kKvCacheNames, 3, &spec.kv_cache));
  QUANTD_RETURN_IF_ERROR(r.String("materialize_bf16", false, &spec.materialize_bf16));
  if (const json* cal = r.Get("calibration"); cal != nullptr) {
    if (!cal->is_object()) return r.Error("calibration", "must be an object");
    FieldReader c(*cal, "calibration.", origin);
    QUANTD_RETURN_IF_ERROR(c.String("amax_file", false, &spec.calibration.amax_file));
    QUANTD_RETURN_IF_ERROR(c.String("dataset", false, &spec.calibration.dataset));
    QUANTD_RETURN_IF_ERROR(ParseCalibrationDatasets(c, origin, &spec.calibration.datasets));
    if (!spec.calibration.dataset.empty() && !spec.calibration.datasets.empty()) {
      return c.Error("dataset", "cannot be combined with 'calibration.datasets'");
    }
    QUANTD_RETURN_IF_ERROR(c.NonNegativeInt("num_samples", &spec.calibration.num_samples));
    QUANTD_RETURN_IF_ERROR(c.NonNegativeInt("seq_len", &spec.calibration.seq_len));
    QUANTD_RETURN_IF_ERROR(c.NonNegativeInt("min_seq_len", &spec.calibration.min_seq_len));
    QUANTD_RETURN_IF_ERROR(c.NonNegativeInt("seed", &spec.calibration.seed));
    QUANTD_RETURN_IF_ERROR(c.Bool("add_bos", &spec.calibration.add_bos));
    QUANTD_RETURN_IF_ERROR(c.Bool("calibrate_all_experts", &spec.calibration.calibrate_all_experts));
    CalibrationSpec& cs = spec.calibration;
    QUANTD_RETURN_IF_ERROR(c.Enumerated("mode", kCalibrationModeNames, 2, &cs.mode));
    QUANTD_RETURN_IF_ERROR(c.Enumerated("w2_input", kW2InputNames, 3, &cs.w2_input));
    QUANTD_RETURN_IF_ERROR(c.Enumerated("expert_amax", kExpertAmaxNames, 2, &cs.expert_amax));
    QUANTD_RETURN_IF_ERROR(c.Enumerated("uncalibrated", kUncalibratedNames, 2, &cs.uncalibrated));
    QUANTD_RETURN_IF_ERROR(c.Enumerated("numerics", kCalibrationNumericsNames, 2, &cs.numerics));
    QUANTD_RETURN_IF_ERROR(c.String("amax_out", false, &cs.amax_out));
    QUANTD_RETURN_IF_ERROR(c.NonNegativeInt("checkpoint_seconds", &cs.checkpoint_seconds));
    if (cs.checkpoint_seconds > kMaxCheckpointSeconds) {
      return c.Error("checkpoint_seconds",
                     absl::StrCat("must be at most ", kMaxCheckpointSeconds, " (a year)"));
    }
    QUANTD_RETURN_IF_ERROR(c.RejectUnknown());
    // 0 meant "the default" in release 0.1.0, whose state files store it so.
    if (spec.calibration.seq_len == 0) spec.calibration.seq_len = CalibrationSpec{}.seq_len;
    if (spec.calibration.min_seq_len > spec.calibration.seq_len) {
      return c.Error("min_seq_len", "must not exceed 'calibration.seq_len'");
    }
  }
  if (const json* ev = r.Get("evaluate"); ev != nullptr) {
    if (!ev->is_object()) return r.Error("evaluate", "must be an object");
    FieldReader e(*ev, "evaluate.", origin);
    if (e.Get("enabled") != nullptr) {
      bool enabled = true;
      QUANTD_RETURN_IF_ERROR(e.Bool("enabled", &enabled));
      spec.evaluate.enabled = enabled;
    }
    QUANTD_RETURN_IF_ERROR(e.NonNegativeInt("num_samples", &spec.evaluate.num_samples));
    if (const json* gate = e.Get("gate"); gate != nullptr) {
      if (!gate->is_object()) return e.Error("gate", "must be an object");
      FieldReader g(*gate, "evaluate.gate.", origin);
      QualityGate& q = spec.evaluate.gate;
      constexpr double kNoLimit = std::numeric_limits<double>::max();
      QUANTD_RETURN_IF_ERROR(g.BoundedNumber("max_mean_kl", 0.0, kNoLimit, false, &q.max_mean_kl));
      QUANTD_RETURN_IF_ERROR(
          g.BoundedNumber("min_top1_agreement", 0.0, 1.0, false, &q.min_top1_agreement));
      QUANTD_RETURN_IF_ERROR(
          g.BoundedNumber("max_ppl_ratio", 0.0, kNoLimit, true, &q.max_ppl_ratio));
      QUANTD_RETURN_IF_ERROR(g.RejectUnknown());
    }
    QUANTD_RETURN_IF_ERROR(e.RejectUnknown());
    const QualityGate& q = spec.evaluate.gate;
    if (!spec.evaluate.on() && (spec.evaluate.num_samples != 0 || q.max_mean_kl ||
                                q.min_top1_agreement || q.max_ppl_ratio)) {
      return e.Error("enabled", "is false: 'evaluate.num_samples' and 'evaluate.gate' would not "
                                "be used");
    }
  }
  QUANTD_RETURN_IF_ERROR(ParseDevices(r, &spec.devices));
  QUANTD_RETURN_IF_ERROR(r.NonNegativeInt("host_memory_bytes", &spec.host_memory_bytes));
  QUANTD_RETURN_IF_ERROR(r.Bool("overwrite", &spec.overwrite));
  std::vector<std::string> source_roots;
  QUANTD_RETURN_IF_ERROR(r.StringList("source_roots", &source_roots));
  if (auto it = doc.find("source_roots"); it != doc.end() && !it->is_null()) {
    spec.source_roots = std::move(source_roots);
  }
  QUANTD_RETURN_IF_ERROR(r.RejectUnknown());
  QUANTD_RETURN_IF_ERROR(CheckLimits(origin, spec));
  // Whether output or materialize_bf16 overlap the source is decided on the resolved paths
  // (job_paths.h: ResolveJobPaths), not on their spelling here.
  return spec;
}

std::string JobSpecToJson(const JobSpec& spec) {
  json j = json::object();
  j["source"] = spec.source;
  j["output"] = spec.output;
  if (spec.recipe == RecipeKind::kCustom) {
    j["include"] = spec.include;
  } else {
    j["recipe"] = RecipeKindName(spec.recipe);
  }
  j["exclude"] = spec.exclude;
  j["weight_format"] = WeightFormatName(spec.weight_format);
  j["expert_cast"] = ExpertCastName(spec.expert_cast);
  j["export_format"] = ExportFormatName(spec.export_format);
  j["kv_cache"] = KvCacheName(spec.kv_cache);
  if (!spec.materialize_bf16.empty()) j["materialize_bf16"] = spec.materialize_bf16;
  j["calibration"] = {{"amax_file", spec.calibration.amax_file},
                      {"dataset", spec.calibration.dataset},
                      {"num_samples", spec.calibration.num_samples},
                      {"seq_len", spec.calibration.seq_len},
                      {"min_seq_len", spec.calibration.min_seq_len},
                      {"seed", spec.calibration.seed},
                      {"add_bos", spec.calibration.add_bos},
                      {"calibrate_all_experts", spec.calibration.calibrate_all_experts},
                      {"mode", CalibrationModeName(spec.calibration.mode)},
                      {"w2_input", W2InputName(spec.calibration.w2_input)},
                      {"expert_amax", ExpertAmaxName(spec.calibration.expert_amax)},
                      {"uncalibrated", UncalibratedFillName(spec.calibration.uncalibrated)},
                      {"numerics", CalibrationNumericsName(spec.calibration.numerics)},
                      {"amax_out", spec.calibration.amax_out}};
  if (!spec.calibration.datasets.empty()) {
    json datasets = json::array();
    for (const CalibrationDataset& d : spec.calibration.datasets) {
      datasets.push_back({{"path", d.path}, {"samples", d.samples}});
    }
    j["calibration"]["datasets"] = std::move(datasets);
  }
  // Written only when set, so that the canonical spec of a job without it stays what earlier
  // releases stored (`quantd run` identifies its job by it).
  if (spec.calibration.checkpoint_seconds != kDefaultCheckpointSeconds) {
    j["calibration"]["checkpoint_seconds"] = spec.calibration.checkpoint_seconds;
  }
  // Written only when set, so that the canonical spec of a job without it stays what earlier
  // releases stored.
  const QualityGate& gate = spec.evaluate.gate;
  if (spec.evaluate.set()) {
    json g = json::object();
    if (gate.max_mean_kl) g["max_mean_kl"] = *gate.max_mean_kl;
    if (gate.min_top1_agreement) g["min_top1_agreement"] = *gate.min_top1_agreement;
    if (gate.max_ppl_ratio) g["max_ppl_ratio"] = *gate.max_ppl_ratio;
    j["evaluate"] = {{"num_samples", spec.evaluate.num_samples}, {"gate", std::move(g)}};
    if (spec.evaluate.enabled.has_value()) j["evaluate"]["enabled"] = *spec.evaluate.enabled;
  }
  if (spec.devices.empty()) {
    j["devices"] = "auto";
  } else {
    j["devices"] = spec.devices;
  }
  j["host_memory_bytes"] = spec.host_memory_bytes;
  if (spec.overwrite) j["overwrite"] = true;
  if (spec.source_roots.has_value()) j["source_roots"] = *spec.source_roots;
  return j.dump();
}

}  // namespace quantd::job
