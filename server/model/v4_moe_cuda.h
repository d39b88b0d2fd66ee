// MoeForward (v4_moe.h) on a CUDA device (CUDA builds only), the steps of
// kernels/cuda/v4_moe_blocks.h's header: the router and the grouping, gather, SwiGLU, routing
// weight and scatter-add kernels around the experts' products (ApplyLinearOnDevice), the experts
// in ascending id order so that the fp32 routed sum adds as the host's does. The per-expert row
// counts come to the host (they size the products); with an observer, so do each expert's rows
// and routing weights.
#ifndef QUANTD_SERVER_MODEL_V4_MOE_CUDA_H_
#define QUANTD_SERVER_MODEL_V4_MOE_CUDA_H_

#include <stdint.h>

#include "absl/status/status.h"
#include "server/model/v4_config.h"
#include "server/model/v4_device_context.h"
#include "server/model/v4_device_weights.h"

namespace quantd::model {

// y[tokens, d] = MoE(x) for the ffn-normed x [tokens, d] of the tokens `token_ids` [tokens]; x,
// token_ids and y are device buffers. InvalidArgument for a token id outside the vocabulary (hash
// layers) or a router logit that is not finite, naming the token.
absl::Status MoeForwardOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                                const DeviceMoe& w, const float* x, int64_t tokens,
                                const int32_t* token_ids, float* y);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_MOE_CUDA_H_
