#include "server/model/v4_config.h"

#include "absl/strings/str_cat.h"

namespace quantd::model {
namespace {

class Reader {
 public:
  Reader(const nlohmann::json& json, const std::string& source) : json_(json), source_(source) {}

  // A positive integer field (>= min).
  void Int(const char* field, int64_t* out, int64_t min = 1) {
    if (!status_.ok()) return;
    auto it = json_.find(field);
    if (it == json_.end() || !it->is_number_integer() || it->get<int64_t>() < min) {
      status_ = Error(field, absl::StrCat("an integer >= ", min));
      return;
    }
    *out = it->get<int64_t>();
  }
  void Number(const nlohmann::json& obj, const char* field, double* out, bool required) {
    if (!status_.ok()) return;
    auto it = obj.find(field);
    if (it == obj.end() && !required) return;
    if (it == obj.end() || !it->is_number() || !(it->get<double>() >= 0.0)) {
      status_ = Error(field, "a number >= 0");
      return;
    }
    *out = it->get<double>();
  }
  void Number(const char* field, double* out, bool required = true) {
    Number(json_, field, out, required);
  }
  void Float(const char* field, float* out, bool required = true) {
    double v = *out;
    Number(field, &v, required);
    *out = static_cast<float>(v);
  }
  void IntList(const char* field, std::vector<int64_t>* out) {
    if (!status_.ok()) return;
    auto it = json_.find(field);
    if (it == json_.end() || !it->is_array()) {
      status_ = Error(field, "a list of integers");
      return;
    }
    for (const auto& v : *it) {
      if (!v.is_number_integer()) {
        status_ = Error(field, "a list of integers");
        return;
      }
      out->push_back(v.get<int64_t>());
    }
  }
  absl::Status Error(const char* field, const std::string& expected) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": field \"", field, "\" must be ", expected));
  }
  const nlohmann::json& json() const { return json_; }
  absl::Status& status() { return status_; }

 private:
  const nlohmann::json& json_;
  const std::string& source_;
  absl::Status status_;  // the first error
};

}  // namespace

absl::StatusOr<V4Config> ParseV4Config(const nlohmann::json& json, const std::string& source) {
  if (!json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  V4Config c;
  Reader r(json, source);
  r.Int("hidden_size", &c.hidden_size);
  r.Int("num_hidden_layers", &c.num_hidden_layers);
  r.Int("vocab_size", &c.vocab_size);
  r.Int("num_attention_heads", &c.num_attention_heads);
  r.Int("head_dim", &c.head_dim);
  r.Int("qk_rope_head_dim", &c.qk_rope_head_dim);
  r.Int("q_lora_rank", &c.q_lora_rank);
  r.Int("o_groups", &c.o_groups);
  r.Int("o_lora_rank", &c.o_lora_rank);
  r.Int("sliding_window", &c.sliding_window);
  r.Int("index_n_heads", &c.index_n_heads);
  r.Int("index_head_dim", &c.index_head_dim);
  r.Int("index_topk", &c.index_topk);
  r.IntList("compress_ratios", &c.compress_ratios);
  r.Number("rope_theta", &c.rope_theta);
  r.Number("compress_rope_theta", &c.compress_rope_theta);
  r.Int("n_routed_experts", &c.n_routed_experts);
  r.Int("n_shared_experts", &c.n_shared_experts, 0);
  r.Int("num_experts_per_tok", &c.num_experts_per_tok);
  r.Int("moe_intermediate_size", &c.moe_intermediate_size);
  r.Int("num_hash_layers", &c.num_hash_layers, 0);
  r.Float("routed_scaling_factor", &c.routed_scaling_factor);
  r.Float("swiglu_limit", &c.swiglu_limit, /*required=*/false);
  r.Int("hc_mult", &c.hc_mult);
  r.Int("hc_sinkhorn_iters", &c.hc_sinkhorn_iters);
  r.Float("hc_eps", &c.hc_eps);
  r.Float("rms_norm_eps", &c.rms_norm_eps);
  if (!r.status().ok()) return r.status();

  auto scaling = json.find("rope_scaling");
  if (scaling != json.end() && scaling->is_object()) {
    r.Number(*scaling, "factor", &c.rope_factor, true);
    double original = 0.0;
    r.Number(*scaling, "original_max_position_embeddings", &original, true);
    c.original_max_position_embeddings = static_cast<int64_t>(original);
    r.Number(*scaling, "beta_fast", &c.beta_fast, true);
    r.Number(*scaling, "beta_slow", &c.beta_slow, true);
    if (!r.status().ok()) return r.status();
  }

  const int64_t layers = c.num_hidden_layers;
  if (static_cast<int64_t>(c.compress_ratios.size()) == layers) c.compress_ratios.push_back(0);
  if (static_cast<int64_t>(c.compress_ratios.size()) != layers + 1) {
    return r.Error("compress_ratios", absl::StrCat("num_hidden_layers (", layers,
                                                   ") or num_hidden_layers + 1 entries"));
  }
  for (int64_t ratio : c.compress_ratios) {
    if (ratio != 0 && ratio != 4 && ratio != 128) {
      return r.Error("compress_ratios", "a list of 0, 4 and 128");
    }
  }
  if (c.num_attention_heads % c.o_groups != 0) {
    return r.Error("o_groups", "a divisor of num_attention_heads");
  }
  if (c.qk_rope_head_dim > c.head_dim || c.qk_rope_head_dim % 2 != 0) {
    return r.Error("qk_rope_head_dim", "even and at most head_dim");
  }
  if (c.num_experts_per_tok > c.n_routed_experts) {
    return r.Error("num_experts_per_tok", "at most n_routed_experts");
  }
  if (c.hc_mult > 16) return r.Error("hc_mult", "at most 16");
  return c;
}

}  // namespace quantd::model
