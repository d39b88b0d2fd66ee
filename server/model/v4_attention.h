// The attention sub-block of one DeepSeek-V4 decoder layer (deepseek_v4_format.md §7,
// v4_forward_crosscheck.md §1b/§1c): low-rank q with per-head RMS normalisation, one shared K=V
// head, partial interleaved RoPE (plain on sliding-only layers, YaRN on compressed layers) and
// inverse RoPE on the output, a 128-token sliding window, per-head attention sinks, CSA (ratio-4
// compressor with overlap + lightning indexer top-k) or HCA (ratio-128 compressor), and the
// grouped wo_a / wo_b output.
//
// Input is the attn_norm output of a batch of prefill sequences of equal length, starting at
// position 0 (calibration and evaluation never decode): token i of sequence b is row b*S + i and
// sits at position i. Activations are float32 buffers; in Numerics::kOfficial they hold
// BF16-representable values wherever the official code holds BF16 tensors.
// Linear products go through kernels::Gemm; only the sparse attention, RoPE, pooling and
// activation simulation are own code.
#ifndef QUANTD_SERVER_MODEL_V4_ATTENTION_H_
#define QUANTD_SERVER_MODEL_V4_ATTENTION_H_

#include <stdint.h>

#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/gemm.h"
#include "kernels/tensor_views.h"
#include "server/model/v4_numerics.h"

namespace quantd::model {

// YaRN parameters of config.json `rope_scaling` (applied on compressed layers only).
struct V4Yarn {
  double factor = 16.0;
  int64_t original_max_position_embeddings = 65536;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
};

// The config.json fields attention needs (names in comments). Model-wide; the per-layer compress
// ratio is carried by the layer's weights.
struct V4AttentionConfig {
  int64_t hidden_size = 0;          // hidden_size (d)
  int64_t num_heads = 0;            // num_attention_heads (H); num_key_value_heads is 1
  int64_t head_dim = 0;             // head_dim (D, 512)
  int64_t rope_head_dim = 0;        // qk_rope_head_dim (last rd dims of every head are rotated)
  int64_t q_lora_rank = 0;          // q_lora_rank
  int64_t o_groups = 0;             // o_groups
  int64_t o_lora_rank = 0;          // o_lora_rank
  int64_t sliding_window = 128;     // sliding_window
  int64_t index_n_heads = 0;        // index_n_heads
  int64_t index_head_dim = 0;       // index_head_dim
  int64_t index_topk = 0;           // index_topk
  double rms_norm_eps = 1e-6;       // rms_norm_eps (also the per-head q normalisation)
  double rope_theta = 10000.0;      // rope_theta: sliding-only layers, no YaRN
  double compress_rope_theta = 160000.0;  // compress_rope_theta: compressed layers, with YaRN
  V4Yarn yarn;                      // rope_scaling
};

// A BF16 matrix in host memory, row-major [rows, cols] (FP8-block weights dequantize to BF16
// exactly, so every attention matrix is held this way).
struct Bf16Matrix {
  std::vector<uint16_t> values;  // BF16 bit patterns, rows * cols
  int64_t rows = 0;
  int64_t cols = 0;

  kernels::DenseTensor view() const {
    return kernels::DenseTensor{values.data(), kernels::FloatType::kBF16, rows, cols};
  }
};

// `attn.compressor.*` (width D) or `attn.indexer.compressor.*` (width index_head_dim). With
// ratio 4 the projections are 2x as wide: [:width] feeds the next window's entry (overlap),
// [width:] the current one.
struct V4CompressorWeights {
  Bf16Matrix wkv;            // wkv.weight [coff*width, d]
  Bf16Matrix wgate;          // wgate.weight [coff*width, d]
  std::vector<float> ape;    // ape [ratio, coff*width] (F32 on disk)
  std::vector<float> norm;   // norm.weight [width] (BF16 on disk)
};

// `attn.indexer.*` (ratio-4 layers).
struct V4IndexerWeights {
  Bf16Matrix wq_b;                 // wq_b.weight [index_n_heads*index_head_dim, q_lora_rank]
  Bf16Matrix weights_proj;         // weights_proj.weight [index_n_heads, d]
  V4CompressorWeights compressor;  // compressor.* (width index_head_dim)
};

// `layers.N.attn.*` after decoding (official checkpoint names).
struct V4AttentionWeights {
  int compress_ratio = 0;          // compress_ratios[N]: 0 (sliding only), 4 (CSA), 128 (HCA)
  Bf16Matrix wq_a;                 // wq_a.weight [q_lora_rank, d]
  std::vector<float> q_norm;       // q_norm.weight [q_lora_rank]
  Bf16Matrix wq_b;                 // wq_b.weight [H*D, q_lora_rank]
  Bf16Matrix wkv;                  // wkv.weight [D, d]
  std::vector<float> kv_norm;      // kv_norm.weight [D]
  Bf16Matrix wo_a;                 // wo_a.weight [o_groups*o_lora_rank, H*D/o_groups]
  Bf16Matrix wo_b;                 // wo_b.weight [d, o_groups*o_lora_rank]
  std::vector<float> attn_sink;    // attn_sink [H] (zeros where the checkpoint has none)
  std::optional<V4CompressorWeights> compressor;  // ratio 4 or 128
  std::optional<V4IndexerWeights> indexer;        // ratio 4 only
};

// InvalidArgument naming the first tensor (official name under `attn.`) whose shape disagrees
// with `config`, or a ratio other than 0/4/128, or a compressor/indexer present or missing
// against the ratio.
absl::Status ValidateAttentionWeights(const V4AttentionConfig& config,
                                      const V4AttentionWeights& weights);

// Sees, during AttentionForward, every linear's input (before any activation simulation) under
// its official module name relative to the layer — "attn.wq_a", "attn.wkv", "attn.wq_b",
// "attn.wo_a" (the [T, H*D] inverse-RoPE'd output, groups side by side), "attn.wo_b",
// "attn.compressor.wkv", "attn.compressor.wgate", "attn.indexer.wq_b",
// "attn.indexer.weights_proj", "attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate" —
// and the KV cache as attention reads it but before its FP8 simulation: "attn.kv_cache" (the
// window K=V, [T, D]) and "attn.compressor.kv_cache" (compressed entries, [B*entries, D]).
// data is host memory valid only during the call, [rows, cols] row-major.
using AttentionObserver =
    std::function<void(std::string_view module, const float* data, int64_t rows, int64_t cols)>;

// A batch of prefill sequences: x is [sequences * seq_len, hidden_size], the attn_norm output.
struct AttentionBatch {
  const float* x = nullptr;
  int64_t sequences = 0;
  int64_t seq_len = 0;
};

// The attention sub-block's output [sequences * seq_len, hidden_size] (before hc_post).
// InvalidArgument for weights that fail ValidateAttentionWeights, an empty or null batch, or
// (official numerics) widths that the FP8/FP4 simulation cannot block; errors from `gemm` pass
// through. `observer` may be empty.
absl::StatusOr<std::vector<float>> AttentionForward(const V4AttentionConfig& config,
                                                    const V4AttentionWeights& weights,
                                                    Numerics numerics, const AttentionBatch& batch,
                                                    kernels::Gemm& gemm,
                                                    const AttentionObserver& observer);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_ATTENTION_H_
