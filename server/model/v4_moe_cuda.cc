#include "server/model/v4_moe_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/v4_blocks.h"
#include "kernels/cuda/v4_moe_blocks.h"
#include "server/base/status_macros.h"
#include "server/model/v4_linear_cuda.h"

namespace quantd::model {
namespace {

namespace cuda = kernels::cuda;

// The rows routed to each expert, on the device (the kernels' operands) and, where the host needs
// them, on the host.
struct DeviceExpertRows {
  std::vector<int64_t> offsets;     // host, [experts + 1]
  DeviceArray<int64_t> rows;        // [tokens * topk], expert-major, tokens ascending
  DeviceArray<float> weights;       // the rows' routing weights
  std::vector<int64_t> host_rows;   // with an observer: rows on the host
  std::vector<float> host_weights;  // with an observer: weights on the host
};

// The experts' intermediate values, allocated once per MoE for the largest expert call:
// g and u [rows, inter] each.
struct ExpertScratch {
  DeviceArray<float> g, u;
};

// One expert on n gathered rows xe [n, d] -> out [n, d]: w2(wt * swiglu(w1 xe, w3 xe)).
// `weights` (device) and `host_weights` are nullptr for the shared expert; `tokens` (host) is
// the observer's. `scratch` holds n * inter values in each array.
absl::Status ExpertForwardOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                                   const DeviceExpert& e, const float* xe, int64_t n,
                                   const int64_t* tokens, int expert, const float* weights,
                                   const float* host_weights, const ExpertScratch& scratch,
                                   float* out) {
  const int64_t inter = e.w1.out_features(), d = e.w2.out_features();
  const DeviceArray<float>& g = scratch.g;
  const DeviceArray<float>& u = scratch.u;
  const DeviceLinearRows facts{tokens, expert, nullptr, nullptr};
  RETURN_IF_ERROR(
      ApplyLinearOnDevice(ctx, e.w1, xe, n, g.data(), LinearOutput::kModelDtype, facts));
  RETURN_IF_ERROR(
      ApplyLinearOnDevice(ctx, e.w3, xe, n, u.data(), LinearOutput::kModelDtype, facts));
  RETURN_IF_ERROR(LaunchStatus(
      cuda::LaunchClampedSwiglu(g.data(), u.data(), n * inter, config.swiglu_limit, ctx.launch),
      e.w1.module + " SwiGLU"));
  if (weights != nullptr && e.w2.input_scale > 0.0f) {
    // W4A4 NVFP4 w2: quantized without the routing weight, which scales its output (as
    // ExpertForward; calibration_runtime.md §1.4).
    RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, g.data(), n * inter));
    RETURN_IF_ERROR(ApplyLinearOnDevice(ctx, e.w2, g.data(), n, out, LinearOutput::kFloat32,
                                        {tokens, expert, nullptr, g.data()}));
    return LaunchStatus(cuda::LaunchScaleRows(weights, n, d, ctx.official(), out, ctx.launch),
                        e.w2.module + " routing weights");
  }
  // The observer also sees a routed w2's unweighted input (u holds it, model dtype).
  const bool show_unweighted = weights != nullptr && ctx.observer != nullptr;
  if (show_unweighted) {
    RETURN_IF_ERROR(LaunchStatus(
        cudaMemcpyAsync(u.data(), g.data(), static_cast<size_t>(n * inter) * sizeof(float),
                        cudaMemcpyDeviceToDevice, ctx.launch.stream),
        e.w2.module + " unweighted input"));
    RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, u.data(), n * inter));
  }
  if (weights != nullptr) {
    RETURN_IF_ERROR(
        LaunchStatus(cuda::LaunchScaleRows(weights, n, inter, ctx.official(), g.data(), ctx.launch),
                     e.w2.module + " routing weights"));
  } else {
    RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, g.data(), n * inter));
  }
  return ApplyLinearOnDevice(ctx, e.w2, g.data(), n, out, LinearOutput::kModelDtype,
                             {tokens, expert, host_weights, show_unweighted ? u.data() : nullptr});
}

