#include "server/calibration/amax_table.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace quantd::calibration {
namespace {

constexpr char kFormat[] = "quantd-amax-table/1";

bool ValidAmax(const nlohmann::json& v) {
  if (!v.is_number()) return false;
  const double d = v.get<double>();
  return std::isfinite(d) && d >= 0.0 && d <= 3.4028234663852886e38 &&
         static_cast<double>(static_cast<float>(d)) == d;
}

}  // namespace

void AmaxTable::Record(const std::string& module, float amax, int64_t rows) {
  AmaxEntry& e = entries_[module];
  e.amax = std::max(e.amax, amax);
  e.tokens += rows;
}

void AmaxTable::RecordW2(const std::string& module, float weighted_amax, float unweighted_amax,
                         int64_t rows) {
  AmaxEntry& e = entries_[module];
  e.amax = std::max(e.amax, weighted_amax);
  e.unweighted_amax = std::max(e.unweighted_amax, unweighted_amax);
  e.has_unweighted = true;
  e.tokens += rows;
}

absl::Status AmaxTable::Merge(const AmaxTable& other) {
  if (other.slices_.empty()) {
    return absl::InvalidArgumentError("an amax table to merge must name its slices");
  }
  size_t present = 0;
  for (const std::string& s : other.slices_) present += slices_.count(s);
  if (present == other.slices_.size()) return absl::OkStatus();
  if (present != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "amax tables overlap in ", present, " of ", other.slices_.size(),
        " slices; merging them would count those tokens twice"));
  }
  for (const auto& [module, o] : other.entries_) {
    AmaxEntry& e = entries_[module];
    e.amax = std::max(e.amax, o.amax);
    e.unweighted_amax = std::max(e.unweighted_amax, o.unweighted_amax);
    e.has_unweighted = e.has_unweighted || o.has_unweighted;
    e.tokens += o.tokens;
  }
  slices_.insert(other.slices_.begin(), other.slices_.end());
  return absl::OkStatus();
}

std::string AmaxTable::Serialize() const {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  j["format"] = kFormat;
  j["slices"] = nlohmann::ordered_json::array();
  for (const std::string& s : slices_) j["slices"].push_back(s);
  nlohmann::ordered_json modules = nlohmann::ordered_json::object();
  for (const auto& [module, e] : entries_) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    m["amax"] = static_cast<double>(e.amax);
    m["tokens"] = e.tokens;
    if (e.has_unweighted) m["unweighted_amax"] = static_cast<double>(e.unweighted_amax);
    modules[module] = std::move(m);
  }
  j["modules"] = std::move(modules);
  return j.dump(1) + "\n";
}

absl::StatusOr<AmaxTable> AmaxTable::Parse(const std::string& text, const std::string& origin) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormat) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": not a ", kFormat, " table"));
  }
  AmaxTable table;
  const nlohmann::json& slices = j.value("slices", nlohmann::json());
  const nlohmann::json& modules = j.value("modules", nlohmann::json());
  if (!slices.is_array() || !modules.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": expected \"slices\" (array) and \"modules\" (object)"));
  }
  for (const nlohmann::json& s : slices) {
    if (!s.is_string()) return absl::InvalidArgumentError(absl::StrCat(origin, ": slices[] must be strings"));
    table.slices_.insert(s.get<std::string>());
  }
  for (const auto& [module, m] : modules.items()) {
    const std::string where = absl::StrCat(origin, ": module ", module);
    if (!m.is_object() || !m.contains("amax") || !m.contains("tokens") ||
        !ValidAmax(m["amax"]) || !m["tokens"].is_number_integer() ||
        m["tokens"].get<int64_t>() < 0 ||
        (m.contains("unweighted_amax") && !ValidAmax(m["unweighted_amax"])) ||
        m.size() != (m.contains("unweighted_amax") ? 3u : 2u)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": expected {\"amax\": float32 >= 0, \"tokens\": N >= 0[, \"unweighted_amax\"]}"));
    }
    AmaxEntry e;
    e.amax = m["amax"].get<float>();
    e.tokens = m["tokens"].get<int64_t>();
    e.has_unweighted = m.contains("unweighted_amax");
    if (e.has_unweighted) e.unweighted_amax = m["unweighted_amax"].get<float>();
    table.entries_[module] = e;
  }
  return table;
}

bool AmaxTable::operator==(const AmaxTable& other) const {
  if (slices_ != other.slices_ || entries_.size() != other.entries_.size()) return false;
  for (const auto& [module, e] : entries_) {
    auto it = other.entries_.find(module);
    if (it == other.entries_.end()) return false;
    const AmaxEntry& o = it->second;
    if (e.amax != o.amax || e.unweighted_amax != o.unweighted_amax || e.tokens != o.tokens ||
        e.has_unweighted != o.has_unweighted) {
      return false;
    }
  }
  return true;
}

}  // namespace quantd::calibration
