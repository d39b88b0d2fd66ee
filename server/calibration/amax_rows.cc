#include "server/calibration/amax_rows.h"

#include <string>

#include "absl/strings/match.h"

namespace quantd::calibration {

std::vector<store::AmaxRow> ToAmaxRows(const AmaxTable& table) {
  std::vector<store::AmaxRow> rows;
  for (const auto& [module, e] : table.entries()) {
    rows.push_back({module, "input", e.amax, e.tokens});
    if (e.has_unweighted) {
      rows.push_back({module + kUnweightedSuffix, "input", e.unweighted_amax, e.tokens});
    }
  }
  return rows;
}

AmaxTable FromAmaxRows(const std::vector<store::AmaxRow>& rows) {
  std::map<std::string, AmaxEntry> entries;
  for (const store::AmaxRow& r : rows) {
    if (r.kind != "input") continue;
    if (absl::EndsWith(r.module, kUnweightedSuffix)) {
      AmaxEntry& e =
          entries[r.module.substr(0, r.module.size() - (sizeof(kUnweightedSuffix) - 1))];
      e.unweighted_amax = static_cast<float>(r.value);
      e.has_unweighted = true;
    } else {
      AmaxEntry& e = entries[r.module];
      e.amax = static_cast<float>(r.value);
      e.tokens = r.samples;
    }
  }
  AmaxTable table;
  for (const auto& [module, e] : entries) table.Put(module, e);
  return table;
}

}  // namespace quantd::calibration
