#include "server/calibration/export_amax.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/atomic_file.h"

namespace quantd::calibration {
namespace {

constexpr const char* kProjections[] = {"w1", "w2", "w3"};

std::string ExpertModule(int64_t layer, int64_t expert, const char* projection) {
  return absl::StrCat("layers.", layer, ".ffn.experts.", expert, ".", projection);
}

bool Usable(float amax) { return std::isfinite(amax) && amax > 0.0f; }

// The exported amax of one recorded module.
float Choose(const AmaxEntry& e, job::W2Input w2_input) {
  if (!e.has_unweighted) return e.amax;
  switch (w2_input) {
    case job::W2Input::kUnweighted:
      return e.unweighted_amax;
    case job::W2Input::kWeighted:
      return e.amax;
    case job::W2Input::kMax:
      return std::max(e.amax, e.unweighted_amax);
  }
  return e.amax;
}

}  // namespace

absl::StatusOr<std::map<std::string, float>> ExportInputAmax(const AmaxTable& table,
                                                             const model::V4Config& config,
                                                             const job::CalibrationSpec& spec,
                                                             ExportReport* report) {
  std::map<std::string, float> out;
  for (const auto& [module, e] : table.entries()) out[module] = Choose(e, spec.w2_input);

  const int64_t layers = config.num_hidden_layers, experts = config.n_routed_experts;
  // Max over the calibrated experts per (layer, projection), and over the model per projection.
  std::vector<std::array<float, 3>> layer_max(static_cast<size_t>(layers), {0.0f, 0.0f, 0.0f});
  std::array<float, 3> model_max = {0.0f, 0.0f, 0.0f};
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t x = 0; x < experts; ++x) {
      for (int p = 0; p < 3; ++p) {
        auto it = out.find(ExpertModule(l, x, kProjections[p]));
        if (it == out.end() || !Usable(it->second)) continue;
        layer_max[l][p] = std::max(layer_max[l][p], it->second);
        model_max[p] = std::max(model_max[p], it->second);
      }
    }
  }
  if (layers > 0 && experts > 0 && !(Usable(model_max[0]) && Usable(model_max[1]) && Usable(model_max[2]))) {
    return absl::FailedPreconditionError(
        "no routed expert of the model received a calibration token for every projection; "
        "nothing to fill the others from");
  }
  for (int64_t l = 0; l < layers; ++l) {
    bool layer_filled_from_model = false;
    for (int64_t x = 0; x < experts; ++x) {
      for (int p = 0; p < 3; ++p) {
        const std::string module = ExpertModule(l, x, kProjections[p]);
        auto it = out.find(module);
        const bool calibrated = it != out.end() && Usable(it->second);
        float fill = layer_max[l][p];
        if (spec.uncalibrated == job::UncalibratedFill::kModelMax || !Usable(fill)) {
          layer_filled_from_model |= !Usable(fill);
          fill = model_max[p];
        }
        if (!calibrated) report->filled.push_back(module);
        float& value = out[module];
        if (spec.expert_amax == job::ExpertAmax::kLayerMax) {
          value = Usable(layer_max[l][p]) ? layer_max[l][p] : model_max[p];
        } else if (!calibrated) {
          value = fill;
        }
      }
      // w1 and w3 share one input (and TensorRT-LLM asserts equal scales).
      float& w1 = out[ExpertModule(l, x, "w1")];
      float& w3 = out[ExpertModule(l, x, "w3")];
      w1 = w3 = std::max(w1, w3);
    }
    if (layer_filled_from_model) report->layers_without_experts.push_back(l);
  }
  for (const auto& [module, amax] : out) {
    if (!Usable(amax)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the calibrated input amax of ", module, " is ", amax, "; it must be finite and > 0"));
    }
  }
  return out;
}

std::map<std::string, float> ConstantInputAmax(const checkpoint::TensorInventory& inventory) {
  std::map<std::string, float> out;
  for (const checkpoint::LinearModule& m : inventory.linears) {
    out[m.name] = formats::kNvfp4AmaxDivisor;
  }
  return out;
}

absl::Status WriteAmaxFile(const std::string& path, const std::map<std::string, float>& exported,
                           const AmaxTable& table) {
  return checkpoint::WriteFileAtomically(path, AmaxFileText(exported, table));
}

std::string AmaxFileText(const std::map<std::string, float>& exported, const AmaxTable& table) {
  std::map<std::string, float> rows = exported;
  for (const auto& [module, e] : table.entries()) {
    if (!e.has_unweighted) continue;
    rows[module + ".unweighted"] = e.unweighted_amax;
    rows[module + ".weighted"] = e.amax;
  }
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [module, amax] : rows) j[module] = static_cast<double>(amax);
  return j.dump(1) + "\n";
}

}  // namespace quantd::calibration
