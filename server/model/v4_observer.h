// What the DeepSeek-V4 forward shows its caller while it runs: the input of every linear layer
// and the KV cache, so that calibration can record amax (or anything else) per module without the
// forward knowing what is recorded.
#ifndef QUANTD_SERVER_MODEL_V4_OBSERVER_H_
#define QUANTD_SERVER_MODEL_V4_OBSERVER_H_

#include <stdint.h>

#include <string>

namespace quantd::model {

// The input of one linear layer (or one expert's linear) for the rows it is applied to.
struct LinearInput {
  const std::string* module = nullptr;  // official name without ".weight": "layers.3.attn.wq_a",
                                        // "layers.3.ffn.experts.5.w2", "layers.1.attn.wo_a"
  int expert = -1;                      // routed expert id, -1 for every other module
  // The input values [rows, cols] as the layer receives them, before any activation
  // quantization simulation (official mode: BF16-exact values), row stride `ld`.
  const float* x = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  // Rows of the batch (index into the layer's [batch * seq_len] tokens) that the input rows
  // belong to; nullptr for every non-expert module, whose rows are the batch's tokens in order
  // (the MTP block's h_proj: each token's hc streams, token-major).
  const int64_t* tokens = nullptr;
  // An expert's w2 only: the routing weight of each row (route_scale included). Official
  // semantics apply it before w2, so `x` already contains it (calibration_runtime.md §1.4).
  // nullptr for the rows ForwardContext::observe_all_experts adds (tokens not routed to the
  // expert, which have no weight: then `x` == `unweighted_x`).
  const float* routing_weights = nullptr;
  // An expert's w2 only: the same rows without the routing weight (silu(min(g,limit)) *
  // clamp(u, +-limit) in the model dtype), what the runtimes' fused MoE kernels quantize; same
  // layout as `x`.
  const float* unweighted_x = nullptr;
};

// The key/value entries one attention layer caches for all tokens: the sliding-window KV
// [tokens, head_dim] (after kv_norm and RoPE, before the FP8 simulation) or the compressed
// entries of a compressor.
struct KvCacheInput {
  const std::string* module = nullptr;  // "layers.3.attn.kv", "layers.3.attn.compressor"
  const float* kv = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

class Observer {
 public:
  virtual ~Observer() = default;
  virtual void OnLinearInput(const LinearInput& input) = 0;
  virtual void OnKvCache(const KvCacheInput& input) = 0;
};

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_OBSERVER_H_
