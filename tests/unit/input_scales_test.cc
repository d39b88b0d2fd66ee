// input_scale resolution: amax / 2688 in float32, shared (max) within fusion groups, routed
// experts without a row filled from their layer's experts of the same projection, every other
// gap or bad value an error naming the module.
#include "server/pipeline/stages/input_scales.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kernels/formats.h"

namespace quantd::pipeline {
namespace {

using formats::FloatBits;

ShardTask Task(std::vector<std::string> modules,
               std::vector<std::vector<std::string>> groups = {}) {
  ShardTask t;
  t.shard = "model-00001-of-00002.safetensors";
  t.modules = std::move(modules);
  t.fusion_groups = std::move(groups);
  return t;
}

TEST(InputScalesTest, ScaleIsAmaxOver2688InFloat32) {
  const std::map<std::string, float> amax = {{"a", 2688.0f}, {"b", 1.5f}, {"c", 1e-30f}};
  auto s = ResolveInputScales(Task({"a", "b", "c"}), &amax);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->scale.at("a"), 1.0f);
  EXPECT_EQ(FloatBits(s->scale.at("b")), FloatBits(1.5f / 2688.0f));
  EXPECT_EQ(FloatBits(s->scale.at("c")), FloatBits(1e-30f / 2688.0f));
  EXPECT_TRUE(s->filled.empty());
}

TEST(InputScalesTest, FusionGroupSharesTheMaxBitForBit) {
  const std::map<std::string, float> amax = {
      {"l.attn.wq_a", 3.0f}, {"l.attn.wkv", 7.0f}, {"l.attn.wo_a", 11.0f}};
  auto s = ResolveInputScales(
      Task({"l.attn.wkv", "l.attn.wo_a", "l.attn.wq_a"}, {{"l.attn.wq_a", "l.attn.wkv"}}), &amax);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(FloatBits(s->scale.at("l.attn.wq_a")), FloatBits(7.0f / 2688.0f));
  EXPECT_EQ(FloatBits(s->scale.at("l.attn.wkv")), FloatBits(7.0f / 2688.0f));
  EXPECT_EQ(FloatBits(s->scale.at("l.attn.wo_a")), FloatBits(11.0f / 2688.0f));
}

TEST(InputScalesTest, MissingRoutedExpertsFillFromTheirLayerAndProjection) {
  // Layer 2 has experts 0 and 2 calibrated; expert 1 has no w1 row and no w2 row. Other layers
  // and shared experts carry larger values that must not leak in.
  const std::map<std::string, float> amax = {
      {"layers.2.ffn.experts.0.w1", 1.0f},       {"layers.2.ffn.experts.0.w3", 1.0f},
      {"layers.2.ffn.experts.0.w2", 10.0f},      {"layers.2.ffn.experts.1.w3", 1.5f},
      {"layers.2.ffn.experts.2.w1", 2.0f},       {"layers.2.ffn.experts.2.w3", 2.5f},
      {"layers.2.ffn.experts.2.w2", 20.0f},      {"layers.3.ffn.experts.0.w1", 100.0f},
      {"layers.3.ffn.experts.0.w2", 200.0f},     {"layers.2.ffn.shared_experts.w1", 300.0f},
      {"layers.2.ffn.shared_experts.w2", 400.0f}};
  auto s = ResolveInputScales(
      Task({"layers.2.ffn.experts.1.w1", "layers.2.ffn.experts.1.w2", "layers.2.ffn.experts.1.w3"},
           {{"layers.2.ffn.experts.1.w1", "layers.2.ffn.experts.1.w3"}}),
      &amax);
  ASSERT_TRUE(s.ok()) << s.status();
  // w1 <- max over the layer's w1/w3 rows (2.5), then shared with w3 (1.5): 2.5.
  EXPECT_EQ(FloatBits(s->scale.at("layers.2.ffn.experts.1.w1")), FloatBits(2.5f / 2688.0f));
  EXPECT_EQ(FloatBits(s->scale.at("layers.2.ffn.experts.1.w3")), FloatBits(2.5f / 2688.0f));
  // w2 <- max over the layer's w2 rows only.
  EXPECT_EQ(FloatBits(s->scale.at("layers.2.ffn.experts.1.w2")), FloatBits(20.0f / 2688.0f));
  EXPECT_EQ(s->filled,
            (std::vector<std::string>{"layers.2.ffn.experts.1.w1", "layers.2.ffn.experts.1.w2"}));
}

TEST(InputScalesTest, V3ExpertNamesFillToo) {
  const std::map<std::string, float> amax = {{"model.layers.1.mlp.experts.0.gate_proj", 4.0f},
                                             {"model.layers.1.mlp.experts.0.up_proj", 5.0f},
                                             {"model.layers.1.mlp.experts.0.down_proj", 6.0f},
                                             {"model.layers.2.mlp.experts.7.up_proj", 50.0f}};
  auto s = ResolveInputScales(
      Task({"model.layers.1.mlp.experts.12.up_proj", "model.layers.1.mlp.experts.12.down_proj"}),
      &amax);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(FloatBits(s->scale.at("model.layers.1.mlp.experts.12.up_proj")),
            FloatBits(5.0f / 2688.0f));
  EXPECT_EQ(FloatBits(s->scale.at("model.layers.1.mlp.experts.12.down_proj")),
            FloatBits(6.0f / 2688.0f));
  EXPECT_EQ(s->filled.size(), 2u);
}

TEST(InputScalesTest, OtherModulesWithoutAmaxFailWithTheirName) {
  const std::map<std::string, float> amax = {{"layers.1.ffn.experts.0.w1", 1.0f},
                                             {"layers.1.attn.wq_a", 1.0f}};
  for (const char* module : {"layers.1.attn.wkv", "layers.1.ffn.shared_experts.w1",
                             "layers.1.ffn.experts.x.w1", "experts.0.w1", "head"}) {
    auto s = ResolveInputScales(Task({"layers.1.attn.wq_a", module}), &amax);
    ASSERT_FALSE(s.ok()) << module;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(std::string("module ") + module + " has no calibrated"),
              std::string::npos)
        << s.status();
  }
}

