#include "server/evaluation/evaluate_task.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/json_file.h"

namespace quantd::evaluation {
namespace {

using checkpoint::GetCount;
using checkpoint::GetName;

constexpr const char* kKindNames[] = {"layer", "head", "gate"};
constexpr int kKinds = 3;

}  // namespace

std::string EvaluateTask::Name() const {
  return kind == Kind::kLayer ? absl::StrCat("layer", layer) : kKindNames[static_cast<int>(kind)];
}

std::string ToJson(const EvaluateTask& t) {
  nlohmann::ordered_json j;
  j["kind"] = kKindNames[static_cast<int>(t.kind)];
  if (t.kind == EvaluateTask::Kind::kLayer) j["layer"] = t.layer;
  j["layers"] = t.layers;
  j["max_samples"] = t.max_samples;
  j["max_tokens"] = t.max_tokens;
  return j.dump();
}

absl::StatusOr<EvaluateTask> ParseEvaluateTask(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto bad = [](const char* field) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluate task payload: ", field, " is missing or not valid"));
  };
  EvaluateTask t;
  int kind = 0;
  if (!GetName(j, "kind", kKindNames, kKinds, &kind)) return bad("kind");
  t.kind = static_cast<EvaluateTask::Kind>(kind);
  if (!GetCount(j, "layers", &t.layers) || t.layers < 1) return bad("layers");
  if (!GetCount(j, "max_samples", &t.max_samples) || t.max_samples < 1) {
    return bad("max_samples");
  }
  if (!GetCount(j, "max_tokens", &t.max_tokens)) return bad("max_tokens");
  if (t.kind == EvaluateTask::Kind::kLayer &&
      (!GetCount(j, "layer", &t.layer) || t.layer >= t.layers)) {
    return bad("layer");
  }
  return t;
}

}  // namespace quantd::evaluation
