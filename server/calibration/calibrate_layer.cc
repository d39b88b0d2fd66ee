#include "server/calibration/calibrate_layer.h"

#include <stdio.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/calibration/amax_observer.h"
#include "server/checkpoint/sha256.h"
#include "server/model/v4_layer.h"

namespace quantd::calibration {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

absl::Status AddLayerContext(const absl::Status& s, int64_t layer) {
  return absl::Status(s.code(), absl::StrCat("layer ", layer, ": ", s.message()));
}

// The batch's activations in host memory: itself, or read back from its spill file (verified
// against its SHA-256, then removed).
absl::StatusOr<model::V4Activations> TakeHost(BatchActivations& batch) {
  if (batch.spill_path.empty()) return std::move(batch.host);
  ASSIGN_OR_RETURN(const std::string sha256, checkpoint::Sha256File(batch.spill_path));
  if (sha256 != batch.spill_sha256) {
    return absl::DataLossError(absl::StrCat("spilled activations ", batch.spill_path,
                                            " have SHA-256 ", sha256, ", written as ",
                                            batch.spill_sha256));
  }
  ASSIGN_OR_RETURN(model::V4Activations acts, model::ReadActivations(batch.spill_path));
  ::remove(batch.spill_path.c_str());
  return acts;
}

}  // namespace

int64_t EstimateBatchBytes(const model::V4Config& c, int64_t sequences, int64_t seq_len) {
  const int64_t tokens = sequences * seq_len;
  // Floats per token: streams in/out and the hc mixes, the attention's q/kv/o projections, the
  // routed experts' gate/up/out rows and the shared expert, the MoE's fp32 sum.
  const int64_t per_token = 4 * c.hc_mult * c.hidden_size + 4 * c.hidden_size +
                            c.q_lora_rank + 3 * c.num_attention_heads * c.head_dim +
                            c.n_routed_experts +
                            3 * (c.num_experts_per_tok + c.n_shared_experts) *
                                c.moe_intermediate_size;
  // Scores of one sequence's attention over its window and selected entries, all heads.
  const int64_t keys = std::min(seq_len, c.sliding_window + c.index_topk + seq_len / 4);
  const int64_t scores = c.num_attention_heads * seq_len * keys;
  return 4 * (tokens * per_token + sequences * scores);
}

absl::StatusOr<std::vector<BatchActivations>> EmbedSlice(
    const model::V4Checkpoint& ckpt, const std::vector<std::vector<int32_t>>& sample_ids,
    int64_t batch_bytes) {
  // Samples by length, in order of first appearance of each length.
  std::vector<int64_t> lengths;
  std::map<int64_t, std::vector<size_t>> by_length;
  for (size_t k = 0; k < sample_ids.size(); ++k) {
    const int64_t n = static_cast<int64_t>(sample_ids[k].size());
    if (n == 0) return absl::InvalidArgumentError(absl::StrCat("calibration sample ", k, " is empty"));
    if (by_length[n].empty()) lengths.push_back(n);
    by_length[n].push_back(k);
  }
  std::vector<BatchActivations> batches;
  for (int64_t n : lengths) {
    const std::vector<size_t>& members = by_length[n];
    size_t i = 0;
    while (i < members.size()) {
      int64_t take = 1;
      while (i + take < members.size() &&
             EstimateBatchBytes(ckpt.config, take + 1, n) <= batch_bytes) {
        ++take;
      }
      std::vector<int32_t> ids;
      for (int64_t j = 0; j < take; ++j) {
        const std::vector<int32_t>& s = sample_ids[members[i + j]];
        ids.insert(ids.end(), s.begin(), s.end());
      }
      ASSIGN_OR_RETURN(model::V4Activations acts, model::Embed(ckpt, std::move(ids), take, n));
      BatchActivations b;
      b.tokens = acts.tokens();
      b.host = std::move(acts);
      batches.push_back(std::move(b));
      i += take;
    }
  }
  return batches;
}

absl::StatusOr<SliceResult> CalibrateLayerSlice(const model::V4Checkpoint& ckpt, int64_t layer,
                                                std::vector<BatchActivations> input,
                                                compute::Device& device,
                                                const SliceOptions& options) {
  SliceResult result;
  result.amax.AddSlice(options.slice);
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<model::V4LayerWeights> weights = model::LoadLayer(ckpt, layer, device);
  if (!weights.ok()) return AddLayerContext(weights.status(), layer);
  result.timing.load = SecondsSince(start);

  AmaxObserver observer(&result.amax, layer, ckpt.config.swiglu_limit);
  ASSIGN_OR_RETURN(model::ForwardContext ctx,
                   model::MakeForwardContext(device, options.numerics, &observer));
  ctx.observe_all_experts = options.all_experts;
  double run_seconds = 0.0;
  for (size_t i = 0; i < input.size(); ++i) {
    start = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(model::V4Activations in, TakeHost(input[i]));
    result.timing.spill += SecondsSince(start);

    start = std::chrono::steady_clock::now();
    absl::StatusOr<model::V4Activations> out = model::RunLayer(ctx, ckpt.config, *weights, in);
    run_seconds += SecondsSince(start);
    if (!out.ok()) return AddLayerContext(out.status(), layer);
    if (!observer.status().ok()) return observer.status();

    BatchActivations batch;
    batch.tokens = out->tokens();
    if (options.spill_dir.empty()) {
      batch.host = std::move(*out);
    } else {
      start = std::chrono::steady_clock::now();
      batch.spill_path = absl::StrCat(options.spill_dir, "/layer", layer, ".slice",
                                      options.slice_index, ".batch", i, ".safetensors");
      RETURN_IF_ERROR(model::SpillActivations(*out, batch.spill_path));
      ASSIGN_OR_RETURN(batch.spill_sha256, checkpoint::Sha256File(batch.spill_path));
      result.timing.spill += SecondsSince(start);
    }
    result.output.push_back(std::move(batch));
  }
  result.timing.record = observer.record_seconds();
  result.timing.forward = run_seconds - result.timing.record;
  return result;
}

void ReleaseBatches(std::vector<BatchActivations>& batches) {
  for (BatchActivations& b : batches) {
    if (!b.spill_path.empty()) ::remove(b.spill_path.c_str());
  }
  batches.clear();
}

}  // namespace quantd::calibration
