// The JSON forms of a job spec: the spec file (protobuf's JSON mapping of quantd.proto's JobSpec)
// and the stored spec (JobSpecToJson's canonical JSON, the spec file's keys plus source_roots).
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/json_util.h"
#include "server/base/excerpt.h"
#include "server/base/status_macros.h"
#include "server/job/job_spec.h"

namespace quantd::job {
namespace {

using google::protobuf::FieldDescriptor;
using nlohmann::json;

absl::Status SpecError(const std::string& origin, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(origin, ": ", what));
}

// A field path in an error: in single quotes, escaped and cut as base::Excerpt quotes text (an
// unknown key is the caller's text).
std::string Quoted(absl::string_view path) {
  const std::string excerpt = base::Excerpt(path);
  return absl::StrCat("'", absl::string_view(excerpt).substr(1, excerpt.size() - 2), "'");
}

// The field of v1::JobSpec that `path` ("calibration.datasets[1].samples") names, or null;
// *element tells whether its last part is indexed (one entry of a repeated field).
const FieldDescriptor* FieldAt(absl::string_view path, bool* element) {
  const google::protobuf::Descriptor* message = v1::JobSpec::descriptor();
  const FieldDescriptor* field = nullptr;
  for (absl::string_view part : absl::StrSplit(path, '.')) {
    if (message == nullptr) return nullptr;
    const size_t bracket = part.find('[');
    *element = bracket != absl::string_view::npos;
    field = message->FindFieldByName(std::string(part.substr(0, bracket)));
    if (field == nullptr) return nullptr;
    message = field->message_type();
  }
  return field;
}

// A value of the wrong JSON type at `path`: what it must be instead.
absl::Status TypeError(const std::string& origin, absl::string_view path) {
  bool element = false;
  const FieldDescriptor* field = FieldAt(path, &element);
  if (field == nullptr) {
    return SpecError(origin, absl::StrCat("field ", Quoted(path), " has the wrong type"));
  }
  absl::string_view shown = path;
  const char* what = "has the wrong type";
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      if (field->is_repeated()) {  // include, exclude, devices: named as a whole
        shown = path.substr(0, path.find('['));
        what = "must be an array of strings";
      } else {
        what = "must be a string";
      }
      break;
    case FieldDescriptor::CPPTYPE_INT64:  // every count of a spec is >= 0
      what = "must be a non-negative integer";
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      what = "must be a number";
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      what = "must be true or false";
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      what = field->is_repeated() && !element ? "must be an array of objects" : "must be an object";
      break;
    default:
      break;
  }
  return SpecError(origin, absl::StrCat("field ", Quoted(shown), " ", what));
}

// JsonStringToMessage's error as a spec error that names the field. Its messages (protobuf 3.21)
// read "[(LOCATION)][ KEY]: WHAT", LOCATION the path of the message (or repeated field) being
// read and KEY a key in it; the others are syntax errors, which quote the input: not repeated.
absl::Status JsonError(const std::string& origin, absl::string_view message) {
  constexpr absl::string_view kNotObject = ": Root element must be a message.";
  constexpr absl::string_view kUnknown = ": Cannot find field.";
  constexpr absl::string_view kList = ": Proto field is not repeating, cannot start list.";
  constexpr absl::string_view kObject =
      ": invalid value Starting an object on a scalar field for type ";
  constexpr absl::string_view kInvalid = ": invalid value ";
  if (message == kNotObject) return SpecError(origin, "a job spec must be a JSON object");
  absl::string_view location;
  absl::string_view rest = message;
  if (absl::ConsumePrefix(&rest, "(")) {
    const size_t close = rest.find(')');
    if (close == absl::string_view::npos) return SpecError(origin, "not valid JSON");
    location = rest.substr(0, close);
    rest.remove_prefix(close + 1);
    absl::ConsumePrefix(&rest, " ");
  }
  const auto in_location = [location](absl::string_view key) {
    return location.empty() ? std::string(key) : absl::StrCat(location, ".", key);
  };
  if (absl::ConsumeSuffix(&rest, kUnknown)) {
    return SpecError(origin,
                     absl::StrCat("field ", Quoted(in_location(rest)), " is not a known field"));
  }
  if (absl::ConsumeSuffix(&rest, kList)) return TypeError(origin, in_location(rest));
  if (absl::ConsumePrefix(&rest, kObject)) {
    // An object where a scalar belongs: LOCATION is the message holding field `rest`, or the
    // repeated field itself ("include": [{}]).
    bool element = false;
    const FieldDescriptor* field = FieldAt(location, &element);
    const bool in_message =
        location.empty() ||
        (field != nullptr && field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE);
    return TypeError(origin, in_message ? in_location(rest) : std::string(location));
  }
  if (absl::StartsWith(rest, kInvalid) && !location.empty()) return TypeError(origin, location);
  return SpecError(origin, "not valid JSON");
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpecJson(const std::string& json_text,
                                             const std::string& origin) {
  if (json_text.size() > kMaxJobSpecBytes) {
    return SpecError(origin, absl::StrCat(json_text.size(), " bytes, more than the limit of ",
                                          kMaxJobSpecBytes, " for a job spec"));
  }
  v1::JobSpec spec;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;  // a misspelt key is an error, not a default
  const google::protobuf::util::Status status =
      google::protobuf::util::JsonStringToMessage(json_text, &spec, options);
  if (!status.ok()) {
    return JsonError(origin, absl::string_view(status.message().data(), status.message().size()));
  }
  return spec;
}

absl::StatusOr<JobSpec> ParseJobSpec(const std::string& json_text, const std::string& origin) {
  ASSIGN_OR_RETURN(const v1::JobSpec spec, ParseJobSpecJson(json_text, origin));
  return ValidateJobSpec(spec, origin);
}

absl::StatusOr<JobSpec> ParseStoredJobSpec(const std::string& json_text,
                                           const std::string& origin) {
  // "source_roots", the one key of the stored form that the message has not, is taken out; the
  // rest reads as a spec file. A text without the name (a job no access policy confined) is one
  // already; one that spells the key with escapes is refused as an unknown field.
  if (json_text.size() > kMaxJobSpecBytes ||
      json_text.find("source_roots") == std::string::npos) {
    return ParseJobSpec(json_text, origin);
  }
  json doc = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return SpecError(origin, "not valid JSON");
  if (!doc.is_object()) return SpecError(origin, "a job spec must be a JSON object");
  const auto it = doc.find("source_roots");
  if (it == doc.end()) return ParseJobSpec(json_text, origin);
  std::optional<std::vector<std::string>> roots;
  if (!it->is_null()) {
    if (!it->is_array()) {
      return SpecError(origin, "field 'source_roots' must be an array of strings");
    }
    roots.emplace();
    for (const json& root : *it) {
      if (!root.is_string() || root.get<std::string>().empty()) {
        return SpecError(origin, "field 'source_roots' must be an array of non-empty strings");
      }
      roots->push_back(root.get<std::string>());
    }
  }
  doc.erase(it);
  ASSIGN_OR_RETURN(JobSpec spec, ParseJobSpec(doc.dump(), origin));
  spec.source_roots = std::move(roots);
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
  // Written only when set, as evaluate.
  if (spec.verify.deep) j["verify"] = {{"deep", true}};
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
