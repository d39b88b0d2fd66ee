#include "client/report_view.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/table.h"

namespace quantd::client {
namespace {

std::string Amax(double value) { return absl::StrFormat("%.4g", value); }

// The calibration section: one table row per projection, the layer's figures on its first row.
std::string FormatLayers(const v1::JobReport& r) {
  // A layer may carry only evaluation figures.
  const bool any = std::any_of(r.layers().begin(), r.layers().end(),
                               [](const v1::LayerReport& l) { return l.projections_size() > 0; });
  if (!any) return "\ncalibration: no input amax recorded\n";
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

// "inf" for +inf (identical hidden states), else two decimals.
std::string Decibels(double db) {
  return std::isinf(db) && db > 0 ? std::string("inf") : absl::StrFormat("%.2f", db);
}

// One block character per value, ▁ at the lowest finite value to █ at the highest; +inf draws █
// and so does a curve whose finite values are all equal.
std::string Sparkline(const std::vector<double>& values) {
  static constexpr const char* kBlocks[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
  double lo = std::numeric_limits<double>::infinity();
  double hi = -lo;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  std::string out;
  for (double v : values) {
    int level = 7;
    if (std::isfinite(v) && hi > lo) {
      level = static_cast<int>(std::lround((v - lo) / (hi - lo) * 7));
    }
    if (std::isnan(v) || (std::isinf(v) && v < 0)) level = 0;
    out += kBlocks[level];
  }
  return out;
}

// A relative difference in percent; "inf" for +inf.
std::string Percent(double fraction) {
  return std::isinf(fraction) ? std::string("inf") : absl::StrFormat("%.2f %%", 100 * fraction);
}

// The official-vs-math section: the job's largest relative amax difference and each layer's.
std::string FormatNumericsComparison(const v1::JobReport& r) {
  if (r.numerics_peer_job() == 0) return "";
  std::string out = absl::StrCat(
      "\nnumerics: input amax against job ", r.numerics_peer_job(), " (", r.numerics_peer(),
      "), same source and calibration data\n  max |a_official - a_math| / a_math ",
      Percent(r.numerics_max_rel_diff()), " at ", r.numerics_max_rel_diff_module(), " over ",
      r.numerics_compared_modules(), " modules\n");
  std::vector<std::vector<std::string>> rows = {{"LAYER", "MODULES", "MAX REL DIFF", "AT"}};
  for (const v1::LayerReport& layer : r.layers()) {
    if (!layer.numerics_compared()) continue;
    rows.push_back({absl::StrCat(layer.layer()), absl::StrCat(layer.numerics_compared_modules()),
                    Percent(layer.numerics_max_rel_diff()), layer.numerics_max_rel_diff_module()});
  }
  if (rows.size() > 1) absl::StrAppend(&out, FormatTable(rows, "lrrl"));
  return out;
}

// The evaluate stage's section: the figures, the per-layer SQNR table (with a sparkline of the
// teacher-forced curve on a terminal) and the layers that lose the most.
std::string FormatEvaluation(const v1::JobReport& r, bool terminal) {
  if (!r.has_evaluation()) return "";
  const v1::EvaluationReport& e = r.evaluation();
  std::string out = absl::StrCat("\nevaluation: ", e.samples(), " held-out samples, ", e.tokens(),
                                 " tokens, ", e.positions(), " positions compared (", e.numerics(),
                                 " numerics)\n");
  absl::StrAppend(&out, absl::StrFormat(
                            "  KL(source || quantized)  mean %.4g  p99 %.4g  max %.4g nats\n",
                            e.mean_kl(), e.p99_kl(), e.max_kl()));
  absl::StrAppend(&out, absl::StrFormat("  top-1 agreement          %.2f %%\n",
                                        100 * e.top1_agreement()));
  absl::StrAppend(&out, absl::StrFormat("  perplexity               %.4g → %.4g  (ratio %.4f)\n",
                                        e.source_ppl(), e.quantized_ppl(), e.ppl_ratio()));
  absl::StrAppend(&out, "  gate                     ", e.gate_passed() ? "PASSED" : "FAILED");
  if (!e.gate_message().empty()) absl::StrAppend(&out, ": ", e.gate_message());
  absl::StrAppend(&out, "\n", absl::StrFormat("  stage time               %.1f s", e.seconds()));
  if (e.calibration_seconds() > 0) {
    absl::StrAppend(&out,
                    absl::StrFormat(", %.1f× calibration", e.seconds() / e.calibration_seconds()));
  }
  absl::StrAppend(&out, "\n");
  std::vector<std::vector<std::string>> rows = {{"LAYER", "FREE-RUNNING dB", "TEACHER-FORCED dB"}};
  std::vector<double> forced;
  std::map<int64_t, double> forced_by_layer;
  for (const v1::LayerReport& layer : r.layers()) {
    if (!layer.evaluated()) continue;
    rows.push_back({absl::StrCat(layer.layer()), Decibels(layer.free_running_sqnr_db()),
                    Decibels(layer.teacher_forced_sqnr_db())});
    forced.push_back(layer.teacher_forced_sqnr_db());
    forced_by_layer[layer.layer()] = layer.teacher_forced_sqnr_db();
  }
  if (forced.empty()) return out;
  absl::StrAppend(&out, "\nhidden-state SQNR per layer, quantized against source\n",
                  FormatTable(rows, "lrr"));
  if (terminal) absl::StrAppend(&out, "teacher-forced  ", Sparkline(forced), "\n");
  if (e.worst_layers_size() > 0) {
    std::vector<std::string> worst;
    for (int64_t layer : e.worst_layers()) {
      const auto it = forced_by_layer.find(layer);
      worst.push_back(it == forced_by_layer.end()
                          ? absl::StrCat(layer)
                          : absl::StrCat(layer, " (", Decibels(it->second), " dB)"));
    }
    absl::StrAppend(&out, "layers that lose the most: ", absl::StrJoin(worst, ", "), "\n");
  }
  return out;
}

// A runner as quantctl shows it: the remote worker's name, "local" for the daemon itself.
std::string RunnerName(const std::string& worker) { return worker.empty() ? "local" : worker; }

// Who ran each task, when a remote worker ran at least one of them (a job this quantd ran alone
// has nothing to tell apart).
std::string FormatTaskRuns(const v1::JobReport& r) {
  const bool remote = std::any_of(r.tasks().begin(), r.tasks().end(),
                                  [](const v1::TaskRun& t) { return !t.worker().empty(); });
  if (!remote) return "";
  std::vector<std::vector<std::string>> rows = {{"STAGE", "TASK", "ATTEMPT", "RESULT", "RAN BY"}};
  for (const v1::TaskRun& t : r.tasks()) {
    rows.push_back(
        {t.stage(), t.label().empty() ? t.name() : absl::StrCat(t.name(), " (", t.label(), ")"),
         absl::StrCat(t.attempt()), t.done() ? "done" : "failed", RunnerName(t.worker())});
  }
  return absl::StrCat("\ntasks: who ran them (local: this quantd)\n", FormatTable(rows, "llrll"));
}

}  // namespace

std::string FormatReport(const v1::JobReport& r, bool terminal) {
  std::string out = absl::StrCat("job ", r.job_id(), " ", v1::JobState_Name(r.state()));
  if (r.tensors_total() == 0) {
    absl::StrAppend(&out, "  no tensor statistics yet\n");
  } else {
    absl::StrAppend(&out, absl::StrFormat("  %d tensors  min SQNR %.2f dB  mean SQNR %.2f dB\n",
                                          r.tensors_total(), r.min_sqnr_db(), r.mean_sqnr_db()));
  }
  if (r.modules_without_statistics() > 0) {
    absl::StrAppend(&out, "  ", r.modules_without_statistics(),
                    " modules without statistics (quantized by an earlier release): their SQNR "
                    "is not in these figures\n");
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
  absl::StrAppend(&out, FormatNumericsComparison(r));
  absl::StrAppend(&out, FormatEvaluation(r, terminal));
  absl::StrAppend(&out, FormatTaskRuns(r));
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
