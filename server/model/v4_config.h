// The DeepSeek-V4 model shape, read from the checkpoint's config.json
// (reference/deepseek_v4_format.md §1). One struct serves every block of the forward.
#ifndef QUANTD_SERVER_MODEL_V4_CONFIG_H_
#define QUANTD_SERVER_MODEL_V4_CONFIG_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace quantd::model {

struct V4Config {
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;  // main layers; the MTP block is layer num_hidden_layers
  int64_t vocab_size = 0;
  int64_t num_attention_heads = 0;
  int64_t head_dim = 0;          // 512 in the real models; K = V, one shared head
  int64_t qk_rope_head_dim = 0;  // the last dims of each head that get RoPE
  int64_t q_lora_rank = 0;
  int64_t o_groups = 0;
  int64_t o_lora_rank = 0;
  int64_t sliding_window = 0;
  int64_t index_n_heads = 0;
  int64_t index_head_dim = 0;
  int64_t index_topk = 0;
  // Per layer: 0 (sliding window only), 4 (CSA) or 128 (HCA). num_hidden_layers + 1 entries;
  // the last is the MTP block (0 when config.json lists only the main layers).
  std::vector<int64_t> compress_ratios;
  double rope_theta = 0.0;           // layers with ratio 0 and the MTP block
  double compress_rope_theta = 0.0;  // compressed layers, with YaRN
  double rope_factor = 1.0;          // YaRN (rope_scaling); 1 when absent
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 0.0;
  double beta_slow = 0.0;
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t num_hash_layers = 0;         // layers [0, n) route by tid2eid
  float routed_scaling_factor = 1.0f;  // route_scale
  float swiglu_limit = 0.0f;           // 0: no clamp
  int64_t hc_mult = 0;
  int64_t hc_sinkhorn_iters = 0;
  float hc_eps = 0.0f;
  float rms_norm_eps = 0.0f;

  int64_t CompressRatio(int64_t layer) const {
    return layer < static_cast<int64_t>(compress_ratios.size()) ? compress_ratios[layer] : 0;
  }
  bool IsHashLayer(int64_t layer) const {
    return layer < num_hash_layers && layer < num_hidden_layers;
  }
};

// Parses and validates a DeepSeek-V4 config.json object; `source` names it in errors.
// InvalidArgument names the missing or out-of-range field.
absl::StatusOr<V4Config> ParseV4Config(const nlohmann::json& json, const std::string& source);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_CONFIG_H_
