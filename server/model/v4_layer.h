// One DeepSeek-V4 decoder layer at a time, for calibration and evaluation: LoadLayer decodes
// only that layer's weights (resident while the caller holds them), RunLayer moves a batch of
// activations (the hc residual streams per token) through it:
//
//   x, mix_a = hc_pre(streams, hc_attn);  a = attn(attn_norm(x));  h = hc_post(a, streams, mix_a)
//   x, mix_f = hc_pre(h, hc_ffn);         f = moe(ffn_norm(x));    out = hc_post(f, h, mix_f)
//
// plus the model's ends: the embedding (ids -> identical streams) and the head
// (hc_head -> norm -> fp32 logits).
#ifndef QUANTD_SERVER_MODEL_V4_LAYER_H_
#define QUANTD_SERVER_MODEL_V4_LAYER_H_

#include <stdint.h>

#include <vector>

#include "absl/status/statusor.h"
#include "server/compute/device.h"
#include "server/model/v4_activations.h"
#include "server/model/v4_attention.h"
#include "server/model/v4_linear.h"
#include "server/model/v4_mhc.h"
#include "server/model/v4_moe.h"
#include "server/model/v4_weights.h"

namespace quantd::model {

struct V4LayerWeights {
  int64_t layer = 0;                  // index; num_hidden_layers is the MTP block
  HyperConnectionWeights hc_attn;     // hc_attn_{fn,base,scale}
  HyperConnectionWeights hc_ffn;      // hc_ffn_{fn,base,scale}
  std::vector<float> attn_norm;       // attn_norm.weight [d]
  std::vector<float> ffn_norm;        // ffn_norm.weight [d]
  V4AttentionWeights attn;            // attn.*
  MoeWeights moe;                     // ffn.*
};

// A forward context on `device`: its Gemm, the numerics and the observer (may be nullptr).
// FailedPrecondition when the device's buffers are not host-visible: the blocks other than
// the GEMMs run on the host.
absl::StatusOr<ForwardContext> MakeForwardContext(compute::Device& device, Numerics numerics,
                                                  Observer* observer);

// Decodes the weights of main layer `layer` (0 <= layer < num_hidden_layers) with the device's
// kernels. Errors name the tensor.
absl::StatusOr<V4LayerWeights> LoadLayer(const V4Checkpoint& ckpt, int64_t layer,
                                         compute::Device& device);

// Runs one layer over a batch. InvalidArgument when `in` does not match the config.
absl::StatusOr<V4Activations> RunLayer(const ForwardContext& ctx, const V4Config& config,
                                       const V4LayerWeights& layer, const V4Activations& in);

// The embedding of `token_ids` ([sequences, seq_len]), copied into each of the hc streams.
// InvalidArgument for an id outside the vocabulary (naming its position).
absl::StatusOr<V4Activations> Embed(const V4Checkpoint& ckpt, std::vector<int32_t> token_ids,
                                    int64_t sequences, int64_t seq_len);

struct V4HeadWeights {
  HyperConnectionWeights hc_head;  // hc_head_{fn,base,scale}
  std::vector<float> norm;         // norm.weight [d]
  LinearWeight head;               // head.weight [vocab, d]
};
absl::StatusOr<V4HeadWeights> LoadHead(const V4Checkpoint& ckpt, compute::Device& device);

// The final hidden state norm(hc_head(streams)) [tokens, d] (model dtype) and, when `logits`
// is not null, the float32 logits [tokens, vocab] of every position.
absl::Status HeadForward(const ForwardContext& ctx, const V4Config& config,
                         const V4HeadWeights& head, const V4Activations& acts,
                         std::vector<float>* hidden, std::vector<float>* logits);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_LAYER_H_
