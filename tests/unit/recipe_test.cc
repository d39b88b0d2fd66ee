// Recipes over the tiny fixtures: exact module lists, fusion groups, exclusion reasons, globs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/fixture/fixture.h"
#include "server/pipeline/recipe.h"

namespace quantd::pipeline {

using checkpoint::BuildInventory;
using checkpoint::LinearModule;
using checkpoint::ModelArch;
using checkpoint::NaturalLess;
using checkpoint::TensorFormat;
using checkpoint::TensorInventory;

namespace {

namespace fs = std::filesystem;
using Strings = std::vector<std::string>;
using Groups = std::vector<Strings>;

// One tiny fixture per architecture for the whole suite.
class RecipeTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    v4_ = new TensorInventory(Build(fixture::Arch::kDeepseekV4, "v4"));
    v3_ = new TensorInventory(Build(fixture::Arch::kDeepseekV3, "v3"));
  }
  static void TearDownTestSuite() {
    delete v4_;
    delete v3_;
    for (const char* tag : {"v4", "v3"}) fs::remove_all(Dir(tag));
  }

  static std::string Dir(const std::string& tag) {
    return (fs::path(testing::TempDir()) / absl::StrCat("recipe_test_", tag, "_", getpid()))
        .string();
  }
  static TensorInventory Build(fixture::Arch arch, const std::string& tag) {
    const std::string dir = Dir(tag);
    fs::remove_all(dir);
    absl::StatusOr<fixture::FixtureSummary> s =
        fixture::WriteFixture(fixture::MakeConfig(arch, fixture::Preset::kTiny), 1, dir, {});
    EXPECT_TRUE(s.ok()) << s.status();
    absl::StatusOr<std::unique_ptr<checkpoint::CheckpointDir>> c =
        checkpoint::CheckpointDir::Open(dir);
    EXPECT_TRUE(c.ok()) << c.status();
    absl::StatusOr<TensorInventory> inv = BuildInventory(**c);
    EXPECT_TRUE(inv.ok()) << inv.status();
    return std::move(*inv);
  }

  static RecipePlan Plan(const TensorInventory& inv, const std::string& name,
                         int revision = job::kRecipeRevision) {
    absl::StatusOr<Recipe> r = BuiltinRecipe(name, inv, revision);
    EXPECT_TRUE(r.ok()) << r.status();
    absl::StatusOr<RecipePlan> p = PlanRecipe(inv, *r);
    EXPECT_TRUE(p.ok()) << p.status();
    return std::move(*p);
  }

  static TensorInventory* v4_;  // tiny V4 fixture (3 layers + MTP, 8 experts)
  static TensorInventory* v3_;  // tiny V3 fixture (dense layer 0, MoE layers 1-2, MTP layer 3)
};
TensorInventory* RecipeTest::v4_ = nullptr;
TensorInventory* RecipeTest::v3_ = nullptr;

TEST(GlobTest, StarCrossesDots) {
  EXPECT_TRUE(GlobMatch("*.attn.*", "layers.0.attn.wq_a"));
  EXPECT_TRUE(GlobMatch("*.attn.*", "mtp.0.attn.indexer.compressor.wkv"));
  EXPECT_FALSE(GlobMatch("*.attn.*", "layers.0.attn"));
  EXPECT_FALSE(GlobMatch("*.attn.*", "layers.0.attn_norm"));
  EXPECT_TRUE(GlobMatch("head", "head"));
  EXPECT_FALSE(GlobMatch("head", "mtp.0.head"));
  EXPECT_FALSE(GlobMatch("head", "heads"));
  EXPECT_TRUE(GlobMatch("mtp.*", "mtp.0.ffn.experts.3.w1"));
  EXPECT_TRUE(GlobMatch("layers.?.ffn.*", "layers.1.ffn.gate"));
  EXPECT_FALSE(GlobMatch("layers.?.ffn.*", "layers.10.ffn.gate"));
  EXPECT_TRUE(GlobMatch("*", ""));
  EXPECT_TRUE(GlobMatch("a*b*c", "abc"));
  EXPECT_TRUE(GlobMatch("a*b*c", "aXbYbc"));
  EXPECT_FALSE(GlobMatch("a*b*c", "acb"));
  EXPECT_TRUE(GlobMatch("*ab", "aab"));
  EXPECT_TRUE(GlobMatch("**x", "yx"));
}

