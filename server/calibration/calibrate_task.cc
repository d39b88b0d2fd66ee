#include "server/calibration/calibrate_task.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/json_file.h"

namespace quantd::calibration {
namespace {

using checkpoint::GetCount;
using checkpoint::GetName;

constexpr const char* kKindNames[] = {"tokens", "layer", "amax_out"};
constexpr int kKinds = 3;

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
  }
  return j.dump();
}

absl::StatusOr<CalibrateTask> ParseCalibrateTask(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto bad = [](const char* field) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibrate task payload: ", field, " is missing or not valid"));
  };
  CalibrateTask t;
  int kind = 0;
  if (!GetName(j, "kind", kKindNames, kKinds, &kind)) return bad("kind");
  t.kind = static_cast<CalibrateTask::Kind>(kind);
  if (!GetCount(j, "layers", &t.layers)) return bad("layers");
  if (!GetCount(j, "slices", &t.slices) || t.slices < 1) return bad("slices");
  if (t.kind == CalibrateTask::Kind::kLayer) {
    if (!GetCount(j, "layer", &t.layer) || t.layer >= t.layers) return bad("layer");
    if (!GetCount(j, "slice", &t.slice) || t.slice >= t.slices) return bad("slice");
  }
  return t;
}

}  // namespace quantd::calibration
