#include "server/model/v4_moe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/model/v4_forward_ops.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

// The expert under `prefix`, decoded into `previous`'s buffers where they are large enough.
absl::StatusOr<ExpertWeights> LoadExpert(const V4Checkpoint& ckpt, kernels::Backend& backend,
                                         const std::string& prefix, int64_t inter,
                                         ExpertWeights previous = {}) {
  const int64_t d = ckpt.config.hidden_size;
  ExpertWeights e;
  ASSIGN_OR_RETURN(e.w1, LoadLinear(ckpt, backend, prefix + "w1", inter, d,
                                    std::move(previous.w1.decoded.holder)));
  ASSIGN_OR_RETURN(e.w2, LoadLinear(ckpt, backend, prefix + "w2", d, inter,
                                    std::move(previous.w2.decoded.holder)));
  ASSIGN_OR_RETURN(e.w3, LoadLinear(ckpt, backend, prefix + "w3", inter, d,
                                    std::move(previous.w3.decoded.holder)));
  return e;
}

// Scratch of the experts' products, sized once for the largest call: g and u [rows, inter].
struct ExpertScratch {
  OpArray<float> g, u;
};

// g[rows, inter] = swiglu(w1 x, w3 x) of expert `e` on `rows` rows of x (not yet in the model
// dtype); u holds w3 x.
absl::Status GateUp(const ForwardContext& ctx, const V4Config& config, const ExpertWeights& e,
                    const float* x, int64_t rows, const LinearRows& facts,
                    const ExpertScratch& scratch) {
  const ForwardOps& ops = OpsOf(ctx);
  const int64_t inter = e.w1.out_features();
  float* g = scratch.g.data();
  float* u = scratch.u.data();
  RETURN_IF_ERROR(ops.Linear(ctx, e.w1, x, rows, g, LinearOutput::kModelDtype, facts));
  RETURN_IF_ERROR(ops.Linear(ctx, e.w3, x, rows, u, LinearOutput::kModelDtype, facts));
  return ops.ClampedSwiglu(ctx, g, u, rows * inter, config.swiglu_limit);
}

// One expert on `rows` gathered rows of x: out[rows, d] = w2(wt * swiglu(w1 x, w3 x)).
// `weights` (ops memory) and `host_weights` nullptr for the shared expert; `tokens` host.
absl::Status ExpertForward(const ForwardContext& ctx, const V4Config& config,
                           const ExpertWeights& e, const float* x, int64_t rows,
                           const int64_t* tokens, int expert, const float* weights,
                           const float* host_weights, const ExpertScratch& scratch, float* out) {
  const ForwardOps& ops = OpsOf(ctx);
  const int64_t inter = e.w1.out_features();
  float* g = scratch.g.data();
  float* u = scratch.u.data();
  RETURN_IF_ERROR(GateUp(ctx, config, e, x, rows, {tokens, expert, nullptr}, scratch));
  if (weights != nullptr && e.w2.input_scale > 0.0f) {
    // A W4A4 NVFP4 w2 runs as the runtimes' fused MoE kernels run it (calibration_runtime.md
    // §1.4): its input is quantized without the routing weight, which scales w2's output.
    RETURN_IF_ERROR(ops.ToModelDtype(ctx, g, rows * inter));
    const int64_t d = e.w2.out_features();
    RETURN_IF_ERROR(ops.Linear(ctx, e.w2, g, rows, out, LinearOutput::kFloat32,
                               {tokens, expert, nullptr, g}));
    return ops.ScaleRows(ctx, weights, rows, d, out);
  }
  // The observer also sees the unweighted input of a routed w2 (u holds it, model dtype).
  const bool show_unweighted = weights != nullptr && ctx.observer != nullptr;
  if (show_unweighted) {
    RETURN_IF_ERROR(ops.Copy(g, rows * inter, u));
    RETURN_IF_ERROR(ops.ToModelDtype(ctx, u, rows * inter));
  }
  if (weights != nullptr) {
    RETURN_IF_ERROR(ops.ScaleRows(ctx, weights, rows, inter, g));
  } else {
    RETURN_IF_ERROR(ops.ToModelDtype(ctx, g, rows * inter));
  }
  return ops.Linear(ctx, e.w2, g, rows, out, LinearOutput::kModelDtype,
                    {tokens, expert, host_weights, show_unweighted ? u : nullptr});
}

