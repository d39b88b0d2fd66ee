#include "server/calibration/calibrate_task.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace quantd::calibration {
namespace {

constexpr const char* kKindNames[] = {"tokens", "layer", "amax_out"};

}  // namespace

std::string CalibrateTaskName(int64_t layer, int64_t slice) {
  return absl::StrCat("layer", layer, ".slice", slice);
}

std::string CalibrateTask::Name() const {
  return kind == Kind::kLayer ? CalibrateTaskName(layer, slice)
                              : kKindNames[static_cast<int>(kind)];
}

std::string ToJson(const CalibrateTask& t) {
  nlohmann::ordered_json j;
  j["kind"] = kKindNames[static_cast<int>(t.kind)];
  j["layers"] = t.layers;
  j["slices"] = t.slices;
  if (t.kind == CalibrateTask::Kind::kLayer) {
    j["layer"] = t.layer;
    j["slice"] = t.slice;
    j["first_batch"] = t.first_batch;
    j["end_batch"] = t.end_batch;
  }
  return j.dump();
}

absl::StatusOr<CalibrateTask> ParseCalibrateTask(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto bad = [](const char* field) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibrate task payload: ", field, " is missing or not valid"));
  };
  if (!j.is_object() || !j.contains("kind") || !j["kind"].is_string()) return bad("kind");
  CalibrateTask t;
  const std::string kind = j["kind"].get<std::string>();
  int k = 0;
  while (k < 3 && kind != kKindNames[k]) ++k;
  if (k == 3) return bad("kind");
  t.kind = static_cast<CalibrateTask::Kind>(k);
  const auto get = [&j](const char* field, int64_t* out) {
    if (!j.contains(field) || !j[field].is_number_integer() || j[field].get<int64_t>() < 0) {
      return false;
    }
    *out = j[field].get<int64_t>();
    return true;
  };
  if (!get("layers", &t.layers)) return bad("layers");
  if (!get("slices", &t.slices) || t.slices < 1) return bad("slices");
  if (t.kind == CalibrateTask::Kind::kLayer) {
    if (!get("layer", &t.layer) || t.layer >= t.layers) return bad("layer");
    if (!get("slice", &t.slice) || t.slice >= t.slices) return bad("slice");
    if (!get("first_batch", &t.first_batch)) return bad("first_batch");
    if (!get("end_batch", &t.end_batch) || t.end_batch < t.first_batch) return bad("end_batch");
  }
  return t;
}

}  // namespace quantd::calibration
