#include "server/model/v4_layer_cuda.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/v4_blocks.h"
#include "kernels/cuda/v4_mhc_blocks.h"
#include "server/base/status_macros.h"
#include "server/model/v4_attention_cuda.h"
#include "server/model/v4_layer.h"
#include "server/model/v4_linear_cuda.h"
#include "server/model/v4_moe_cuda.h"

namespace quantd::model {
namespace {

namespace cuda = kernels::cuda;

// HcMix on the device.
struct DeviceHcMix {
  DeviceArray<float> pre, post, comb;  // [tokens, hc], [tokens, hc], [tokens, hc, hc]
};

// HcPre (v4_mhc.h): streams [tokens, hc, d] -> y [tokens, d] (model dtype) and the mix.
absl::StatusOr<DeviceHcMix> HcPreOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                                          const DeviceHyperConnection& w, const float* streams,
                                          int64_t tokens, float* y, const std::string& what) {
  const int64_t hc = config.hc_mult, d = config.hidden_size, width = hc * d;
  const int64_t mix_width = (2 + hc) * hc;
  ASSIGN_OR_RETURN(DeviceArray<float> mixes, AllocateArray<float>(ctx, tokens * mix_width));
  const kernels::DenseTensor fn{w.fn.data(), kernels::FloatType::kF32, mix_width, width};
  RETURN_IF_ERROR(DeviceMatMulNT(ctx, streams, tokens, fn, mixes.data(), what + "fn"));
  RETURN_IF_ERROR(LaunchStatus(cuda::LaunchHcScaleMixes(streams, tokens, width, config.rms_norm_eps,
                                                        mixes.data(), mix_width, ctx.launch),
                               what + " mixes"));
  DeviceHcMix mix;
  ASSIGN_OR_RETURN(mix.pre, AllocateArray<float>(ctx, tokens * hc));
  ASSIGN_OR_RETURN(mix.post, AllocateArray<float>(ctx, tokens * hc));
  ASSIGN_OR_RETURN(mix.comb, AllocateArray<float>(ctx, tokens * hc * hc));
  RETURN_IF_ERROR(LaunchStatus(
      cuda::LaunchSplitSinkhorn(mixes.data(), w.scale.data(), w.base.data(), tokens, hc,
                                config.hc_sinkhorn_iters, config.hc_eps, mix.pre.data(),
                                mix.post.data(), mix.comb.data(), ctx.launch),
      what + " Sinkhorn"));
  RETURN_IF_ERROR(LaunchStatus(
      cuda::LaunchHcCollapse(mix.pre.data(), streams, tokens, hc, d, ctx.official(), y, ctx.launch),
      what + " collapse"));
  return mix;
}

// HcPost (v4_mhc.h): out = post * f + comb-mixed streams (model dtype).
absl::Status HcPostOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                            const DeviceHcMix& mix, const float* f, const float* streams,
                            int64_t tokens, float* out, const std::string& what) {
  return LaunchStatus(
      cuda::LaunchHcPost(mix.post.data(), mix.comb.data(), f, streams, tokens, config.hc_mult,
                         config.hidden_size, ctx.official(), out, ctx.launch),
      what + " hc_post");
}

absl::Status RmsNormOnDevice(const DeviceForwardContext& ctx, const V4Config& config, float* x,
                             int64_t tokens, const DeviceArray<float>& weight,
                             const std::string& what) {
  return LaunchStatus(cuda::LaunchRmsNorm(x, tokens, config.hidden_size, weight.data(),
                                          config.rms_norm_eps, ctx.official(), x, ctx.launch),
                      what);
}

}  // namespace

absl::StatusOr<V4Activations> RunLayerOnDevice(const DeviceForwardContext& ctx,
                                               const V4Config& config,
                                               const V4DeviceLayerWeights& layer,
                                               const V4Activations& in) {
  RETURN_IF_ERROR(CheckActivations(config, in));
  if (layer.cuda_index != ctx.cuda_index) {
    return absl::FailedPreconditionError(absl::StrCat("layer ", layer.layer,
                                                      " is on cuda:", layer.cuda_index,
                                                      ", the context on ", ctx.device->name()));
  }
  RETURN_IF_ERROR(UseDevice(ctx));
  const int64_t tokens = in.tokens(), d = config.hidden_size;
  const int64_t n = static_cast<int64_t>(in.streams.size());
  const std::string p = absl::StrCat("layers.", layer.layer, ".");
  ASSIGN_OR_RETURN(const DeviceArray<float> streams, UploadArray(ctx, in.streams, "streams"));
  ASSIGN_OR_RETURN(const DeviceArray<int32_t> ids, UploadArray(ctx, in.token_ids, "token ids"));
  ASSIGN_OR_RETURN(DeviceArray<float> x, AllocateArray<float>(ctx, tokens * d));

  ASSIGN_OR_RETURN(DeviceHcMix mix, HcPreOnDevice(ctx, config, layer.hc_attn, streams.data(),
                                                  tokens, x.data(), p + "hc_attn_"));
  RETURN_IF_ERROR(RmsNormOnDevice(ctx, config, x.data(), tokens, layer.attn_norm, p + "attn_norm"));
  ASSIGN_OR_RETURN(DeviceArray<float> attn, AllocateArray<float>(ctx, tokens * d));
  RETURN_IF_ERROR(AttentionForwardOnDevice(ctx, config, layer.layer, layer.attn, x.data(),
                                           in.sequences, in.seq_len, attn.data()));
  ASSIGN_OR_RETURN(DeviceArray<float> mid, AllocateArray<float>(ctx, n));
  RETURN_IF_ERROR(HcPostOnDevice(ctx, config, mix, attn.data(), streams.data(), tokens, mid.data(),
                                 p + "attn"));

  ASSIGN_OR_RETURN(
      mix, HcPreOnDevice(ctx, config, layer.hc_ffn, mid.data(), tokens, x.data(), p + "hc_ffn_"));
  RETURN_IF_ERROR(RmsNormOnDevice(ctx, config, x.data(), tokens, layer.ffn_norm, p + "ffn_norm"));
  DeviceArray<float>& ffn = attn;  // the attention output is spent: reuse its memory
  RETURN_IF_ERROR(
      MoeForwardOnDevice(ctx, config, layer.moe, x.data(), tokens, ids.data(), ffn.data()));
  ASSIGN_OR_RETURN(DeviceArray<float> out, AllocateArray<float>(ctx, n));
  RETURN_IF_ERROR(
      HcPostOnDevice(ctx, config, mix, ffn.data(), mid.data(), tokens, out.data(), p + "ffn"));

  V4Activations result;
  result.sequences = in.sequences;
  result.seq_len = in.seq_len;
  result.hc_mult = in.hc_mult;
  result.hidden_size = in.hidden_size;
  result.token_ids = in.token_ids;
  ASSIGN_OR_RETURN(result.streams, DownloadArray(out.data(), n, "output streams"));
  return result;
}

}  // namespace quantd::model
