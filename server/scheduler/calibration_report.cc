#include "server/scheduler/calibration_report.h"

#include <stdint.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stages/quantize_stage.h"

namespace quantd::scheduler {
namespace {

constexpr absl::string_view kLayerPrefix = "layers.";
constexpr absl::string_view kRoutedPrefix = "ffn.experts.";

// Splits "<number>.<rest>" off the front of `text`; nullopt unless it starts so.
std::optional<std::pair<int64_t, absl::string_view>> LeadingNumber(absl::string_view text) {
  const size_t dot = text.find('.');
  if (dot == 0 || dot == absl::string_view::npos || dot + 1 == text.size()) return std::nullopt;
  const absl::string_view digits = text.substr(0, dot);
  if (!std::all_of(digits.begin(), digits.end(),
                   [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); })) {
    return std::nullopt;
  }
  int64_t n = 0;
  if (!absl::SimpleAtoi(digits, &n)) return std::nullopt;
  return std::make_pair(n, text.substr(dot + 1));
}

// expert_tokens of a routed expert the plan quantizes that has no amax row.
constexpr int64_t kNoRow = -1;

// What the rows of one decoder layer add up to.
struct LayerRows {
  std::map<std::string, std::vector<double>> amax;  // projection -> its values
  // routed expert -> most tokens of its rows, or kNoRow
  std::map<int64_t, int64_t> expert_tokens;
  int64_t tokens = 0;                               // most tokens of a non-routed module
  bool token_counts = false;                        // some row counts tokens
};

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// A routed expert's index and projection ("w1") from the rest of a module's name; nullopt for
// any other module.
std::optional<std::pair<int64_t, absl::string_view>> SplitExpert(absl::string_view rest) {
  if (!absl::StartsWith(rest, kRoutedPrefix)) return std::nullopt;
  return LeadingNumber(rest.substr(kRoutedPrefix.size()));
}

}  // namespace

std::optional<std::pair<int64_t, absl::string_view>> LayerOfModule(absl::string_view module) {
  if (!absl::StartsWith(module, kLayerPrefix)) return std::nullopt;
  return LeadingNumber(module.substr(kLayerPrefix.size()));
}

void AddLayerCalibration(const std::vector<store::AmaxRow>& amax,
                         const std::vector<store::TaskRow>& tasks, v1::JobReport* report) {
  std::map<int64_t, LayerRows> layers;
  for (const store::AmaxRow& row : amax) {
    if (row.kind != "input") continue;
    const auto layer = LayerOfModule(row.module);
    if (!layer.has_value()) continue;
    LayerRows& l = layers[layer->first];
    const absl::string_view rest = layer->second;
    l.token_counts = l.token_counts || row.samples > 0;
    if (const auto expert = SplitExpert(rest); expert.has_value()) {
      l.amax[absl::StrCat(kRoutedPrefix, expert->second)].push_back(row.value);
      int64_t& tokens = l.expert_tokens.try_emplace(expert->first, 0).first->second;
      tokens = std::max(tokens, row.samples);
    } else {
      l.amax[std::string(rest)].push_back(row.value);
      l.tokens = std::max(l.tokens, row.samples);
    }
  }
  // The routed experts the plan quantizes but no row names: their amax is filled in at export.
  for (const store::TaskRow& task : tasks) {
    if (task.stage_kind != pipeline::QuantizeStage::kKind) continue;
    absl::StatusOr<pipeline::ShardTask> shard = pipeline::ParseShardTask(task.payload_json);
    if (!shard.ok()) continue;  // the stage itself reports a payload it cannot read
    for (const std::string& module : shard->modules) {
      const auto layer = LayerOfModule(module);
      if (!layer.has_value()) continue;
      const auto expert = SplitExpert(layer->second);
      auto l = layers.find(layer->first);
      if (!expert.has_value() || l == layers.end()) continue;
      l->second.expert_tokens.try_emplace(expert->first, kNoRow);
    }
  }
  for (const auto& [index, l] : layers) {
    v1::LayerReport* out = report->add_layers();
    out->set_layer(index);
    for (const auto& [projection, values] : l.amax) {
      v1::ProjectionAmax* p = out->add_projections();
      p->set_projection(projection);
      p->set_modules(static_cast<int64_t>(values.size()));
      p->set_min_amax(*std::min_element(values.begin(), values.end()));
      p->set_median_amax(Median(values));
      p->set_max_amax(*std::max_element(values.begin(), values.end()));
    }
    out->set_token_counts(l.token_counts);
    out->set_calibrated_tokens(l.tokens);
    out->set_routed_experts(static_cast<int64_t>(l.expert_tokens.size()));
    const bool token_counts = l.token_counts;
    out->set_uncalibrated_experts(
        std::count_if(l.expert_tokens.begin(), l.expert_tokens.end(), [&](const auto& e) {
          return e.second == kNoRow || (token_counts && e.second == 0);
        }));
  }
}

}  // namespace quantd::scheduler
