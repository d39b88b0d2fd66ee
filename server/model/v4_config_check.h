// CheckV4ConfigAgainstTensors: a DeepSeek-V4 config.json held against the tensors the checkpoint
// has, before anything is planned from it. The plan's size follows num_hidden_layers (a calibrate
// task per layer and slice, an evaluate task per layer) and the forward's buffers follow the
// dimensions, so a config.json that claims what the tensors do not hold (400 000 layers over a
// 3-layer checkpoint) is refused here, naming config.json, the field and the tensor, instead of
// being planned, stored and run.
//
// Checked: the decoder layers with tensors are exactly [0, num_hidden_layers); per layer (and the
// MTP block "mtp.0." when present), every tensor whose shape a field decides: the attention
// projections (hidden_size, q_lora_rank, num_attention_heads x head_dim, o_groups x o_lora_rank),
// the norms, attn_sink, the router (n_routed_experts, and every expert index below it present),
// the experts (moe_intermediate_size), the shared experts (n_shared_experts), the hash layers'
// tid2eid (vocab_size, num_experts_per_tok), the hyper-connection mixers (hc_mult), a compressor
// exactly in the layers whose compress_ratios entry is not 0 (its ape's rows), the indexer
// (index_n_heads x index_head_dim); and embed, head and norm (vocab_size, hidden_size).
// Tensors the forward needs but that are absent are left to the loader, which names them.
#ifndef QUANTD_SERVER_MODEL_V4_CONFIG_CHECK_H_
#define QUANTD_SERVER_MODEL_V4_CONFIG_CHECK_H_

#include <string>

#include "absl/status/status.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/model/v4_config.h"

namespace quantd::model {

// InvalidArgument "<config_path>: field \"<field>\" gives <dim> for <tensor>, which has shape
// [..]" (or names the layers present) at the first mismatch.
absl::Status CheckV4ConfigAgainstTensors(const V4Config& config,
                                         const checkpoint::TensorInventory& inventory,
                                         const std::string& config_path);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_CONFIG_CHECK_H_
