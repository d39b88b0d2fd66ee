#include "server/scheduler/evaluation_report.h"

#include <utility>

#include "server/base/status_macros.h"
#include "server/evaluation/quality_report.h"
#include "server/pipeline/stages/calibrate_stage.h"

namespace quantd::scheduler {
namespace {

evaluation::LayerQuality ToQuality(const store::EvaluationLayerRow& row) {
  evaluation::LayerQuality q;
  q.layer = row.layer;
  q.free_running = {row.free_running_signal, row.free_running_noise};
  q.teacher_forced = {row.teacher_forced_signal, row.teacher_forced_noise};
  return q;
}

// The LayerReport of `layer`, added in layer order when the report has none.
v1::LayerReport* LayerOf(int64_t layer, v1::JobReport* report) {
  auto* layers = report->mutable_layers();
  for (v1::LayerReport& l : *layers) {
    if (l.layer() == layer) return &l;
  }
  report->add_layers()->set_layer(layer);
  int i = layers->size() - 1;
  for (; i > 0 && layers->Get(i - 1).layer() > layer; --i) layers->SwapElements(i - 1, i);
  return layers->Mutable(i);
}

}  // namespace

void AddEvaluation(const std::vector<store::EvaluationLayerRow>& layers,
                   const std::optional<store::EvaluationRow>& figures, double calibration_seconds,
                   v1::JobReport* report) {
  evaluation::QualityReport quality;
  for (const store::EvaluationLayerRow& row : layers) {
    quality.layers.push_back(ToQuality(row));
    const evaluation::LayerQuality& q = quality.layers.back();
    v1::LayerReport* l = LayerOf(row.layer, report);
    l->set_evaluated(true);
    l->set_free_running_sqnr_db(q.free_running.Db());
    l->set_teacher_forced_sqnr_db(q.teacher_forced.Db());
  }
  if (!figures.has_value()) return;
  const store::EvaluationRow& f = *figures;
  v1::EvaluationReport* e = report->mutable_evaluation();
  e->set_samples(f.samples);
  e->set_tokens(f.tokens);
  e->set_numerics(f.numerics);
  e->set_positions(f.positions);
  e->set_mean_kl(f.mean_kl);
  e->set_p99_kl(f.p99_kl);
  e->set_max_kl(f.max_kl);
  e->set_top1_agreement(f.top1_agreement);
  e->set_source_ppl(f.source_ppl);
  e->set_quantized_ppl(f.quantized_ppl);
  e->set_ppl_ratio(f.ppl_ratio);
  e->set_gate_passed(f.gate_passed);
  e->set_gate_message(f.gate_message);
  for (int64_t layer : evaluation::WorstLayers(quality, kWorstEvaluatedLayers)) {
    e->add_worst_layers(layer);
  }
  e->set_seconds(f.seconds);
  e->set_calibration_seconds(calibration_seconds);
}

absl::Status AddStoredEvaluation(store::JobStore& store, int64_t job_id,
                                 v1::JobReport* report) {
  ASSIGN_OR_RETURN(const std::vector<store::EvaluationLayerRow> layers,
                   store.ListEvaluationLayers(job_id));
  ASSIGN_OR_RETURN(const std::optional<store::EvaluationRow> figures,
                   store.GetEvaluation(job_id));
  double calibration_seconds = 0;
  if (figures.has_value()) {
    ASSIGN_OR_RETURN(const std::vector<store::StageProgress> stages, store.Progress(job_id));
    calibration_seconds = pipeline::CalibrationSeconds(stages);
  }
  AddEvaluation(layers, figures, calibration_seconds, report);
  return absl::OkStatus();
}

}  // namespace quantd::scheduler