TEST(InputScalesTest, ExpertWithoutAnyLayerMateFails) {
  const std::map<std::string, float> amax = {{"layers.1.ffn.experts.0.w1", 1.0f},
                                             {"layers.2.ffn.experts.0.w2", 1.0f}};
  auto s = ResolveInputScales(Task({"layers.1.ffn.experts.3.w2"}), &amax);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(),
            "module layers.1.ffn.experts.3.w2 has no calibrated input amax, and no expert of "
            "layers.1.ffn has one for its down projection to fill it from");
}

TEST(InputScalesTest, NoTableNamesTheFirstModule) {
  auto s = ResolveInputScales(Task({"layers.1.attn.wq_a", "layers.1.attn.wkv"}), nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(),
            "module layers.1.attn.wq_a has no calibrated input amax (no amax table was given)");
}

TEST(InputScalesTest, NonFiniteOrNonPositiveAmaxIsRejected) {
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    const std::map<std::string, float> amax = {{"a", bad}};
    auto s = ResolveInputScales(Task({"a"}), &amax);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.status().message().find("input amax of module a is"), std::string::npos);
  }
  // A bad row of another expert is caught when it would feed a fill.
  const std::map<std::string, float> amax = {
      {"layers.1.ffn.experts.0.w2", std::numeric_limits<float>::quiet_NaN()}};
  auto s = ResolveInputScales(Task({"layers.1.ffn.experts.1.w2"}), &amax);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("module layers.1.ffn.experts.0.w2"), std::string::npos);
}

TEST(InputScalesTest, GroupMemberOutsideTheTaskIsRejected) {
  const std::map<std::string, float> amax = {{"a.w1", 1.0f}, {"a.w3", 1.0f}};
  auto s = ResolveInputScales(Task({"a.w1"}, {{"a.w1", "a.w3"}}), &amax);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("a.w3 is not a module of task"), std::string::npos);
}

}  // namespace
}  // namespace quantd::pipeline