// Router and grouping: ids and weights per token, then the rows of each expert.
absl::StatusOr<DeviceExpertRows> RouteAndGroup(const DeviceForwardContext& ctx,
                                               const V4Config& config, const DeviceMoe& w,
                                               const float* x, int64_t tokens,
                                               const int32_t* token_ids) {
  const int64_t experts = config.n_routed_experts, topk = config.num_experts_per_tok;
  const std::string& module = w.gate.module;
  ASSIGN_OR_RETURN(DeviceArray<float> logits, AllocateArray<float>(ctx, tokens * experts));
  RETURN_IF_ERROR(
      ApplyLinearOnDevice(ctx, w.gate, x, tokens, logits.data(), LinearOutput::kFloat32));
  ASSIGN_OR_RETURN(DeviceArray<int32_t> ids, AllocateArray<int32_t>(ctx, tokens * topk));
  ASSIGN_OR_RETURN(DeviceArray<float> weights, AllocateArray<float>(ctx, tokens * topk));
  if (w.hash) {
    RETURN_IF_ERROR(LaunchStatus(
        cuda::LaunchRouteByHash(logits.data(), tokens, experts, token_ids, w.tid2eid.data(),
                                config.vocab_size, topk, config.routed_scaling_factor, ids.data(),
                                weights.data(), ctx.results(), ctx.launch),
        module + " routing"));
    ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(ctx, module + " routing"));
    if (bad != cuda::kNoBad) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MoE of ", module, ": token ", bad, " has an id outside [0, ", config.vocab_size, ")"));
    }
  } else {
    RETURN_IF_ERROR(
        LaunchStatus(cuda::LaunchRouteByScore(logits.data(), tokens, experts, w.bias.data(), topk,
                                              config.routed_scaling_factor, ids.data(),
                                              weights.data(), ctx.results(), ctx.launch),
                     module + " routing"));
    ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(ctx, module + " routing"));
    if (bad != cuda::kNoBad) {
      return absl::InvalidArgumentError(absl::StrCat("MoE of ", module, ": token ", bad / experts,
                                                     ", expert ", bad % experts,
                                                     ": the router's score is not finite"));
    }
  }
  DeviceExpertRows r;
  ASSIGN_OR_RETURN(DeviceArray<int64_t> offsets, AllocateArray<int64_t>(ctx, experts + 1));
  ASSIGN_OR_RETURN(r.rows, AllocateArray<int64_t>(ctx, tokens * topk));
  ASSIGN_OR_RETURN(r.weights, AllocateArray<float>(ctx, tokens * topk));
  RETURN_IF_ERROR(LaunchStatus(
      cuda::LaunchGroupByExpert(ids.data(), weights.data(), tokens, topk, experts, offsets.data(),
                                r.rows.data(), r.weights.data(), ctx.results(), ctx.launch),
      module + " grouping"));
  ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(ctx, module + " grouping"));
  if (bad != cuda::kNoBad) {
    return absl::InternalError(absl::StrCat("MoE of ", module, ": routed expert id at ", bad,
                                            " is outside [0, ", experts, ")"));
  }
  ASSIGN_OR_RETURN(r.offsets, DownloadArray(offsets.data(), experts + 1, module + " offsets"));
  if (ctx.observer != nullptr) {
    ASSIGN_OR_RETURN(r.host_rows, DownloadArray(r.rows.data(), tokens * topk, module + " rows"));
    ASSIGN_OR_RETURN(r.host_weights,
                     DownloadArray(r.weights.data(), tokens * topk, module + " weights"));
  }
  return r;
}

