// The attention sub-block of one DeepSeek-V4 decoder layer (deepseek_v4_format.md §7,
// v4_forward_crosscheck.md §1b/§1c): low-rank q with per-head RMS normalisation, one shared K=V
// head, partial interleaved RoPE (plain on sliding-only layers, YaRN on compressed layers) and
// inverse RoPE on the output, a 128-token sliding window, per-head attention sinks, CSA (ratio-4
// compressor with overlap + lightning indexer top-k) or HCA (ratio-128 compressor), and the
// grouped wo_a / wo_b output.
//
// Shapes come from V4Config (v4_config.h); the layer's compress ratio picks the variant.
// Input is the attn_norm output of a batch of prefill sequences of equal length, starting at
// position 0 (calibration and evaluation never decode): token i of sequence b is row b*S + i and
// sits at position i. Activations are float32 buffers; in Numerics::kOfficial they hold
// BF16-representable values wherever the official code holds BF16 tensors.
// Linear products go through kernels::Gemm; only the sparse attention, RoPE, pooling and
// activation simulation are own code.
#ifndef QUANTD_SERVER_MODEL_V4_ATTENTION_H_
#define QUANTD_SERVER_MODEL_V4_ATTENTION_H_

#include <stdint.h>

#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/v4_config.h"
#include "server/model/v4_linear.h"
#include "server/model/v4_weights.h"

namespace quantd::model {

// `attn.compressor.*` (width D) or `attn.indexer.compressor.*` (width index_head_dim). With
// ratio 4 the projections are 2x as wide: [:width] feeds the next window's entry (overlap),
// [width:] the current one.
struct V4CompressorWeights {
  LinearWeight wkv;         // wkv.weight [coff*width, d]
  LinearWeight wgate;       // wgate.weight [coff*width, d]
  std::vector<float> ape;   // ape [ratio, coff*width] (F32 on disk)
  std::vector<float> norm;  // norm.weight [width] (BF16 on disk)
};

// `attn.indexer.*` (ratio-4 layers).
struct V4IndexerWeights {
  LinearWeight wq_b;               // wq_b.weight [index_n_heads*index_head_dim, q_lora_rank]
  LinearWeight weights_proj;       // weights_proj.weight [index_n_heads, d]
  V4CompressorWeights compressor;  // compressor.* (width index_head_dim)
};

// `layers.N.attn.*` after decoding (official checkpoint names). Linear weights are dense BF16
// (FP8-block decodes to BF16 exactly); LinearWeight::module names them for the observer.
struct V4AttentionWeights {
  LinearWeight wq_a;             // wq_a.weight [q_lora_rank, d]
  std::vector<float> q_norm;     // q_norm.weight [q_lora_rank]
  LinearWeight wq_b;             // wq_b.weight [H*D, q_lora_rank]
  LinearWeight wkv;              // wkv.weight [D, d]
  std::vector<float> kv_norm;    // kv_norm.weight [D]
  LinearWeight wo_a;             // wo_a.weight [o_groups*o_lora_rank, H*D/o_groups]
  LinearWeight wo_b;             // wo_b.weight [d, o_groups*o_lora_rank]
  std::vector<float> attn_sink;  // attn_sink [H] (zeros where the checkpoint has none)
  std::optional<V4CompressorWeights> compressor;  // compress ratio 4 or 128
  std::optional<V4IndexerWeights> indexer;        // compress ratio 4 only
};

// InvalidArgument naming the first tensor (official name) whose shape disagrees with `config`,
// a compress ratio of `layer` other than 0/4/128, or a compressor/indexer present or missing
// against that ratio.
absl::Status ValidateAttentionWeights(const V4Config& config, int64_t layer,
                                      const V4AttentionWeights& weights);

// What the official numerics' simulation needs of the shapes beyond ValidateAttentionWeights:
// KV nope dims (head_dim - qk_rope_head_dim) in blocks of 64 and, for compress ratio 4, an
// indexer head that the Hadamard transform and the FP4 blocks of 32 fit. InvalidArgument
// otherwise.
absl::Status CheckOfficialShapes(const V4Config& config, int64_t ratio);

// The unweighted per-head RMS normalisation of q [rows, dim] in place (official
// `q *= torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)` on a BF16 tensor). Official
// numerics round every elementwise step to BF16 as torch does on BF16 tensors: each square, the
// mean (accumulated in float32), mean + eps, the rsqrt, and each product. Math: float32
// throughout.
void NormalizeHeads(const ForwardContext& ctx, float eps, float* q, int64_t rows, int64_t dim);

// A batch of prefill sequences: x is [sequences * seq_len, hidden_size], the attn_norm output.
struct AttentionBatch {
  const float* x = nullptr;
  int64_t sequences = 0;
  int64_t seq_len = 0;
};

// The attention sub-block of layer `layer` (num_hidden_layers: the MTP block), output
// [sequences * seq_len, hidden_size] (before hc_post), with ctx's numerics and Gemm.
// InvalidArgument for weights that fail ValidateAttentionWeights, an empty or null batch, or
// (official numerics) widths that the FP8/FP4 simulation cannot block; errors from the Gemm pass
// through.
//
// ctx.observer (may be null) sees every linear's input, before any activation simulation, under
// its LinearWeight::module — layers.N.attn.{wq_a, wkv, wq_b, wo_a (the inverse-RoPE'd output
// [T, H*D], groups side by side), wo_b, compressor.wkv, compressor.wgate, indexer.wq_b,
// indexer.weights_proj, indexer.compressor.wkv, indexer.compressor.wgate} — and the KV cache as
// attention reads it, before its FP8 simulation: layers.N.attn.kv (the window K=V, [T, D]) and
// layers.N.attn.compressor (the compressed entries of all sequences, [B * S/ratio, D]).
absl::StatusOr<std::vector<float>> AttentionForward(const ForwardContext& ctx,
                                                    const V4Config& config, int64_t layer,
                                                    const V4AttentionWeights& weights,
                                                    const AttentionBatch& batch);

// AttentionForward over ctx's ops (v4_forward_ops.h): batch.x and out [tokens, hidden_size] in
// their memory.
absl::Status AttentionBlock(const ForwardContext& ctx, const V4Config& config, int64_t layer,
                            const V4AttentionWeights& weights, const AttentionBatch& batch,
                            float* out);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_ATTENTION_H_