// calibrate_all_experts: shows the observer routed expert `e`'s inputs for the tokens that were
// not routed to it (`routed`, `n_routed` host rows ascending), w2's without a routing weight.
// Nothing else changes.
absl::Status ObserveUnroutedRows(const ForwardContext& ctx, const V4Config& config,
                                 const ExpertWeights& ew, int e, const float* x, int64_t tokens,
                                 const int64_t* routed, int64_t n_routed,
                                 const ExpertScratch& scratch) {
  const ForwardOps& ops = OpsOf(ctx);
  const int64_t d = config.hidden_size;
  std::vector<int64_t> others;
  int64_t k = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (k < n_routed && routed[k] == t) {
      ++k;
    } else {
      others.push_back(t);
    }
  }
  const int64_t n = static_cast<int64_t>(others.size());
  if (n == 0) return absl::OkStatus();
  const int64_t inter = ew.w1.out_features();
  ASSIGN_OR_RETURN(const OpArray<int64_t> rows, UploadArray(ops, others, ew.w1.module + " rows"));
  ASSIGN_OR_RETURN(const OpArray<float> xe,
                   AllocateArray<float>(ops, n * d, ew.w1.module + " input"));
  RETURN_IF_ERROR(ops.GatherRows(ctx, x, d, rows.data(), n, xe.data()));
  RETURN_IF_ERROR(GateUp(ctx, config, ew, xe.data(), n, {others.data(), e, nullptr}, scratch));
  float* g = scratch.g.data();
  RETURN_IF_ERROR(ops.ToModelDtype(ctx, g, n * inter));
  LinearInput input;
  input.module = &ew.w2.module;
  input.expert = e;
  input.x = g;
  input.rows = n;
  input.cols = inter;
  input.ld = inter;
  input.tokens = others.data();
  input.unweighted_x = g;
  return ops.ObserveLinearInput(ctx, input);
}

}  // namespace

RoutedExperts::RoutedExperts(const V4Checkpoint* ckpt, kernels::Backend* backend,
                             std::string prefix, int64_t count, int64_t inter)
    : ckpt_(ckpt), backend_(backend), prefix_(std::move(prefix)), count_(count), inter_(inter) {}

absl::StatusOr<ExpertWeights> RoutedExperts::Decode(int64_t e, ExpertWeights previous) const {
  if (e < 0 || e >= count_) {
    return absl::OutOfRangeError(absl::StrCat(prefix_, "experts: no expert ", e));
  }
  return LoadExpert(*ckpt_, *backend_, absl::StrCat(prefix_, "experts.", e, "."), inter_,
                    std::move(previous));
}

absl::StatusOr<MoeWeights> LoadMoe(const V4Checkpoint& ckpt, kernels::Backend& backend,
                                   const std::string& prefix, bool hash,
                                   const std::function<void()>& alive) {
  const V4Config& c = ckpt.config;
  const std::string p = prefix + "ffn.";
  MoeWeights w;
  ASSIGN_OR_RETURN(w.gate,
                   LoadLinear(ckpt, backend, p + "gate", c.n_routed_experts, c.hidden_size));
  if (hash) {
    ASSIGN_OR_RETURN(w.tid2eid, LoadExpertIds(ckpt, p + "gate.tid2eid", c.vocab_size,
                                              c.num_experts_per_tok, c.n_routed_experts));
  } else {
    ASSIGN_OR_RETURN(w.bias, LoadFloats(ckpt, p + "gate.bias", {c.n_routed_experts}));
  }
  const int64_t d = c.hidden_size, inter = c.moe_intermediate_size;
  for (int64_t e = 0; e < c.n_routed_experts; ++e) {
    const std::string ep = absl::StrCat(p, "experts.", e, ".");
    RETURN_IF_ERROR(CheckLinear(ckpt, ep + "w1", inter, d));
    RETURN_IF_ERROR(CheckLinear(ckpt, ep + "w2", d, inter));
    RETURN_IF_ERROR(CheckLinear(ckpt, ep + "w3", inter, d));
    if (alive) alive();
  }
  w.experts = RoutedExperts(&ckpt, &backend, p, c.n_routed_experts, inter);
  ASSIGN_OR_RETURN(w.shared, LoadExpert(ckpt, backend, p + "shared_experts.",
                                        c.moe_intermediate_size * c.n_shared_experts));
  return w;
}

