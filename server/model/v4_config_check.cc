#include "server/model/v4_config_check.h"

#include <stdint.h>

#include <map>
#include <set>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace quantd::model {
namespace {

using checkpoint::LinearModule;
using checkpoint::ShapeString;
using checkpoint::TensorInfo;
using checkpoint::TensorInventory;

// The index N of "<prefix>N.…", or -1.
int64_t IndexAfter(absl::string_view name, absl::string_view prefix) {
  if (name.substr(0, prefix.size()) != prefix) return -1;
  const size_t dot = name.find('.', prefix.size());
  int64_t index = -1;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(name.substr(prefix.size(),
                                                                     dot - prefix.size()),
                                                         &index)) {
    return -1;
  }
  return index;
}

class Checker {
 public:
  Checker(const V4Config& c, const TensorInventory& inv, const std::string& path)
      : c_(c), path_(path) {
    for (const TensorInfo& t : inv.tensors) shapes_[t.name] = &t.shape;
    for (const LinearModule& m : inv.linears) linears_[m.name] = &m;
  }

  // What a field gives for a dimension of a tensor, against the tensor's shape.
  absl::Status Mismatch(const char* field, int64_t expected, const std::string& tensor,
                        const std::string& shape) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": field \"", field, "\" gives ",
                                                   expected, " for ", tensor,
                                                   ", which has shape ", shape));
  }

  // Linear `module` (when present) is [out, in] as the fields say.
  absl::Status Linear(const std::string& module, const char* out_field, int64_t out,
                      const char* in_field, int64_t in) const {
    const auto it = linears_.find(module);
    if (it == linears_.end()) return absl::OkStatus();
    const LinearModule& m = *it->second;
    const std::string shape = ShapeString({m.out_features, m.in_features});
    if (m.out_features != out) return Mismatch(out_field, out, module + ".weight", shape);
    if (m.in_features != in) return Mismatch(in_field, in, module + ".weight", shape);
    return absl::OkStatus();
  }

  // Tensor `name` (when present) has `dims` (a field and its value per dimension; nullptr: any).
  absl::Status Tensor(const std::string& name,
                      const std::vector<std::pair<const char*, int64_t>>& dims) const {
    const auto it = shapes_.find(name);
    if (it == shapes_.end()) return absl::OkStatus();
    const std::vector<int64_t>& shape = *it->second;
    if (shape.size() != dims.size()) {
      return Mismatch(dims.front().first, dims.front().second, name, ShapeString(shape));
    }
    for (size_t i = 0; i < dims.size(); ++i) {
      if (dims[i].first != nullptr && shape[i] != dims[i].second) {
        return Mismatch(dims[i].first, dims[i].second, name, ShapeString(shape));
      }
    }
    return absl::OkStatus();
  }

  bool Has(const std::string& name) const { return shapes_.count(name) != 0; }
  const std::map<std::string, const std::vector<int64_t>*>& shapes() const { return shapes_; }

  // One decoder block under `p` ("layers.3." or "mtp.0."), block index `layer`.
  absl::Status Block(const std::string& p, int64_t layer) const {
    const int64_t hidden = c_.hidden_size;
    const int64_t heads_dim = c_.num_attention_heads * c_.head_dim;
    const int64_t o_rank = c_.o_groups * c_.o_lora_rank;
    const std::string a = p + "attn.";
    if (absl::Status s = Linear(a + "wq_a", "q_lora_rank", c_.q_lora_rank, "hidden_size", hidden);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Linear(a + "wq_b", "num_attention_heads", heads_dim, "q_lora_rank",
                                c_.q_lora_rank);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Linear(a + "wkv", "head_dim", c_.head_dim, "hidden_size", hidden);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Linear(a + "wo_a", "o_lora_rank", o_rank, "o_groups",
                                heads_dim / c_.o_groups);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Linear(a + "wo_b", "hidden_size", hidden, "o_lora_rank", o_rank);
        !s.ok()) {
      return s;
    }
    for (const auto& [name, dims] :
         std::vector<std::pair<std::string, std::vector<std::pair<const char*, int64_t>>>>{
             {a + "attn_sink", {{"num_attention_heads", c_.num_attention_heads}}},
             {a + "q_norm.weight", {{"q_lora_rank", c_.q_lora_rank}}},
             {a + "kv_norm.weight", {{"head_dim", c_.head_dim}}},
             {p + "attn_norm.weight", {{"hidden_size", hidden}}},
             {p + "ffn_norm.weight", {{"hidden_size", hidden}}},
             {p + "ffn.gate.weight", {{"n_routed_experts", c_.n_routed_experts},
                                      {"hidden_size", hidden}}},
             {p + "ffn.gate.bias", {{"n_routed_experts", c_.n_routed_experts}}},
             {p + "ffn.gate.tid2eid", {{"vocab_size", c_.vocab_size},
                                       {"num_experts_per_tok", c_.num_experts_per_tok}}},
             {p + "hc_attn_fn", {{"hc_mult", (2 + c_.hc_mult) * c_.hc_mult},
                                 {"hidden_size", c_.hc_mult * hidden}}},
             {p + "hc_ffn_fn", {{"hc_mult", (2 + c_.hc_mult) * c_.hc_mult},
                                {"hidden_size", c_.hc_mult * hidden}}},
         }) {
      if (absl::Status s = Tensor(name, dims); !s.ok()) return s;
    }
    // The router's experts: indices [0, n_routed_experts), each [moe_intermediate_size, hidden].
    const std::string e = p + "ffn.experts.";
    std::set<int64_t> experts;
    for (auto it = shapes_.lower_bound(e); it != shapes_.end() && it->first.rfind(e, 0) == 0;
         ++it) {
      const int64_t index = IndexAfter(it->first, e);
      if (index < 0 || index >= c_.n_routed_experts) {
        return absl::InvalidArgumentError(absl::StrCat(
            path_, ": field \"n_routed_experts\" is ", c_.n_routed_experts, ", but ", p,
            "ffn.experts holds an expert outside [0, ", c_.n_routed_experts, ")"));
      }
      experts.insert(index);
    }
    if (!experts.empty() && static_cast<int64_t>(experts.size()) != c_.n_routed_experts) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ": field \"n_routed_experts\" is ", c_.n_routed_experts, ", but ", p,
          "ffn.experts holds ", experts.size(), " experts"));
    }
    for (int64_t x : experts) {
      const std::string m = absl::StrCat(e, x, ".");
      const int64_t inter = c_.moe_intermediate_size;
      for (const char* w : {"w1", "w3"}) {
        if (absl::Status s = Linear(m + w, "moe_intermediate_size", inter, "hidden_size", hidden);
            !s.ok()) {
          return s;
        }
      }
      if (absl::Status s = Linear(m + "w2", "hidden_size", hidden, "moe_intermediate_size", inter);
          !s.ok()) {
        return s;
      }
    }
    const int64_t shared = c_.n_shared_experts * c_.moe_intermediate_size;
    const std::string sh = p + "ffn.shared_experts.";
    for (const char* w : {"w1", "w3"}) {
      if (absl::Status s = Linear(sh + w, "n_shared_experts", shared, "hidden_size", hidden);
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = Linear(sh + "w2", "hidden_size", hidden, "n_shared_experts", shared);
        !s.ok()) {
      return s;
    }
    if (c_.IsHashLayer(layer) && !Has(p + "ffn.gate.tid2eid")) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": field \"num_hash_layers\" is ",
                                                     c_.num_hash_layers, ", but ", p,
                                                     "ffn.gate.tid2eid is absent"));
    }
    // A compressor exactly where compress_ratios says, its ape one row per compressed position.
    const int64_t ratio = c_.CompressRatio(layer);
    const std::string ape = a + "compressor.ape";
    if (ratio == 0 && Has(ape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ": field \"compress_ratios\" gives ", p, " ratio 0, but ", ape, " is present"));
    }
    if (ratio != 0) {
      if (!Has(ape)) {
        return absl::InvalidArgumentError(absl::StrCat(path_, ": field \"compress_ratios\" gives ",
                                                       p, " ratio ", ratio, ", but ", ape,
                                                       " is absent"));
      }
      const std::vector<int64_t>& shape = *shapes_.at(ape);
      if (shape.empty() || shape[0] != ratio) {
        return Mismatch("compress_ratios", ratio, ape, ShapeString(shape));
      }
    }
    return Linear(a + "indexer.wq_b", "index_n_heads", c_.index_n_heads * c_.index_head_dim,
                  "q_lora_rank", c_.q_lora_rank);
  }

 private:
  const V4Config& c_;
  const std::string& path_;
  std::map<std::string, const std::vector<int64_t>*> shapes_;  // by tensor name
  std::map<std::string, const LinearModule*> linears_;         // by module name
};

}  // namespace