TEST(GlobTest, GroupedOutputProjectionIsAnyAttnWoA) {
  EXPECT_TRUE(IsGroupedOutputProjection("layers.3.attn.wo_a"));
  EXPECT_TRUE(IsGroupedOutputProjection("mtp.0.attn.wo_a"));
  EXPECT_FALSE(IsGroupedOutputProjection("layers.3.attn.wo_b"));
  EXPECT_FALSE(IsGroupedOutputProjection("layers.3.attn.wo_a.x"));
  EXPECT_FALSE(IsGroupedOutputProjection("wo_a"));
}

TEST(NaturalOrderTest, NumbersCompareByValue) {
  EXPECT_TRUE(NaturalLess("layers.2.x", "layers.10.x"));
  EXPECT_FALSE(NaturalLess("layers.10.x", "layers.2.x"));
  EXPECT_TRUE(NaturalLess("layers.1", "layers.1.a"));
  EXPECT_TRUE(NaturalLess("a.007", "a.8"));
  EXPECT_FALSE(NaturalLess("a.7", "a.7"));
  EXPECT_TRUE(NaturalLess("w1", "w2"));
}

TEST_F(RecipeTest, V4ExpertsIsRoutedExpertsOfMainLayers) {
  const RecipePlan p = Plan(*v4_, "experts");
  Strings want;
  Groups groups;
  for (int l = 0; l < 3; ++l) {
    for (int e = 0; e < 8; ++e) {
      const std::string m = absl::StrCat("layers.", l, ".ffn.experts.", e, ".");
      want.insert(want.end(), {m + "w1", m + "w2", m + "w3"});
      groups.push_back({m + "w1", m + "w3"});
    }
  }
  EXPECT_EQ(p.modules, want);
  EXPECT_EQ(p.fusion_groups, groups);
  // Each expert linear: I8 [128,128] or [256,64] (16384 B) + E8M0 [128,8] or [256,4] (1024 B).
  EXPECT_EQ(p.bytes, 72u * 17408u);
  // attention: 5 per block x 4 blocks + compressors (2 x 2) + indexer (4) = 28 (the MTP block's
  // attention matches *.attn.* first); shared experts 3 x 4; mtp: e_proj, h_proj, gate and 24
  // experts; not selected: embed and the 3 main routers.
  const std::map<std::string, int64_t> excluded = {
      {"attention", 28}, {"shared expert", 12}, {"head", 1}, {"mtp", 27}, {"not selected", 4}};
  EXPECT_EQ(p.excluded, excluded);
}

TEST_F(RecipeTest, V4FullIsAttentionSharedAndRoutedExpertsButNotTheGroupedOutputA) {
  const RecipePlan p = Plan(*v4_, "full");
  Strings want;
  Groups groups;
  for (int l = 0; l < 3; ++l) {
    const std::string a = absl::StrCat("layers.", l, ".attn.");
    want.insert(want.end(), {a + "wkv", a + "wo_b", a + "wq_a", a + "wq_b"});
    groups.push_back({a + "wq_a", a + "wkv"});
    for (int e = 0; e < 8; ++e) {
      const std::string m = absl::StrCat("layers.", l, ".ffn.experts.", e, ".");
      want.insert(want.end(), {m + "w1", m + "w2", m + "w3"});
      groups.push_back({m + "w1", m + "w3"});
    }
    const std::string s = absl::StrCat("layers.", l, ".ffn.shared_experts.");
    want.insert(want.end(), {s + "w1", s + "w2", s + "w3"});
    groups.push_back({s + "w1", s + "w3"});
  }
  EXPECT_EQ(p.modules, want);
  EXPECT_EQ(p.fusion_groups, groups);
  // Per layer FP8 (weight + E8M0 scale bytes): wq_a [128,256] 32768+2, wq_b [512,128] 65536+4,
  // wkv [128,256] 32768+2, wo_b [256,256] 65536+4; shared w1/w3 [128,256] and w2 [256,128]
  // 32768+2 each.
  const uint64_t attention = 32770 + 65540 + 32770 + 65540;
  const uint64_t shared = 3 * 32770;
  EXPECT_EQ(p.bytes, 3 * (attention + shared + 24 * 17408));
  const std::map<std::string, int64_t> excluded = {
      {"mtp", 35},        {"embedding", 1},  {"head", 1},
      {"router gate", 3}, {"compressor", 4}, {"indexer", 4},
      {"grouped output projection", 3}};
  EXPECT_EQ(p.excluded, excluded);
}