Routing Route(const V4Config& config, const MoeWeights& w, const float* logits, int64_t tokens,
              const int32_t* token_ids, const HostThreads& threads) {
  const int64_t experts = config.n_routed_experts, topk = config.num_experts_per_tok;
  Routing r;
  r.experts.resize(static_cast<size_t>(tokens * topk));
  r.weights.resize(r.experts.size());
  ParallelRows(threads, tokens, 40 * experts, [&](int, int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(experts)), biased(scores.size());
    std::vector<int32_t> order(scores.size());
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < experts; ++e) scores[e] = SqrtSoftplus(logits[t * experts + e]);
      int32_t* ids = r.experts.data() + t * topk;
      if (!w.tid2eid.empty()) {
        std::copy_n(w.tid2eid.data() + static_cast<int64_t>(token_ids[t]) * topk, topk, ids);
      } else {
        for (int64_t e = 0; e < experts; ++e) biased[e] = scores[e] + w.bias[e];
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + topk, order.end(),
                          [&](int32_t a, int32_t b) {
                            return biased[a] > biased[b] || (biased[a] == biased[b] && a < b);
                          });
        std::copy_n(order.begin(), topk, ids);
      }
      float* wt = r.weights.data() + t * topk;
      float sum = 0.0f;
      for (int64_t k = 0; k < topk; ++k) sum += (wt[k] = scores[ids[k]]);
      for (int64_t k = 0; k < topk; ++k) wt[k] = wt[k] / sum * config.routed_scaling_factor;
    }
  });
  return r;
}

ExpertRows GroupByExpert(const Routing& routing, int64_t tokens, int64_t topk, int64_t experts) {
  ExpertRows r;
  r.tokens.resize(static_cast<size_t>(experts));
  r.weights.resize(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < topk; ++k) {
      const int32_t e = routing.experts[t * topk + k];
      r.tokens[e].push_back(t);
      r.weights[e].push_back(routing.weights[t * topk + k]);
    }
  }
  return r;
}

void GatherRows(const float* x, int64_t d, const int64_t* rows, int64_t n, float* out,
                const HostThreads& threads) {
  ParallelRows(threads, n, d, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::copy_n(x + rows[i] * d, d, out + i * d);
  });
}

void ScaleRows(const float* weights, int64_t rows, int64_t cols, float* x,
               const HostThreads& threads) {
  ParallelRows(threads, rows, cols, [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < cols; ++i) x[r * cols + i] = weights[r] * x[r * cols + i];
    }
  });
}

void AddRows(const float* out, const int64_t* rows, int64_t n, int64_t d, float* sum,
             const HostThreads& threads) {
  ParallelRows(threads, n, 2 * d, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* dst = sum + rows[i] * d;
      for (int64_t c = 0; c < d; ++c) dst[c] += out[i * d + c];
    }
  });
}

