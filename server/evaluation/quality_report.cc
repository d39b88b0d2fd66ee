#include "server/evaluation/quality_report.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace quantd::evaluation {
namespace {

nlohmann::json DbJson(const Sqnr& s) {
  const double db = s.Db();
  return std::isfinite(db) ? nlohmann::json(db) : nlohmann::json(nullptr);
}

std::string DbText(const Sqnr& s) {
  const double db = s.Db();
  if (std::isfinite(db)) return absl::StrFormat("%8.2f", db);
  return db > 0 ? "inf" : "-inf";
}

}  // namespace

std::vector<int64_t> WorstLayers(const QualityReport& report, size_t n) {
  std::vector<std::pair<double, int64_t>> finite;
  for (const LayerQuality& l : report.layers) {
    const double db = l.teacher_forced.Db();
    if (std::isfinite(db)) finite.emplace_back(db, l.layer);
  }
  std::sort(finite.begin(), finite.end());
  std::vector<int64_t> worst;
  for (size_t i = 0; i < finite.size() && i < n; ++i) worst.push_back(finite[i].second);
  return worst;
}

int64_t WorstLayer(const QualityReport& report) {
  const std::vector<int64_t> worst = WorstLayers(report, 1);
  return worst.empty() ? -1 : worst.front();
}

nlohmann::json QualityReportToJson(const QualityReport& r) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerQuality& l : r.layers) {
    layers.push_back({{"layer", l.layer},
                      {"free_running_sqnr_db", DbJson(l.free_running)},
                      {"teacher_forced_sqnr_db", DbJson(l.teacher_forced)},
                      {"load_seconds", l.load_seconds},
                      {"decode_seconds", l.decode_seconds},
                      {"forward_seconds", l.forward_seconds}});
  }
  const NextTokenQuality& n = r.next_token;
  return {{"source", r.source},
          {"quantized", r.quantized},
          {"numerics", r.numerics},
          {"samples", r.samples},
          {"tokens", r.tokens},
          {"seconds", r.seconds},
          {"layers", std::move(layers)},
          {"worst_layer", WorstLayer(r)},
          {"next_token",
           {{"positions", n.positions},
            {"predicted", n.predicted},
            {"mean_kl", n.mean_kl},
            {"p99_kl", n.p99_kl},
            {"max_kl", n.max_kl},
            {"top1_agreement", n.top1_agreement},
            {"source_ppl", n.source_ppl},
            {"quantized_ppl", n.quantized_ppl},
            {"ppl_ratio", n.ppl_ratio}}}};
}

std::string FormatQualityReport(const QualityReport& r) {
  std::string out = absl::StrFormat(
      "evaluated %s against %s on %d held-out samples (%d tokens), %s numerics, in %.2f s\n"
      "layer  SQNR dB free-running  teacher-forced\n",
      r.quantized, r.source, r.samples, r.tokens, r.numerics, r.seconds);
  for (const LayerQuality& l : r.layers) {
    absl::StrAppend(&out, absl::StrFormat("%5d  %20s  %14s\n", l.layer, DbText(l.free_running),
                                          DbText(l.teacher_forced)));
  }
  const NextTokenQuality& n = r.next_token;
  absl::StrAppend(
      &out,
      absl::StrFormat("next token over %d positions: KL mean %.6g, p99 %.6g, max %.6g nats; "
                      "top-1 agreement %.4f\n"
                      "perplexity over %d predictions: source %.4f, quantized %.4f, ratio %.6f\n",
                      n.positions, n.mean_kl, n.p99_kl, n.max_kl, n.top1_agreement, n.predicted,
                      n.source_ppl, n.quantized_ppl, n.ppl_ratio));
  if (const int64_t worst = WorstLayer(r); worst >= 0) {
    absl::StrAppend(&out, absl::StrFormat("lowest teacher-forced SQNR: layer %d\n", worst));
  }
  return out;
}

}  // namespace quantd::evaluation
