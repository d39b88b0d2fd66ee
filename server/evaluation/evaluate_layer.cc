#include "server/evaluation/evaluate_layer.h"

#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/model/v4_layer.h"

namespace quantd::evaluation {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

absl::Status InLayer(const absl::Status& s, const model::V4Checkpoint& ckpt, int64_t layer) {
  return absl::Status(s.code(),
                      absl::StrCat(ckpt.dir->dir(), ": layer ", layer, ": ", s.message()));
}

calibration::BatchActivations InHost(model::V4Activations acts) {
  calibration::BatchActivations b;
  b.tokens = acts.tokens();
  b.host = std::move(acts);
  return b;
}

}  // namespace

absl::StatusOr<LayerEvaluation> EvaluateLayer(const model::V4Checkpoint& source,
                                              const model::V4Checkpoint& quantized, int64_t layer,
                                              const EvaluationBatches& input,
                                              compute::Device& device, model::Numerics numerics,
                                              const EvaluationHooks& hooks) {
  RETURN_IF_ERROR(CheckPaired(input, absl::StrCat("layer ", layer, " input").c_str()));
  LayerEvaluation result;
  LayerQuality& q = result.quality;
  q.layer = layer;
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<model::V4LayerWeights> ref =
      model::LoadLayer(source, layer, device, hooks.alive);
  if (!ref.ok()) return InLayer(ref.status(), source, layer);
  absl::StatusOr<model::V4LayerWeights> quant =
      model::LoadLayer(quantized, layer, device, hooks.alive);
  if (!quant.ok()) return InLayer(quant.status(), quantized, layer);
  q.load_seconds = SecondsSince(start);

  start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(model::ForwardContext ctx,
                   model::MakeForwardContext(device, numerics, /*observer=*/nullptr));
  ctx.alive = hooks.alive;
  ctx.decode_seconds = &q.decode_seconds;
  for (size_t i = 0; i < input.source->size(); ++i) {
    if (hooks.cancelled != nullptr && hooks.cancelled->load()) {
      return absl::CancelledError(absl::StrCat("layer ", layer, ": evaluation cancelled"));
    }
    const model::V4Activations& in_source = (*input.source)[i].host;
    const model::V4Activations& in_quantized = (*input.quantized)[i].host;
    absl::StatusOr<model::V4Activations> out =
        model::RunLayer(ctx, source.config, *ref, in_source);
    if (!out.ok()) return InLayer(out.status(), source, layer);
    absl::StatusOr<model::V4Activations> forced =
        model::RunLayer(ctx, quantized.config, *quant, in_source);
    if (!forced.ok()) return InLayer(forced.status(), quantized, layer);
    absl::StatusOr<model::V4Activations> own =
        model::RunLayer(ctx, quantized.config, *quant, in_quantized);
    if (!own.ok()) return InLayer(own.status(), quantized, layer);
    const int64_t n = static_cast<int64_t>(out->streams.size());
    q.teacher_forced.Add(out->streams.data(), forced->streams.data(), n);
    q.free_running.Add(out->streams.data(), own->streams.data(), n);
    if (hooks.on_batch) hooks.on_batch(out->tokens());
    result.source.push_back(InHost(*std::move(out)));
    result.quantized.push_back(InHost(*std::move(own)));
  }
  q.forward_seconds = SecondsSince(start) - q.decode_seconds;
  return result;
}

}  // namespace quantd::evaluation