absl::Status MoeBlock(const ForwardContext& ctx, const V4Config& config, const MoeWeights& w,
                      const float* x, int64_t tokens, const int32_t* token_ids, float* y) {
  const ForwardOps& ops = OpsOf(ctx);
  const int64_t d = config.hidden_size, experts = config.n_routed_experts;
  for (int64_t t = 0; t < tokens && !w.tid2eid.empty(); ++t) {
    if (token_ids[t] < 0 || token_ids[t] >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("MoE of ", w.gate.module, ": token ", t,
                                                     " has an id outside [0, ", config.vocab_size,
                                                     ")"));
    }
  }
  if (w.experts.size() != experts) {
    return absl::InvalidArgumentError(absl::StrCat("MoE of ", w.gate.module, ": ",
                                                   w.experts.size(), " routed experts loaded, ",
                                                   experts, " configured"));
  }
  ASSIGN_OR_RETURN(const OpArray<int32_t> ids,
                   UploadArray(ops, std::vector<int32_t>(token_ids, token_ids + tokens),
                               w.gate.module + " token ids"));
  ASSIGN_OR_RETURN(const OpArray<float> logits,
                   AllocateArray<float>(ops, tokens * experts, w.gate.module + " logits"));
  RETURN_IF_ERROR(
      ops.Linear(ctx, w.gate, x, tokens, logits.data(), LinearOutput::kFloat32, {}));
  ASSIGN_OR_RETURN(const OpExpertRows routed,
                   ops.RouteAndGroup(ctx, config, w, logits.data(), tokens, ids.data()));

  // Scratch for the largest call: the shared expert's `tokens` rows, or a routed expert's.
  int64_t most_rows = 0;
  for (int64_t e = 0; e < experts; ++e) {
    most_rows = std::max(most_rows, routed.offsets[e + 1] - routed.offsets[e]);
  }
  const int64_t widest = std::max(config.moe_intermediate_size, w.shared.w1.out_features());
  ExpertScratch scratch;
  ASSIGN_OR_RETURN(scratch.g, AllocateArray<float>(ops, tokens * widest, w.gate.module + " g"));
  ASSIGN_OR_RETURN(scratch.u, AllocateArray<float>(ops, tokens * widest, w.gate.module + " u"));
  ASSIGN_OR_RETURN(const OpArray<float> xe,
                   AllocateArray<float>(ops, most_rows * d, w.gate.module + " expert input"));
  ASSIGN_OR_RETURN(const OpArray<float> out,
                   AllocateArray<float>(ops, most_rows * d, w.gate.module + " expert output"));
  ASSIGN_OR_RETURN(const OpArray<float> sum,  // the fp32 routed sum, zeroed
                   AllocateArray<float>(ops, tokens * d, w.gate.module + " routed sum"));
  // Each expert that a token reaches (or, calibrate_all_experts, that the observer sees) is
  // decoded once, into the buffers of the one before, and used before the next.
  const bool observe_all = ctx.observer != nullptr && ctx.observe_all_experts;
  const bool host_facts = !routed.host_rows.empty();
  ExpertWeights ew;  // the expert in use; its buffers take the next one
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = routed.offsets[e], n = routed.offsets[e + 1] - first;
    if (n == 0 && !observe_all) continue;
    const auto decode_start = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(ew, ops.DecodeExpert(w.experts, e, std::move(ew)));
    if (ctx.decode_seconds != nullptr) {
      *ctx.decode_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - decode_start).count();
    }
    if (n > 0) {
      const int64_t* rows = routed.rows.data() + first;
      RETURN_IF_ERROR(ops.GatherRows(ctx, x, d, rows, n, xe.data()));
      RETURN_IF_ERROR(ExpertForward(
          ctx, config, ew, xe.data(), n, host_facts ? routed.host_rows.data() + first : nullptr,
          static_cast<int>(e), routed.weights.data() + first,
          host_facts ? routed.host_weights.data() + first : nullptr, scratch, out.data()));
      // A token is routed to an expert at most once (distinct ids per row): no two rows share a
      // destination.
      RETURN_IF_ERROR(ops.AddRows(ctx, out.data(), rows, n, d, sum.data()));
    }
    if (observe_all) {
      RETURN_IF_ERROR(ObserveUnroutedRows(ctx, config, ew, static_cast<int>(e), x, tokens,
                                          routed.host_rows.data() + first, n, scratch));
    }
  }
  RETURN_IF_ERROR(
      ExpertForward(ctx, config, w.shared, x, tokens, nullptr, -1, nullptr, nullptr, scratch, y));
  return ops.AddRoutedSum(ctx, sum.data(), tokens * d, y);
}

absl::Status MoeForward(const ForwardContext& ctx, const V4Config& config, const MoeWeights& w,
                        const float* x, int64_t tokens, const int32_t* token_ids, float* y) {
  const ForwardOps& ops = OpsOf(ctx);
  const size_t bytes = static_cast<size_t>(tokens * config.hidden_size) * sizeof(float);
  ASSIGN_OR_RETURN(const OpArray<float> xs,
                   AllocateArray<float>(ops, tokens * config.hidden_size, "MoE input"));
  RETURN_IF_ERROR(ops.CopyIn(x, bytes, xs.data(), "MoE input"));
  ASSIGN_OR_RETURN(const OpArray<float> ys,
                   AllocateArray<float>(ops, tokens * config.hidden_size, "MoE output"));
  RETURN_IF_ERROR(MoeBlock(ctx, config, w, xs.data(), tokens, token_ids, ys.data()));
  return ops.CopyOut(ys.data(), bytes, y, "MoE output");
}

}  // namespace quantd::model