TEST_F(RecipeTest, V4FullRevision1AlsoQuantizesTheGroupedOutputA) {
  const RecipePlan current = Plan(*v4_, "full");
  const RecipePlan p = Plan(*v4_, "full", 1);
  Strings want = current.modules;
  for (int l = 0; l < 3; ++l) want.push_back(absl::StrCat("layers.", l, ".attn.wo_a"));
  std::sort(want.begin(), want.end(), checkpoint::NaturalLess);
  EXPECT_EQ(p.modules, want);
  EXPECT_EQ(p.fusion_groups, current.fusion_groups);
  // wo_a [256,256] FP8: 65536 + 4 scale bytes per layer.
  EXPECT_EQ(p.bytes, current.bytes + 3 * 65540);
  const std::map<std::string, int64_t> excluded = {
      {"mtp", 35},        {"embedding", 1},  {"head", 1},
      {"router gate", 3}, {"compressor", 4}, {"indexer", 4}};
  EXPECT_EQ(p.excluded, excluded);
  // `experts` and the V3 recipes are the same in both revisions.
  EXPECT_EQ(Plan(*v4_, "experts", 1).modules, Plan(*v4_, "experts").modules);
  EXPECT_EQ(Plan(*v3_, "full", 1).modules, Plan(*v3_, "full").modules);
}

TEST_F(RecipeTest, UnknownRecipeRevisionsAreRefused) {
  for (int revision : {0, job::kRecipeRevision + 1}) {
    absl::StatusOr<Recipe> r = BuiltinRecipe("full", *v4_, revision);
    ASSERT_FALSE(r.ok()) << revision;
    EXPECT_EQ(r.status().message(),
              absl::StrCat("unknown recipe revision ", revision, " (expected 1 to 2)"));
  }
}

TEST_F(RecipeTest, V3ExpertsAndFull) {
  const RecipePlan experts = Plan(*v3_, "experts");
  Strings want;
  Groups groups;
  for (int l = 1; l < 3; ++l) {
    for (int e = 0; e < 8; ++e) {
      const std::string m = absl::StrCat("model.layers.", l, ".mlp.experts.", e, ".");
      want.insert(want.end(), {m + "down_proj", m + "gate_proj", m + "up_proj"});
      groups.push_back({m + "gate_proj", m + "up_proj"});
    }
  }
  EXPECT_EQ(experts.modules, want);
  EXPECT_EQ(experts.fusion_groups, groups);
  // mtp = layer 3: eh_proj, 5 attention, gate, 24 experts, 3 shared, shared_head.head = 35 + the
  // MTP embedding is a 2-D weight too = 36.
  const std::map<std::string, int64_t> excluded = {{"mtp", 36},
                                                   {"attention", 15},
                                                   {"shared expert", 6},
                                                   {"head", 1},
                                                   {"not selected", 6}};
  EXPECT_EQ(experts.excluded, excluded);

  const RecipePlan full = Plan(*v3_, "full");
  EXPECT_EQ(full.modules.size(), 72u);
  EXPECT_EQ(full.modules.front(), "model.layers.0.mlp.down_proj");
  EXPECT_EQ(full.modules.back(), "model.layers.2.self_attn.q_b_proj");
  Groups full_groups = {{"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"},
                        {"model.layers.0.self_attn.q_a_proj",
                         "model.layers.0.self_attn.kv_a_proj_with_mqa"}};
  for (int l = 1; l < 3; ++l) {
    for (int e = 0; e < 8; ++e) {
      const std::string m = absl::StrCat("model.layers.", l, ".mlp.experts.", e, ".");
      full_groups.push_back({m + "gate_proj", m + "up_proj"});
    }
    const std::string s = absl::StrCat("model.layers.", l, ".mlp.shared_experts.");
    full_groups.push_back({s + "gate_proj", s + "up_proj"});
    const std::string a = absl::StrCat("model.layers.", l, ".self_attn.");
    full_groups.push_back({a + "q_a_proj", a + "kv_a_proj_with_mqa"});
  }
  EXPECT_EQ(full.fusion_groups, full_groups);
  const std::map<std::string, int64_t> full_excluded = {
      {"mtp", 36}, {"embedding", 1}, {"head", 1}, {"router gate", 2}};
  EXPECT_EQ(full.excluded, full_excluded);
}

