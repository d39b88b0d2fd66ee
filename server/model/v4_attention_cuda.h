// AttentionForward (v4_attention.h) on a CUDA device (CUDA builds only): the same steps over
// device buffers, with the blocks of kernels/cuda/v4_blocks.h (RMSNorm, RoPE, FP8 simulation),
// v4_head_norm_blocks.h (per-head q norm), v4_compressor_blocks.h (window pooling),
// v4_attention_blocks.h (sparse attention with sinks, indexer Hadamard/FP4, scores, top-k) and
// the products through ApplyLinearOnDevice / the device's Gemm. The observer sees host copies of
// every linear's input and of the KV cache, under the host forward's names.
//
// One difference by contract: where indexer scores tie at the top-k boundary, the device picks
// the lower entry ids (LaunchSelectTopEntries' total order) and the host libstdc++'s selection,
// so such a query may read other compressed entries (CSA layers only; exact zeros, where every
// indexer head's relu is 0, and BF16-equal official scores tie).
#ifndef QUANTD_SERVER_MODEL_V4_ATTENTION_CUDA_H_
#define QUANTD_SERVER_MODEL_V4_ATTENTION_CUDA_H_

#include <stdint.h>

#include "absl/status/status.h"
#include "server/model/v4_config.h"
#include "server/model/v4_device_context.h"
#include "server/model/v4_device_weights.h"

namespace quantd::model {

// out [sequences * seq_len, hidden_size] = the attention sub-block of `layer` on the attn_norm
// output x (both device buffers; sequences of seq_len tokens from position 0). The weights must
// have passed ValidateAttentionWeights (UploadLayer checks them). InvalidArgument as
// AttentionForward for shapes the official simulation cannot block or a non-finite activation.
absl::Status AttentionForwardOnDevice(const DeviceForwardContext& ctx, const V4Config& config,
                                      int64_t layer, const DeviceAttention& weights, const float* x,
                                      int64_t sequences, int64_t seq_len, float* out);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_ATTENTION_CUDA_H_
