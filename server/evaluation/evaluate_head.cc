#include "server/evaluation/evaluate_head.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/model/v4_layer.h"

namespace quantd::evaluation {
namespace {

// Sequence `s` of a batch as a batch of its own.
model::V4Activations OneSequence(const model::V4Activations& batch, int64_t s) {
  model::V4Activations one;
  one.sequences = 1;
  one.seq_len = batch.seq_len;
  one.hc_mult = batch.hc_mult;
  one.hidden_size = batch.hidden_size;
  const int64_t values = batch.seq_len * batch.hc_mult * batch.hidden_size;
  one.streams.assign(batch.streams.begin() + s * values, batch.streams.begin() + (s + 1) * values);
  one.token_ids.assign(batch.token_ids.begin() + s * batch.seq_len,
                       batch.token_ids.begin() + (s + 1) * batch.seq_len);
  return one;
}

absl::StatusOr<std::vector<float>> Logits(const model::ForwardContext& ctx,
                                          const model::V4Checkpoint& ckpt,
                                          const model::V4HeadWeights& head,
                                          const model::V4Activations& acts) {
  std::vector<float> hidden, logits;
  if (absl::Status s = model::HeadForward(ctx, ckpt.config, head, acts, &hidden, &logits);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(ckpt.dir->dir(), ": head: ", s.message()));
  }
  return logits;
}

}  // namespace

absl::StatusOr<NextTokenQuality> EvaluateHead(const model::V4Checkpoint& source,
                                              const model::V4Checkpoint& quantized,
                                              const EvaluationBatches& batches,
                                              compute::Device& device, model::Numerics numerics,
                                              const EvaluationHooks& hooks) {
  RETURN_IF_ERROR(CheckPaired(batches, "head input"));
  ASSIGN_OR_RETURN(model::V4HeadWeights ref, model::LoadHead(source, device));
  if (hooks.alive) hooks.alive();
  ASSIGN_OR_RETURN(model::V4HeadWeights quant, model::LoadHead(quantized, device));
  if (hooks.alive) hooks.alive();
  ASSIGN_OR_RETURN(model::ForwardContext ctx,
                   model::MakeForwardContext(device, numerics, /*observer=*/nullptr));
  ctx.alive = hooks.alive;
  const int64_t vocab = source.config.vocab_size;
  NextTokenMetrics metrics;
  for (size_t i = 0; i < batches.source->size(); ++i) {
    const model::V4Activations& source_batch = (*batches.source)[i].host;
    for (int64_t s = 0; s < source_batch.sequences; ++s) {
      if (hooks.cancelled != nullptr && hooks.cancelled->load()) {
        return absl::CancelledError("head: evaluation cancelled");
      }
      const model::V4Activations a = OneSequence(source_batch, s);
      const model::V4Activations b = OneSequence((*batches.quantized)[i].host, s);
      ASSIGN_OR_RETURN(std::vector<float> p, Logits(ctx, source, ref, a));
      ASSIGN_OR_RETURN(std::vector<float> q, Logits(ctx, quantized, quant, b));
      metrics.AddSequence(p.data(), q.data(), a.token_ids.data(), a.seq_len, vocab);
      if (hooks.on_batch) hooks.on_batch(a.seq_len);
    }
  }
  return metrics.Finish();
}

}  // namespace quantd::evaluation