TEST_F(RecipeTest, GlobRecipeExcludesWin) {
  const Recipe r = GlobRecipe({"layers.1.*"}, {"*.ffn.experts.*", "*.compressor.*", "*.indexer.*"});
  absl::StatusOr<RecipePlan> p = PlanRecipe(*v4_, r);
  ASSERT_TRUE(p.ok()) << p.status();
  const Strings want = {"layers.1.attn.wkv",
                        "layers.1.attn.wo_a",
                        "layers.1.attn.wo_b",
                        "layers.1.attn.wq_a",
                        "layers.1.attn.wq_b",
                        "layers.1.ffn.gate",
                        "layers.1.ffn.shared_experts.w1",
                        "layers.1.ffn.shared_experts.w2",
                        "layers.1.ffn.shared_experts.w3"};
  EXPECT_EQ(p->modules, want);
  const Groups groups = {{"layers.1.attn.wq_a", "layers.1.attn.wkv"},
                         {"layers.1.ffn.shared_experts.w1", "layers.1.ffn.shared_experts.w3"}};
  EXPECT_EQ(p->fusion_groups, groups);
  // 144 linear modules: 96 experts; compressors 4 + indexer compressors 2; indexer wq_b and
  // weights_proj; 9 selected; the other 31 match no rule.
  const std::map<std::string, int64_t> excluded = {{"exclude *.ffn.experts.*", 96},
                                                   {"exclude *.compressor.*", 6},
                                                   {"exclude *.indexer.*", 2},
                                                   {"not selected", 31}};
  EXPECT_EQ(p->excluded, excluded);
}

TEST_F(RecipeTest, SplittingAFusedPairIsAnError) {
  absl::StatusOr<RecipePlan> p = PlanRecipe(*v4_, GlobRecipe({"layers.0.attn.wq_a"}, {}));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("layers.0.attn.wq_a"), std::string::npos) << p.status();
  EXPECT_NE(p.status().message().find("layers.0.attn.wkv"), std::string::npos) << p.status();

  p = PlanRecipe(*v4_, GlobRecipe({"*.experts.*"}, {"*.w3"}));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("layers.0.ffn.experts.0.w3"), std::string::npos)
      << p.status();

  p = PlanRecipe(*v3_, GlobRecipe({"*.q_a_proj"}, {}));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("kv_a_proj_with_mqa"), std::string::npos) << p.status();
}

TEST_F(RecipeTest, BuiltinRecipesNeedAKnownArchitecture) {
  TensorInventory other = *v4_;
  other.arch = ModelArch::kUnknown;
  other.model_type = "llama";
  absl::StatusOr<Recipe> r = BuiltinRecipe("experts", other);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("llama"), std::string::npos) << r.status();
  EXPECT_FALSE(BuiltinRecipe("most", *v4_).ok());
}

TEST_F(RecipeTest, InventoryLinearModules) {
  // 13 BF16 (embed, head, 4 routers, 4 main compressor projections, indexer weights_proj and
  // its 2 compressor projections), 35 FP8 and 96 MXFP4 linears.
  std::map<TensorFormat, int> by_format;
  for (const LinearModule& m : v4_->linears) ++by_format[m.format];
  EXPECT_EQ(by_format[TensorFormat::kBf16], 13);
  EXPECT_EQ(by_format[TensorFormat::kFp8BlockE8m0], 35);
  EXPECT_EQ(by_format[TensorFormat::kMxfp4], 96);
  EXPECT_EQ(v4_->linears.size(), 144u);
  for (const LinearModule& m : v4_->linears) {
    if (m.name != "layers.0.ffn.experts.3.w2") continue;
    EXPECT_EQ(m.out_features, 256);
    EXPECT_EQ(m.in_features, 128);  // I8 [256, 64] unpacked
    EXPECT_EQ(m.tensors, (Strings{"layers.0.ffn.experts.3.w2.weight",
                                  "layers.0.ffn.experts.3.w2.scale"}));
    EXPECT_EQ(m.bytes, 17408u);
  }
  EXPECT_EQ(v4_->arch, ModelArch::kDeepseekV4);
  EXPECT_EQ(v3_->arch, ModelArch::kDeepseekV3);
  EXPECT_EQ(v3_->num_hidden_layers, 3);
}

}  // namespace
}  // namespace quantd::pipeline