absl::Status CheckV4ConfigAgainstTensors(const V4Config& config, const TensorInventory& inventory,
                                         const std::string& config_path) {
  const Checker check(config, inventory, config_path);
  std::set<int64_t> layers;
  for (const auto& [name, shape] : check.shapes()) {
    const int64_t layer = IndexAfter(name, "layers.");
    if (layer >= 0) layers.insert(layer);
  }
  const int64_t claimed = config.num_hidden_layers;
  const int64_t present = static_cast<int64_t>(layers.size());
  if (present != claimed || (present > 0 && *layers.rbegin() != present - 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        config_path, ": field \"num_hidden_layers\" is ", claimed, ", but the checkpoint has "
        "tensors of ", present, " decoder layers",
        present == 0 ? std::string()
                     : absl::StrCat(" (layers.", *layers.begin(), " to layers.", *layers.rbegin(),
                                    ")")));
  }
  for (int64_t layer = 0; layer < claimed; ++layer) {
    if (absl::Status s = check.Block(absl::StrCat("layers.", layer, "."), layer); !s.ok()) {
      return s;
    }
  }
  if (check.Has("mtp.0.attn_norm.weight")) {
    if (absl::Status s = check.Block("mtp.0.", claimed); !s.ok()) return s;
  }
  for (const auto& [name, dims] :
       std::vector<std::pair<std::string, std::vector<std::pair<const char*, int64_t>>>>{
           {"embed.weight", {{"vocab_size", config.vocab_size}, {"hidden_size", config.hidden_size}}},
           {"head.weight", {{"vocab_size", config.vocab_size}, {"hidden_size", config.hidden_size}}},
           {"norm.weight", {{"hidden_size", config.hidden_size}}},
       }) {
    if (absl::Status s = check.Tensor(name, dims); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace quantd::model
