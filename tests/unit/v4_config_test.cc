// ParseV4Config: the fixture's config.json parses to its FixtureConfig (every shared field, every
// preset), and every malformed field is refused with its name.
#include "server/model/v4_config.h"

#include "gtest/gtest.h"
#include "server/fixture/fixture_spec.h"

namespace quantd::model {
namespace {

nlohmann::json TinyJson() {
  return fixture::ConfigJson(
      fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny));
}

TEST(V4ConfigTest, ParsesTheFixtureConfig) {
  const fixture::FixtureConfig f =
      fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny);
  auto c = ParseV4Config(TinyJson(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hc_sinkhorn_iters, 20);
  EXPECT_FLOAT_EQ(c->routed_scaling_factor, 1.5f);
  EXPECT_FLOAT_EQ(c->swiglu_limit, 10.0f);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_DOUBLE_EQ(c->rope_factor, 16.0);
  EXPECT_EQ(c->original_max_position_embeddings, 65536);
  EXPECT_DOUBLE_EQ(c->compress_rope_theta, 160000.0);
  EXPECT_TRUE(c->IsHashLayer(0));
  EXPECT_FALSE(c->IsHashLayer(f.num_hash_layers));
  EXPECT_EQ(c->CompressRatio(f.num_hidden_layers), 0);  // the MTP block
}

// FixtureConfig (what mkfixture generates) and V4Config (what the forward reads) describe the
// same architecture through config.json: every field they share comes back unchanged, for every
// preset.
TEST(V4ConfigTest, EverySharedFieldOfEveryPresetRoundTrips) {
  for (fixture::Preset preset :
       {fixture::Preset::kTiny, fixture::Preset::kSmall, fixture::Preset::kBench}) {
    const fixture::FixtureConfig f = fixture::MakeConfig(fixture::Arch::kDeepseekV4, preset);
    auto c = ParseV4Config(fixture::ConfigJson(f), "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->hidden_size, f.hidden_size);
    EXPECT_EQ(c->vocab_size, f.vocab_size);
    EXPECT_EQ(c->num_hidden_layers, f.num_hidden_layers);
    EXPECT_EQ(c->num_attention_heads, f.num_attention_heads);
    EXPECT_EQ(c->n_routed_experts, f.n_routed_experts);
    EXPECT_EQ(c->n_shared_experts, f.n_shared_experts);
    EXPECT_EQ(c->num_experts_per_tok, f.num_experts_per_tok);
    EXPECT_EQ(c->moe_intermediate_size, f.moe_intermediate_size);
    EXPECT_EQ(c->q_lora_rank, f.q_lora_rank);
    EXPECT_EQ(c->qk_rope_head_dim, f.qk_rope_head_dim);
    EXPECT_EQ(c->num_hash_layers, f.num_hash_layers);
    EXPECT_EQ(c->compress_ratios, f.compress_ratios);
    EXPECT_EQ(c->head_dim, f.head_dim);
    EXPECT_EQ(c->o_groups, f.o_groups);
    EXPECT_EQ(c->o_lora_rank, f.o_lora_rank);
    EXPECT_EQ(c->sliding_window, f.sliding_window);
    EXPECT_EQ(c->index_n_heads, f.index_n_heads);
    EXPECT_EQ(c->index_head_dim, f.index_head_dim);
    EXPECT_EQ(c->index_topk, f.index_topk);
    EXPECT_EQ(c->hc_mult, f.hc_mult);
  }
}

TEST(V4ConfigTest, AcceptsRatiosWithoutTheMtpEntry) {
  nlohmann::json j = TinyJson();
  j["compress_ratios"] = {0, 4, 128};
  auto c = ParseV4Config(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->compress_ratios, (std::vector<int64_t>{0, 4, 128, 0}));
}

TEST(V4ConfigTest, RefusesMalformedFieldsByName) {
  const std::vector<std::pair<std::string, nlohmann::json>> cases = {
      {"hidden_size", nullptr},           {"hidden_size", "256"},
      {"num_attention_heads", 0},         {"compress_ratios", {0, 4}},
      {"compress_ratios", {0, 4, 64, 0}}, {"o_groups", 3},
      {"qk_rope_head_dim", 1000},         {"num_experts_per_tok", 100},
      {"routed_scaling_factor", -1.0},    {"hc_mult", 64},
  };
  for (const auto& [field, value] : cases) {
    nlohmann::json j = TinyJson();
    if (value.is_null()) {
      j.erase(field);
    } else {
      j[field] = value;
    }
    const absl::Status s = ParseV4Config(j, "ckpt/config.json").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find("ckpt/config.json"), std::string::npos) << s;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
  }
  EXPECT_EQ(ParseV4Config(nlohmann::json::array(), "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace quantd::model
