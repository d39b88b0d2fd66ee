#include "server/pipeline/stages/input_scales.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/formats.h"

namespace quantd::pipeline {
namespace {

// Where a routed expert's fill value comes from: its layer ("layers.3.ffn") and projection.
using FillKey = std::pair<std::string, std::string>;

// `<layer>.experts.<E>.<leaf>` with a gate/up or down leaf -> (layer, "gate_up" | "down").
std::optional<FillKey> RoutedExpertKey(const std::string& module) {
  const size_t leaf_dot = module.rfind('.');
  if (leaf_dot == std::string::npos) return std::nullopt;
  const std::string leaf = module.substr(leaf_dot + 1);
  std::string projection;
  if (leaf == "w1" || leaf == "w3" || leaf == "gate_proj" || leaf == "up_proj") {
    projection = "gate_up";
  } else if (leaf == "w2" || leaf == "down_proj") {
    projection = "down";
  } else {
    return std::nullopt;
  }
  const size_t id_dot = module.rfind('.', leaf_dot - 1);
  if (id_dot == std::string::npos || id_dot + 1 == leaf_dot) return std::nullopt;
  for (size_t i = id_dot + 1; i < leaf_dot; ++i) {
    if (!absl::ascii_isdigit(module[i])) return std::nullopt;
  }
  const std::string parent = module.substr(0, id_dot);
  constexpr char kExperts[] = ".experts";  // not "shared_experts"
  if (!absl::EndsWith(parent, kExperts)) return std::nullopt;
  return FillKey{parent.substr(0, parent.size() - (sizeof(kExperts) - 1)), projection};
}

absl::Status CheckAmax(const std::string& module, float amax) {
  if (formats::IsFinite(amax) && amax > 0.0f) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("input amax of module ", module, " is ", amax,
                                                 "; it must be finite and positive"));
}

// Max amax per (layer, projection) over every routed expert row of the table.
absl::StatusOr<std::map<FillKey, float>> LayerMaxima(const std::map<std::string, float>* amax) {
  std::map<FillKey, float> maxima;
  if (amax == nullptr) return maxima;
  for (const auto& [module, value] : *amax) {
    std::optional<FillKey> key = RoutedExpertKey(module);
    if (!key.has_value()) continue;
    if (absl::Status s = CheckAmax(module, value); !s.ok()) return s;
    float& m = maxima[*key];
    m = std::max(m, value);
  }
  return maxima;
}

}  // namespace

absl::StatusOr<InputScales> ResolveInputScales(const ShardTask& task,
                                               const std::map<std::string, float>* amax) {
  InputScales out;
  std::map<std::string, float> module_amax;
  std::optional<std::map<FillKey, float>> maxima;  // computed on the first missing expert
  for (const std::string& module : task.modules) {
    if (amax != nullptr) {
      auto it = amax->find(module);
      if (it != amax->end()) {
        if (absl::Status s = CheckAmax(module, it->second); !s.ok()) return s;
        module_amax[module] = it->second;
        continue;
      }
    }
    const std::string missing = absl::StrCat("module ", module, " has no calibrated input amax",
                                             amax == nullptr ? " (no amax table was given)" : "");
    std::optional<FillKey> key = RoutedExpertKey(module);
    if (!key.has_value()) return absl::InvalidArgumentError(missing);
    if (!maxima.has_value()) {
      absl::StatusOr<std::map<FillKey, float>> m = LayerMaxima(amax);
      if (!m.ok()) return m.status();
      maxima = std::move(*m);
    }
    auto fill = maxima->find(*key);
    if (fill == maxima->end()) {
      return absl::InvalidArgumentError(absl::StrCat(missing, ", and no expert of ", key->first,
                                                     " has one for its ", key->second,
                                                     " projection to fill it from"));
    }
    module_amax[module] = fill->second;
    out.filled.push_back(module);
  }

  std::map<std::string, float> shared = module_amax;
  for (const std::vector<std::string>& group : task.fusion_groups) {
    float m = 0.0f;
    for (const std::string& member : group) {
      auto it = module_amax.find(member);
      if (it == module_amax.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("fusion group member ", member, " is not a module of task ", task.shard));
      }
      m = std::max(m, it->second);
    }
    for (const std::string& member : group) shared[member] = m;
  }
  for (const auto& [module, a] : shared) out.scale[module] = a / formats::kNvfp4AmaxDivisor;
  return out;
}

}  // namespace quantd::pipeline
