#include "server/evaluation/evaluate_task.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace quantd::evaluation {
namespace {

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
  j["samples"] = t.samples;
  j["tokens"] = t.tokens;
  return j.dump();
}

absl::StatusOr<EvaluateTask> ParseEvaluateTask(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto bad = [](const char* field) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluate task payload: ", field, " is missing or not valid"));
  };
  if (!j.is_object() || !j.contains("kind") || !j["kind"].is_string()) return bad("kind");
  EvaluateTask t;
  const std::string kind = j["kind"].get<std::string>();
  int k = 0;
  while (k < kKinds && kind != kKindNames[k]) ++k;
  if (k == kKinds) return bad("kind");
  t.kind = static_cast<EvaluateTask::Kind>(k);
  const auto get = [&j](const char* field, int64_t* out) {
    if (!j.contains(field) || !j[field].is_number_integer() || j[field].get<int64_t>() < 0) {
      return false;
    }
    *out = j[field].get<int64_t>();
    return true;
  };
  if (!get("layers", &t.layers) || t.layers < 1) return bad("layers");
  if (!get("samples", &t.samples) || t.samples < 1) return bad("samples");
  if (!get("tokens", &t.tokens)) return bad("tokens");
  if (t.kind == EvaluateTask::Kind::kLayer && (!get("layer", &t.layer) || t.layer >= t.layers)) {
    return bad("layer");
  }
  return t;
}

}  // namespace quantd::evaluation
