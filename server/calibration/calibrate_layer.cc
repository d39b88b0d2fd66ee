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

// The batch's activations read back from its spill file, verified against its SHA-256.
absl::StatusOr<model::V4Activations> ReadSpilled(const BatchActivations& batch) {
  ASSIGN_OR_RETURN(const std::string sha256, checkpoint::Sha256File(batch.spill_path));
  if (sha256 != batch.spill_sha256) {
    return absl::DataLossError(absl::StrCat("spilled activations ", batch.spill_path,
                                            " have SHA-256 ", sha256, ", written as ",
                                            batch.spill_sha256));
  }
  return model::ReadActivations(batch.spill_path);
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

absl::StatusOr<std::vector<std::vector<size_t>>> PlanBatches(const model::V4Config& config,
                                                             const std::vector<int64_t>& lengths,
                                                             int64_t batch_bytes) {
  // Samples by length, in order of first appearance of each length.
  std::vector<int64_t> order;
  std::map<int64_t, std::vector<size_t>> by_length;
  for (size_t k = 0; k < lengths.size(); ++k) {
    const int64_t n = lengths[k];
    if (n <= 0) return absl::InvalidArgumentError(absl::StrCat("calibration sample ", k, " is empty"));
    if (by_length[n].empty()) order.push_back(n);
    by_length[n].push_back(k);
  }
  std::vector<std::vector<size_t>> batches;
  for (int64_t n : order) {
    const std::vector<size_t>& members = by_length[n];
    size_t i = 0;
    while (i < members.size()) {
      int64_t take = 1;
      while (i + take < members.size() &&
             EstimateBatchBytes(config, take + 1, n) <= batch_bytes) {
        ++take;
      }
      batches.emplace_back(members.begin() + i, members.begin() + i + take);
      i += take;
    }
  }
  return batches;
}

std::pair<int64_t, int64_t> SliceBatches(int64_t batches, int64_t slice, int64_t slices) {
  return {slice * batches / slices, (slice + 1) * batches / slices};
}

absl::StatusOr<BatchActivations> EmbedBatch(const model::V4Checkpoint& ckpt,
                                            const std::vector<std::vector<int32_t>>& sample_ids,
                                            const std::vector<size_t>& members) {
  if (members.empty()) return absl::InvalidArgumentError("a calibration batch has no sample");
  const int64_t n = static_cast<int64_t>(sample_ids.at(members[0]).size());
  std::vector<int32_t> ids;
  for (size_t k : members) {
    const std::vector<int32_t>& s = sample_ids.at(k);
    if (static_cast<int64_t>(s.size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration sample ", k, " has ", s.size(), " tokens, its batch ", n));
    }
    ids.insert(ids.end(), s.begin(), s.end());
  }
  ASSIGN_OR_RETURN(model::V4Activations acts,
                   model::Embed(ckpt, std::move(ids), static_cast<int64_t>(members.size()), n));
  BatchActivations b;
  b.tokens = acts.tokens();
  b.host = std::move(acts);
  return b;
}

int64_t HostBytes(const model::V4Activations& acts) {
  return static_cast<int64_t>(acts.streams.size() * sizeof(float) +
                              acts.token_ids.size() * sizeof(int32_t));
}

absl::StatusOr<std::vector<BatchActivations>> EmbedSlice(
    const model::V4Checkpoint& ckpt, const std::vector<std::vector<int32_t>>& sample_ids,
    int64_t batch_bytes) {
  std::vector<int64_t> lengths;
  for (const std::vector<int32_t>& s : sample_ids) lengths.push_back(static_cast<int64_t>(s.size()));
  ASSIGN_OR_RETURN(const std::vector<std::vector<size_t>> plan,
                   PlanBatches(ckpt.config, lengths, batch_bytes));
  std::vector<BatchActivations> batches;
  for (const std::vector<size_t>& members : plan) {
    ASSIGN_OR_RETURN(BatchActivations b, EmbedBatch(ckpt, sample_ids, members));
    batches.push_back(std::move(b));
  }
  return batches;
}

absl::StatusOr<SliceResult> CalibrateLayerSlice(const model::V4Checkpoint& ckpt, int64_t layer,
                                                const std::vector<BatchActivations>& input,
                                                compute::Device& device,
                                                const SliceOptions& options,
                                                const std::atomic<bool>* cancelled) {
  SliceResult result;
  result.amax.AddSlice(options.slice);
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<model::V4LayerWeights> weights =
      model::LoadLayer(ckpt, layer, device, options.alive);
  if (!weights.ok()) return AddLayerContext(weights.status(), layer);
  result.timing.load = SecondsSince(start);

  AmaxObserver observer(&result.amax, layer, ckpt.config.swiglu_limit);
  ASSIGN_OR_RETURN(model::ForwardContext ctx,
                   model::MakeForwardContext(device, options.numerics, &observer));
  ctx.observe_all_experts = options.all_experts;
  ctx.alive = options.alive;
  ctx.decode_seconds = &result.timing.decode;
  double run_seconds = 0.0;
  for (size_t i = 0; i < input.size(); ++i) {
    if (cancelled != nullptr && cancelled->load()) {
      return absl::CancelledError(absl::StrCat("layer ", layer, ": calibration cancelled"));
    }
    // A spilled input is read into `read`; one in host memory is used where it is.
    model::V4Activations read;
    const model::V4Activations* in = &input[i].host;
    if (!input[i].spill_path.empty()) {
      start = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(read, ReadSpilled(input[i]));
      result.timing.spill += SecondsSince(start);
      in = &read;
    }

    start = std::chrono::steady_clock::now();
    absl::StatusOr<model::V4Activations> out = model::RunLayer(ctx, ckpt.config, *weights, *in);
    run_seconds += SecondsSince(start);
    if (!out.ok()) return AddLayerContext(out.status(), layer);
    if (!observer.status().ok()) return observer.status();
    result.tokens += out->tokens();
    if (options.on_batch) options.on_batch(out->tokens());
    read = model::V4Activations();
    if (options.discard_output) continue;

    BatchActivations batch;
    batch.tokens = out->tokens();
    const bool keep = options.keep_in_host ? options.keep_in_host(HostBytes(*out))
                                           : options.spill_dir.empty();
    if (keep) {
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
  result.timing.forward = run_seconds - result.timing.record - result.timing.decode;
  return result;
}

void ReleaseBatches(std::vector<BatchActivations>& batches) {
  for (BatchActivations& b : batches) {
    if (!b.spill_path.empty()) ::remove(b.spill_path.c_str());
  }
  batches.clear();
}

}  // namespace quantd::calibration