// calibrate_all_experts (ObserveUnroutedRows in v4_moe.cc): each routed expert's inputs for the
// tokens not routed to it, w2's without a routing weight.
absl::Status ObserveUnroutedRowsOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                                         const DeviceMoe& w, const float* x, int64_t tokens,
                                         const DeviceExpertRows& routed) {
  const int64_t d = config.hidden_size;
  for (size_t e = 0; e < w.experts.size(); ++e) {
    std::vector<int64_t> others;
    int64_t k = routed.offsets[e];
    for (int64_t t = 0; t < tokens; ++t) {
      if (k < routed.offsets[e + 1] && routed.host_rows[k] == t) {
        ++k;
      } else {
        others.push_back(t);
      }
    }
    const int64_t n = static_cast<int64_t>(others.size());
    if (n == 0) continue;
    const DeviceExpert& ew = w.experts[e];
    const int64_t inter = ew.w1.out_features();
    ASSIGN_OR_RETURN(DeviceArray<int64_t> rows, UploadArray(ctx, others, ew.w1.module + " rows"));
    ASSIGN_OR_RETURN(DeviceArray<float> xe, AllocateArray<float>(ctx, n * d));
    RETURN_IF_ERROR(
        LaunchStatus(cuda::LaunchGatherRows(x, d, rows.data(), n, xe.data(), ctx.launch),
                     ew.w1.module + " gather"));
    ASSIGN_OR_RETURN(DeviceArray<float> g, AllocateArray<float>(ctx, n * inter));
    ASSIGN_OR_RETURN(DeviceArray<float> u, AllocateArray<float>(ctx, n * inter));
    const DeviceLinearRows facts{others.data(), static_cast<int>(e), nullptr, nullptr};
    RETURN_IF_ERROR(
        ApplyLinearOnDevice(ctx, ew.w1, xe.data(), n, g.data(), LinearOutput::kModelDtype, facts));
    RETURN_IF_ERROR(
        ApplyLinearOnDevice(ctx, ew.w3, xe.data(), n, u.data(), LinearOutput::kModelDtype, facts));
    RETURN_IF_ERROR(LaunchStatus(
        cuda::LaunchClampedSwiglu(g.data(), u.data(), n * inter, config.swiglu_limit, ctx.launch),
        ew.w1.module + " SwiGLU"));
    RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, g.data(), n * inter));
    RETURN_IF_ERROR(ObserveLinearInput(ctx, ew.w2.module, g.data(), n, inter,
                                       {others.data(), static_cast<int>(e), nullptr, g.data()}));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MoeForwardOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                                const DeviceMoe& w, const float* x, int64_t tokens,
                                const int32_t* token_ids, float* y) {
  const int64_t d = config.hidden_size, experts = config.n_routed_experts;
  ASSIGN_OR_RETURN(DeviceExpertRows routed, RouteAndGroup(ctx, config, w, x, tokens, token_ids));
  ASSIGN_OR_RETURN(DeviceArray<float> sum, AllocateArray<float>(ctx, tokens * d));
  // Scratch for the largest call: the shared expert's tokens rows, or a routed expert's.
  int64_t most_rows = 0, widest = w.shared.w1.out_features();
  for (int64_t e = 0; e < experts; ++e) {
    most_rows = std::max(most_rows, routed.offsets[e + 1] - routed.offsets[e]);
    widest = std::max(widest, w.experts[static_cast<size_t>(e)].w1.out_features());
  }
  ExpertScratch scratch;
  ASSIGN_OR_RETURN(scratch.g, AllocateArray<float>(ctx, tokens * widest));
  ASSIGN_OR_RETURN(scratch.u, AllocateArray<float>(ctx, tokens * widest));
  ASSIGN_OR_RETURN(DeviceArray<float> xe, AllocateArray<float>(ctx, most_rows * d));
  ASSIGN_OR_RETURN(DeviceArray<float> out, AllocateArray<float>(ctx, most_rows * d));
  RETURN_IF_ERROR(
      LaunchStatus(cudaMemsetAsync(sum.data(), 0, static_cast<size_t>(tokens * d) * sizeof(float),
                                   ctx.launch.stream),
                   w.gate.module + " routed sum"));
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = routed.offsets[e], n = routed.offsets[e + 1] - first;
    if (n == 0) continue;
    const DeviceExpert& ew = w.experts[static_cast<size_t>(e)];
    const int64_t* rows = routed.rows.data() + first;
    RETURN_IF_ERROR(LaunchStatus(cuda::LaunchGatherRows(x, d, rows, n, xe.data(), ctx.launch),
                                 ew.w1.module + " gather"));
    const bool observed = ctx.observer != nullptr;
    RETURN_IF_ERROR(ExpertForwardOnDevice(
        ctx, config, ew, xe.data(), n, observed ? routed.host_rows.data() + first : nullptr,
        static_cast<int>(e), routed.weights.data() + first,
        observed ? routed.host_weights.data() + first : nullptr, scratch, out.data()));
    RETURN_IF_ERROR(
        LaunchStatus(cuda::LaunchAddRows(out.data(), rows, n, d, sum.data(), ctx.launch),
                     ew.w2.module + " routed sum"));
  }
  if (ctx.observer != nullptr && ctx.observe_all_experts) {
    RETURN_IF_ERROR(ObserveUnroutedRowsOnDevice(ctx, config, w, x, tokens, routed));
  }
  RETURN_IF_ERROR(ExpertForwardOnDevice(ctx, config, w.shared, x, tokens, nullptr, -1, nullptr,
                                        nullptr, scratch, y));
  return LaunchStatus(
      cuda::LaunchAddRoutedSum(sum.data(), tokens * d, ctx.official(), y, ctx.launch),
      w.gate.module + " routed sum");
}

}  // namespace quantd::model
