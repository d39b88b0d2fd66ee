// One DeepSeek-V4 decoder layer at a time, for calibration and evaluation: LoadLayer decodes
// only that layer's weights (resident while the caller holds them), RunLayer moves a batch of
// activations (the hc residual streams per token) through it:
//
//   x, mix_a = hc_pre(streams, hc_attn);  a = attn(attn_norm(x));  h = hc_post(a, streams, mix_a)
//   x, mix_f = hc_pre(h, hc_ffn);         f = moe(ffn_norm(x));    out = hc_post(f, h, mix_f)
//
// plus the model's ends: the embedding (ids -> identical streams) and the head
// (hc_head -> norm -> fp32 logits), and the MTP block as an optional pass after the last layer.
#ifndef QUANTD_SERVER_MODEL_V4_LAYER_H_
#define QUANTD_SERVER_MODEL_V4_LAYER_H_

#include <stdint.h>

#include <functional>
#include <memory>
#include <string>
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
  int64_t layer = 0;               // index; num_hidden_layers is the MTP block
  HyperConnectionWeights hc_attn;  // hc_attn_{fn,base,scale}
  HyperConnectionWeights hc_ffn;   // hc_ffn_{fn,base,scale}
  std::vector<float> attn_norm;    // attn_norm.weight [d]
  std::vector<float> ffn_norm;     // ffn_norm.weight [d]
  V4AttentionWeights attn;         // attn.*
  MoeWeights moe;                  // ffn.*
  std::string placed = "host";     // ForwardOps::placement() of the ops that placed them
};

// A forward context on `device`: its ops (v4_forward_ops.h: the host's, or a CUDA device's),
// its Gemm, the numerics and the observer (may be nullptr). RunLayer, HeadForward and RunMtp run
// on its ops. FailedPrecondition for a device without a Gemm or of another kind.
absl::StatusOr<ForwardContext> MakeForwardContext(compute::Device& device, Numerics numerics,
                                                  Observer* observer);

// Decodes the weights of main layer `layer` (0 <= layer < num_hidden_layers) with the device's
// kernels, placed for its ops (on a CUDA device the linears stay resident there; the routed
// experts stay in their stored form, decoded per expert by the forward). Errors name the
// tensor. `alive` (may be empty) is called after the attention weights and after each routed
// expert: a long load's sign of life for the task that runs it.
absl::StatusOr<V4LayerWeights> LoadLayer(const V4Checkpoint& ckpt, int64_t layer,
                                         compute::Device& device,
                                         const std::function<void()>& alive = {});

// InvalidArgument unless `a` holds sequences * seq_len tokens of hc_mult streams of hidden_size
// values for a model with `config`'s hc_mult and hidden_size.
absl::Status CheckActivations(const V4Config& config, const V4Activations& a);

// Runs one layer over a batch, on ctx's ops. InvalidArgument when `in` does not match the
// config; FailedPrecondition when the weights were placed for other ops (loaded on another
// device than ctx's).
absl::StatusOr<V4Activations> RunLayer(const ForwardContext& ctx, const V4Config& config,
                                       const V4LayerWeights& layer, const V4Activations& in);

// The embedding of `token_ids` ([sequences, seq_len]), copied into each of the hc streams,
// tokens split over `threads` (a ForwardContext's; the result does not depend on it).
// InvalidArgument for an id outside the vocabulary (naming its position).
absl::StatusOr<V4Activations> Embed(const V4Checkpoint& ckpt, std::vector<int32_t> token_ids,
                                    int64_t sequences, int64_t seq_len,
                                    const HostThreads& threads = {});

// Embed's gather: row t of out (at out + t * stride) = the BF16 row ids[t] of `table`
// ([vocab, d], little-endian bytes as the checkpoint holds them) as float32, copied to the
// `copies` - 1 rows of d values after it. The ids must be in range (Embed checks them).
void EmbeddingRows(const uint8_t* table, int64_t d, const int32_t* ids, int64_t tokens,
                   int64_t stride, int64_t copies, float* out, const HostThreads& threads = {});

struct V4HeadWeights {
  HyperConnectionWeights hc_head;  // hc_head_{fn,base,scale}
  std::vector<float> norm;         // norm.weight [d]
  LinearWeight head;               // head.weight [vocab, d]
  std::string placed = "host";     // ForwardOps::placement() of the ops that placed it
};
absl::StatusOr<V4HeadWeights> LoadHead(const V4Checkpoint& ckpt, compute::Device& device);

// The final hidden state norm(hc_head(streams)) [tokens, d] (model dtype) and, when `logits`
// is not null, the float32 logits [tokens, vocab] of every position, on ctx's ops
// (FailedPrecondition for weights placed for other ops).
absl::Status HeadForward(const ForwardContext& ctx, const V4Config& config,
                         const V4HeadWeights& head, const V4Activations& acts,
                         std::vector<float>* hidden, std::vector<float>* logits);

// The MTP block ("mtp.0.", layer index num_hidden_layers, compress ratio from the last entry of
// compress_ratios, bias top-k routing): the official MTPBlock, which the shipped inference never
// calls (v4_forward_crosscheck.md §1b.12), so its input plumbing is the caller's.
struct V4MtpWeights {
  LinearWeight e_proj;       // e_proj [d, d], FP8
  LinearWeight h_proj;       // h_proj [d, d], FP8
  std::vector<float> enorm;  // enorm.weight [d]
  std::vector<float> hnorm;  // hnorm.weight [d]
  V4LayerWeights block;      // the decoder block under mtp.0.
  V4HeadWeights head;        // mtp.0.hc_head_*, mtp.0.norm and the shared head.weight
};
absl::StatusOr<V4MtpWeights> LoadMtp(const V4Checkpoint& ckpt, compute::Device& device);

// The MTP block over the last main layer's output streams `h` and `next_ids` [sequences,
// seq_len], the ids of the tokens that follow each position (the caller shifts them):
//   x[t, j] = e_proj(enorm(embed(next_ids[t]))) + h_proj(hnorm(h[t, j])) for every stream j,
// then the decoder block. Returns the block's output streams (their token ids are next_ids);
// HeadForward with mtp.head gives the MTP logits. On ctx's ops (FailedPrecondition for weights
// placed for other ops).
absl::StatusOr<V4Activations> RunMtp(const ForwardContext& ctx, const V4Checkpoint& ckpt,
                                     const V4MtpWeights& mtp, const V4Activations& h,
                                     std::vector<int32_t> next_ids);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_LAYER_H_
