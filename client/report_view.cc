#include "client/report_view.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/table.h"

namespace quantd::client {
namespace {

std::string Amax(double value) { return absl::StrFormat("%.4g", value); }

// The calibration section: one table row per projection, the layer's figures on its first row.
std::string FormatLayers(const v1::JobReport& r) {
  if (r.layers_size() == 0) return "\ncalibration: no input amax recorded\n";
  std::vector<std::vector<std::string>> rows = {
      {"LAYER", "TOKENS", "UNCALIBRATED", "PROJECTION", "MIN", "MEDIAN", "MAX"}};
  for (const v1::LayerReport& layer : r.layers()) {
    std::vector<std::string> first = {
        absl::StrCat(layer.layer()),
        layer.token_counts() ? absl::StrCat(layer.calibrated_tokens()) : "-",
        layer.routed_experts() > 0
            ? absl::StrCat(layer.uncalibrated_experts(), " of ", layer.routed_experts())
            : "-"};
    for (int i = 0; i < layer.projections_size(); ++i) {
      const v1::ProjectionAmax& p = layer.projections(i);
      std::vector<std::string> row = i == 0 ? first : std::vector<std::string>{"", "", ""};
      const bool routed = absl::StartsWith(p.projection(), "ffn.experts.");
      row.insert(row.end(), {p.projection(), routed ? Amax(p.min_amax()) : "",
                             routed ? Amax(p.median_amax()) : "", Amax(p.max_amax())});
      rows.push_back(std::move(row));
    }
  }
  return absl::StrCat(
      "\ncalibration: input amax per decoder layer (routed experts: min / median / max)\n",
      FormatTable(rows, "lrllrrr"));
}

}  // namespace

std::string FormatReport(const v1::JobReport& r) {
  std::string out = absl::StrCat("job ", r.job_id(), " ", v1::JobState_Name(r.state()));
  if (r.tensors_total() == 0) {
    absl::StrAppend(&out, "  no tensor statistics yet\n");
  } else {
    absl::StrAppend(&out, absl::StrFormat("  %d tensors  min SQNR %.2f dB  mean SQNR %.2f dB\n",
                                          r.tensors_total(), r.min_sqnr_db(), r.mean_sqnr_db()));
  }
  if (r.tensors_size() > 0) {
    std::vector<std::vector<std::string>> rows = {{"TENSOR", "REL RMSE", "SQNR dB", "MAX ABS ERR"}};
    for (const v1::TensorStats& t : r.tensors()) {
      rows.push_back({t.tensor(), absl::StrFormat("%.4g", t.rel_rmse()),
                      absl::StrFormat("%.2f", t.sqnr_db()),
                      absl::StrFormat("%.4g", t.max_abs_err())});
    }
    absl::StrAppend(&out, "\n", FormatTable(rows, "lrrr"));
  }
  absl::StrAppend(&out, FormatLayers(r));
  if (r.rules_size() == 0) {
    absl::StrAppend(&out, "\nrule checks: none yet (verify has not run)\n");
    return out;
  }
  int passed = 0;
  for (const v1::RuleCheck& c : r.rules()) passed += c.passed() ? 1 : 0;
  absl::StrAppend(&out, "\nrule checks: ", passed, " of ", r.rules_size(), " passed\n");
  for (const v1::RuleCheck& c : r.rules()) {
    absl::StrAppend(&out, "  ", c.passed() ? "PASS" : "FAIL", "  ", c.name(), "\n");
    if (c.message().empty()) continue;
    for (absl::string_view line : absl::StrSplit(c.message(), '\n', absl::SkipEmpty())) {
      absl::StrAppend(&out, "        ", line, "\n");
    }
  }
  return out;
}

}  // namespace quantd::client
