// quantd mkfixture: determinism, the exact tensor set of reference §2 / §6 for the tiny presets,
// and DeepSeek's encodings (scales re-derived from the generated floats, codes re-encoded).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "kernels/formats.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/fixture/fixture.h"
#include "server/fixture/fixture_spec.h"
#include "server/fixture/random.h"
#include "server/fixture/weights.h"
#include "tests/unit/test_dirs.h"

namespace quantd::fixture {
namespace {

namespace fs = std::filesystem;
using checkpoint::CheckpointDir;
using checkpoint::Dtype;
using checkpoint::TensorView;

using testing_util::TestDir;

std::string WriteTiny(Arch arch, uint64_t seed, const std::string& tag) {
  const std::string dir = TestDir(tag);
  absl::StatusOr<FixtureSummary> s = WriteFixture(MakeConfig(arch, Preset::kTiny), seed, dir, {});
  EXPECT_TRUE(s.ok()) << s.status();
  return dir;
}

// file name -> contents, for every file of a directory.
std::map<std::string, std::string> ReadAll(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    files[e.path().filename().string()] = ss.str();
  }
  return files;
}

std::unique_ptr<CheckpointDir> Open(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<CheckpointDir>> c = CheckpointDir::Open(dir);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

class FixtureArchTest : public testing::TestWithParam<Arch> {};

TEST_P(FixtureArchTest, SameSeedGivesIdenticalBytes) {
  const auto a = ReadAll(WriteTiny(GetParam(), 7, "a"));
  const auto b = ReadAll(WriteTiny(GetParam(), 7, "b"));
  const auto c = ReadAll(WriteTiny(GetParam(), 8, "c"));
  // >= 2 shards + index + config + generation config + tokenizer + tokenizer config
  ASSERT_GE(a.size(), 7u);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), c.size());
  EXPECT_EQ(a.at("config.json"), c.at("config.json"));
  EXPECT_EQ(a.at("tokenizer.json"), c.at("tokenizer.json"));
  int differing_shards = 0;
  for (const auto& [name, bytes] : a) {
    if (name.find(".safetensors") != std::string::npos && name.find("index") == std::string::npos) {
      differing_shards += bytes != c.at(name);
    }
  }
  EXPECT_EQ(differing_shards, static_cast<int>(a.size()) - 5);
}

TEST_P(FixtureArchTest, IndexCoversEveryTensorAndShardsAreSmall) {
  const std::string dir = WriteTiny(GetParam(), 1, "x");
  std::unique_ptr<CheckpointDir> c = Open(dir);
  ASSERT_NE(c, nullptr);
  EXPECT_GE(c->shards().size(), 2u);
  absl::StatusOr<checkpoint::ShardIndex> index =
      checkpoint::ParseShardIndex(dir + "/model.safetensors.index.json");
  ASSERT_TRUE(index.ok()) << index.status();
  uint64_t total = 0, files = 0;
  size_t tensors = 0;
  for (const auto& shard : c->shards()) {
    for (const TensorView& v : shard->tensors()) total += v.size;
    tensors += shard->tensors().size();
    files += shard->file_size();
  }
  EXPECT_EQ(index->total_size, total);
  EXPECT_EQ(index->weight_map.size(), tensors);
  EXPECT_LT(files, 12u << 20);  // "a handful of MB"
}

INSTANTIATE_TEST_SUITE_P(Archs, FixtureArchTest,
                         testing::Values(Arch::kDeepseekV4, Arch::kDeepseekV3));

using Expected = std::map<std::string, std::pair<Dtype, std::vector<int64_t>>>;

// Reference §2 for the tiny V4 preset (hidden 256, vocab 1024, 3 layers with compress ratios
// 0/4/128, hash layer 0, 4 heads of 128, q_lora 128, 2 output groups of 128, indexer 2 heads of
// 128, 8 experts of width 128, top-2, hc_mult 4), written out from the table.
Expected TinyV4Expected() {
  Expected e;
  const auto fp8 = [&](const std::string& m, int64_t out, int64_t in) {
    e[m + ".weight"] = {Dtype::kF8E4M3, {out, in}};
    e[m + ".scale"] = {Dtype::kF8E8M0, {(out + 127) / 128, (in + 127) / 128}};
  };
  const auto fp4 = [&](const std::string& m, int64_t out, int64_t in) {
    e[m + ".weight"] = {Dtype::kI8, {out, in / 2}};
    e[m + ".scale"] = {Dtype::kF8E8M0, {out, in / 32}};
  };
  const auto bf16 = [&](const std::string& n, std::vector<int64_t> s) {
    e[n] = {Dtype::kBF16, std::move(s)};
  };
  const auto f32 = [&](const std::string& n, std::vector<int64_t> s) {
    e[n] = {Dtype::kF32, std::move(s)};
  };
  const auto block = [&](const std::string& p, int ratio, bool hash) {
    for (const char* w : {"attn", "ffn"}) {
      f32(p + "hc_" + w + "_fn", {24, 1024});
      f32(p + "hc_" + w + "_base", {24});
      f32(p + "hc_" + w + "_scale", {3});
    }
    bf16(p + "attn_norm.weight", {256});
    bf16(p + "ffn_norm.weight", {256});
    fp8(p + "attn.wq_a", 128, 256);
    bf16(p + "attn.q_norm.weight", {128});
    fp8(p + "attn.wq_b", 512, 128);
    fp8(p + "attn.wkv", 128, 256);
    bf16(p + "attn.kv_norm.weight", {128});
    fp8(p + "attn.wo_a", 256, 256);
    fp8(p + "attn.wo_b", 256, 256);
    f32(p + "attn.attn_sink", {4});
    if (ratio == 4) {
      f32(p + "attn.compressor.ape", {4, 256});
      bf16(p + "attn.compressor.wkv.weight", {256, 256});
      bf16(p + "attn.compressor.wgate.weight", {256, 256});
      bf16(p + "attn.compressor.norm.weight", {128});
      fp8(p + "attn.indexer.wq_b", 256, 128);
      bf16(p + "attn.indexer.weights_proj.weight", {2, 256});
      f32(p + "attn.indexer.compressor.ape", {4, 256});
      bf16(p + "attn.indexer.compressor.wkv.weight", {256, 256});
      bf16(p + "attn.indexer.compressor.wgate.weight", {256, 256});
      bf16(p + "attn.indexer.compressor.norm.weight", {128});
    } else if (ratio == 128) {
      f32(p + "attn.compressor.ape", {128, 128});
      bf16(p + "attn.compressor.wkv.weight", {128, 256});
      bf16(p + "attn.compressor.wgate.weight", {128, 256});
      bf16(p + "attn.compressor.norm.weight", {128});
    }
    bf16(p + "ffn.gate.weight", {8, 256});
    if (hash) {
      e[p + "ffn.gate.tid2eid"] = {Dtype::kI64, {1024, 2}};
    } else {
      f32(p + "ffn.gate.bias", {8});
    }
    for (int x = 0; x < 8; ++x) {
      const std::string ep = absl::StrCat(p, "ffn.experts.", x, ".");
      fp4(ep + "w1", 128, 256);
      fp4(ep + "w2", 256, 128);
      fp4(ep + "w3", 128, 256);
    }
    fp8(p + "ffn.shared_experts.w1", 128, 256);
    fp8(p + "ffn.shared_experts.w2", 256, 128);
    fp8(p + "ffn.shared_experts.w3", 128, 256);
  };
  bf16("embed.weight", {1024, 256});
  bf16("head.weight", {1024, 256});
  bf16("norm.weight", {256});
  f32("hc_head_fn", {4, 1024});
  f32("hc_head_base", {4});
  f32("hc_head_scale", {1});
  block("layers.0.", 0, true);
  block("layers.1.", 4, false);
  block("layers.2.", 128, false);
  block("mtp.0.", 0, false);
  fp8("mtp.0.e_proj", 256, 256);
  fp8("mtp.0.h_proj", 256, 256);
  bf16("mtp.0.enorm.weight", {256});
  bf16("mtp.0.hnorm.weight", {256});
  bf16("mtp.0.norm.weight", {256});
  f32("mtp.0.hc_head_fn", {4, 1024});
  f32("mtp.0.hc_head_base", {4});
  f32("mtp.0.hc_head_scale", {1});
  return e;
}

// Reference §6 naming for the tiny V3 preset (hidden 320, vocab 1000, 3 layers with layer 0
// dense, MTP = layer 3, 2 heads, q_lora 192, kv_lora 512, nope/rope/v 128/64/128, dense width 448,
// 8 experts of width 160). Dimensions that are not multiples of 128 give partial scale blocks.
Expected TinyV3Expected() {
  Expected e;
  const auto fp8 = [&](const std::string& m, int64_t out, int64_t in) {
    e[m + ".weight"] = {Dtype::kF8E4M3, {out, in}};
    e[m + ".weight_scale_inv"] = {Dtype::kF32, {(out + 127) / 128, (in + 127) / 128}};
  };
  const auto bf16 = [&](const std::string& n, std::vector<int64_t> s) {
    e[n] = {Dtype::kBF16, std::move(s)};
  };
  const auto layer = [&](const std::string& p, bool dense) {
    bf16(p + "input_layernorm.weight", {320});
    bf16(p + "post_attention_layernorm.weight", {320});
    fp8(p + "self_attn.q_a_proj", 192, 320);
    bf16(p + "self_attn.q_a_layernorm.weight", {192});
    fp8(p + "self_attn.q_b_proj", 384, 192);
    fp8(p + "self_attn.kv_a_proj_with_mqa", 576, 320);
    bf16(p + "self_attn.kv_a_layernorm.weight", {512});
    fp8(p + "self_attn.kv_b_proj", 512, 512);
    fp8(p + "self_attn.o_proj", 320, 256);
    if (dense) {
      fp8(p + "mlp.gate_proj", 448, 320);
      fp8(p + "mlp.up_proj", 448, 320);
      fp8(p + "mlp.down_proj", 320, 448);
      return;
    }
    bf16(p + "mlp.gate.weight", {8, 320});
    e[p + "mlp.gate.e_score_correction_bias"] = {Dtype::kF32, {8}};
    for (int x = 0; x < 8; ++x) {
      const std::string ep = absl::StrCat(p, "mlp.experts.", x, ".");
      fp8(ep + "gate_proj", 160, 320);
      fp8(ep + "up_proj", 160, 320);
      fp8(ep + "down_proj", 320, 160);
    }
    fp8(p + "mlp.shared_experts.gate_proj", 160, 320);
    fp8(p + "mlp.shared_experts.up_proj", 160, 320);
    fp8(p + "mlp.shared_experts.down_proj", 320, 160);
  };
  bf16("model.embed_tokens.weight", {1000, 320});
  bf16("model.norm.weight", {320});
  bf16("lm_head.weight", {1000, 320});
  layer("model.layers.0.", true);
  layer("model.layers.1.", false);
  layer("model.layers.2.", false);
  layer("model.layers.3.", false);
  bf16("model.layers.3.embed_tokens.weight", {1000, 320});
  bf16("model.layers.3.enorm.weight", {320});
  bf16("model.layers.3.hnorm.weight", {320});
  fp8("model.layers.3.eh_proj", 320, 640);
  bf16("model.layers.3.shared_head.norm.weight", {320});
  bf16("model.layers.3.shared_head.head.weight", {1000, 320});
  return e;
}

Expected Actual(const CheckpointDir& c) {
  Expected a;
  for (const auto& shard : c.shards()) {
    for (const TensorView& v : shard->tensors()) a[v.name] = {v.dtype, v.shape};
  }
  return a;
}

TEST(FixtureTest, TinyV4HasExactlyTheReferenceTensors) {
  std::unique_ptr<CheckpointDir> c = Open(WriteTiny(Arch::kDeepseekV4, 1, "v4"));
  ASSERT_NE(c, nullptr);
  const Expected want = TinyV4Expected(), got = Actual(*c);
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [name, spec] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << "missing " << name;
    EXPECT_EQ(it->second.first, spec.first) << name;
    EXPECT_EQ(it->second.second, spec.second) << name;
  }
  for (const auto& [name, spec] : got) EXPECT_EQ(want.count(name), 1u) << "unexpected " << name;
}

TEST(FixtureTest, TinyV3HasExactlyTheReferenceTensors) {
  std::unique_ptr<CheckpointDir> c = Open(WriteTiny(Arch::kDeepseekV3, 1, "v3"));
  ASSERT_NE(c, nullptr);
  const Expected want = TinyV3Expected(), got = Actual(*c);
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [name, spec] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << "missing " << name;
    EXPECT_EQ(it->second.first, spec.first) << name;
    EXPECT_EQ(it->second.second, spec.second) << name;
  }
  for (const auto& [name, spec] : got) EXPECT_EQ(want.count(name), 1u) << "unexpected " << name;
  // The real model's partial-block case: [576, hidden] with 5 scale rows.
  EXPECT_EQ(got.at("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv").second,
            (std::vector<int64_t>{5, 3}));
}

TEST(FixtureTest, V4ConfigHasEveryReferenceField) {
  const nlohmann::json j = ConfigJson(MakeConfig(Arch::kDeepseekV4, Preset::kTiny));
  for (const char* key :
       {"architectures", "model_type", "hidden_size", "num_hidden_layers",
        "num_nextn_predict_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
        "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "compress_ratios",
        "compress_rope_theta", "rope_theta", "rope_scaling", "max_position_embeddings",
        "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
        "num_hash_layers", "scoring_func", "topk_method", "norm_topk_prob",
        "routed_scaling_factor", "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
        "rms_norm_eps", "hidden_act", "tie_word_embeddings", "torch_dtype", "expert_dtype",
        "quantization_config"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"DeepseekV4ForCausalLM"}));
  EXPECT_EQ(j["compress_ratios"], nlohmann::json::array({0, 4, 128, 0}));
  EXPECT_EQ(j["num_hash_layers"], 1);
  EXPECT_EQ(j["expert_dtype"], "fp4");
  EXPECT_EQ(j["quantization_config"],
            nlohmann::json::parse(R"({"activation_scheme":"dynamic","fmt":"e4m3",
              "quant_method":"fp8","scale_fmt":"ue8m0","weight_block_size":[128,128]})"));
  EXPECT_EQ(j["compress_ratios"].size(), j["num_hidden_layers"].get<size_t>() + 1);
}

const FixtureTensor& FindSpec(const std::vector<FixtureTensor>& ts, const std::string& name) {
  for (const FixtureTensor& t : ts) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no fixture tensor " << name;
  return ts.front();
}

// §1's table, field by field.
TEST(FixtureTest, ProAndFlashPresetsHaveTheReferenceDimensions) {
  const FixtureConfig pro = MakeConfig(Arch::kDeepseekV4, Preset::kPro);
  const FixtureConfig flash = MakeConfig(Arch::kDeepseekV4, Preset::kFlash);
  EXPECT_EQ(pro.hidden_size, 7168);
  EXPECT_EQ(flash.hidden_size, 4096);
  EXPECT_EQ(pro.num_attention_heads, 128);
  EXPECT_EQ(flash.num_attention_heads, 64);
  EXPECT_EQ(pro.q_lora_rank, 1536);
  EXPECT_EQ(flash.q_lora_rank, 1024);
  EXPECT_EQ(pro.o_groups, 16);
  EXPECT_EQ(flash.o_groups, 8);
  EXPECT_EQ(pro.index_topk, 1024);
  EXPECT_EQ(flash.index_topk, 512);
  EXPECT_EQ(pro.n_routed_experts, 384);
  EXPECT_EQ(flash.n_routed_experts, 256);
  EXPECT_EQ(pro.moe_intermediate_size, 3072);
  EXPECT_EQ(flash.moe_intermediate_size, 2048);
  EXPECT_EQ(pro.routed_scaling_factor, 2.5);
  EXPECT_EQ(flash.routed_scaling_factor, 1.5);
  EXPECT_EQ(pro.compress_ratios, (std::vector<int64_t>{128, 0}));
  EXPECT_EQ(flash.compress_ratios, (std::vector<int64_t>{0, 0}));
  for (const FixtureConfig& c : {pro, flash}) {
    EXPECT_EQ(c.arch, Arch::kDeepseekV4);
    EXPECT_EQ(c.shard_bytes, 5'000'000'000u);
    EXPECT_EQ(c.vocab_size, 129280);
    EXPECT_EQ(c.num_hidden_layers, 1);
    EXPECT_FALSE(c.mtp);
    EXPECT_EQ(c.head_dim, 512);
    EXPECT_EQ(c.qk_rope_head_dim, 64);
    EXPECT_EQ(c.o_lora_rank, 1024);
    EXPECT_EQ(c.sliding_window, 128);
    EXPECT_EQ(c.index_n_heads, 64);
    EXPECT_EQ(c.index_head_dim, 128);
    EXPECT_EQ(c.n_shared_experts, 1);
    EXPECT_EQ(c.num_experts_per_tok, 6);
    EXPECT_EQ(c.num_hash_layers, 3);
    EXPECT_EQ(c.hc_mult, 4);
    const nlohmann::json j = ConfigJson(c);
    EXPECT_EQ(j["num_nextn_predict_layers"], 0);
    EXPECT_EQ(j["routed_scaling_factor"], c.routed_scaling_factor);
    EXPECT_EQ(j["compress_ratios"], nlohmann::json(c.compress_ratios));
  }
  // pro and flash are V4 models whichever arch is asked for; the parser refuses the mix.
  EXPECT_EQ(MakeConfig(Arch::kDeepseekV3, Preset::kPro).hidden_size, 7168);
  EXPECT_EQ(*ParsePreset(Arch::kDeepseekV4, "pro"), Preset::kPro);
  EXPECT_EQ(*ParsePreset(Arch::kDeepseekV4, "flash"), Preset::kFlash);
  EXPECT_EQ(ParsePreset(Arch::kDeepseekV3, "pro").status().message(),
            "--preset pro is a DeepSeek-V4 model (pass --arch deepseek-v4)");
  EXPECT_EQ(ParsePreset(Arch::kDeepseekV4, "huge").status().message(),
            "unknown --preset 'huge' (expected tiny, small, bench, pro or flash)");
}

// The whole real layer stack: 61 (Pro) and 43 (Flash) main layers and the MTP entry, with §1's
// counts of ratio 4, 128 and 0.
TEST(FixtureTest, LayerCutsFollowTheRealCompressRatios) {
  auto count = [](const std::vector<int64_t>& v, int64_t x) {
    return std::count(v.begin(), v.end(), x);
  };
  FixtureCuts cuts;
  cuts.layers = 61;
  absl::StatusOr<FixtureConfig> pro = MakeConfig(Arch::kDeepseekV4, Preset::kPro, cuts);
  ASSERT_TRUE(pro.ok()) << pro.status();
  ASSERT_EQ(pro->compress_ratios.size(), 62u);
  EXPECT_EQ(count(pro->compress_ratios, 4), 30);
  EXPECT_EQ(count(pro->compress_ratios, 128), 31);
  EXPECT_EQ(count(pro->compress_ratios, 0), 1);
  EXPECT_EQ(std::vector<int64_t>(pro->compress_ratios.begin(), pro->compress_ratios.begin() + 6),
            (std::vector<int64_t>{128, 128, 4, 128, 4, 128}));
  EXPECT_EQ(pro->compress_ratios[60], 4);
  cuts.layers = 43;
  absl::StatusOr<FixtureConfig> flash = MakeConfig(Arch::kDeepseekV4, Preset::kFlash, cuts);
  ASSERT_TRUE(flash.ok()) << flash.status();
  ASSERT_EQ(flash->compress_ratios.size(), 44u);
  EXPECT_EQ(count(flash->compress_ratios, 4), 21);
  EXPECT_EQ(count(flash->compress_ratios, 128), 20);
  EXPECT_EQ(count(flash->compress_ratios, 0), 3);
  EXPECT_EQ(flash->num_hidden_layers, 43);
  cuts.layers = 3;
  flash = MakeConfig(Arch::kDeepseekV4, Preset::kFlash, cuts);
  ASSERT_TRUE(flash.ok()) << flash.status();
  EXPECT_EQ(flash->compress_ratios, (std::vector<int64_t>{0, 0, 4, 0}));
}

TEST(FixtureTest, CutsApplyToProAndFlashOnly) {
  FixtureCuts cuts;
  cuts.layers = 2;
  cuts.mtp = true;
  cuts.experts = 6;
  cuts.vocab = 261;
  absl::StatusOr<FixtureConfig> c = MakeConfig(Arch::kDeepseekV4, Preset::kFlash, cuts);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_hidden_layers, 2);
  EXPECT_TRUE(c->mtp);
  EXPECT_EQ(c->n_routed_experts, 6);
  EXPECT_EQ(c->vocab_size, 261);
  EXPECT_EQ(c->num_experts_per_tok, 6);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(ConfigJson(*c)["num_nextn_predict_layers"], 1);
  // No cut: the preset as it is.
  c = MakeConfig(Arch::kDeepseekV4, Preset::kPro, FixtureCuts{});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(ConfigJson(*c), ConfigJson(MakeConfig(Arch::kDeepseekV4, Preset::kPro)));
  c = MakeConfig(Arch::kDeepseekV3, Preset::kTiny, FixtureCuts{});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(ConfigJson(*c), ConfigJson(MakeConfig(Arch::kDeepseekV3, Preset::kTiny)));

  auto error = [](Preset preset, FixtureCuts cuts) {
    absl::StatusOr<FixtureConfig> c = MakeConfig(Arch::kDeepseekV4, preset, cuts);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(c.status().message());
  };
  FixtureCuts bad;
  bad.experts = 5;
  EXPECT_EQ(error(Preset::kPro, bad), "--experts 5 is outside [6, 384]");
  bad.experts = 257;
  EXPECT_EQ(error(Preset::kFlash, bad), "--experts 257 is outside [6, 256]");
  bad.experts = 8;
  EXPECT_EQ(error(Preset::kTiny, bad), "--experts is only for --preset pro and --preset flash");
  bad = {};
  bad.vocab = 260;
  EXPECT_EQ(error(Preset::kPro, bad), "--vocab 260 is outside [261, 129280]");
  bad.vocab = 129281;
  EXPECT_EQ(error(Preset::kFlash, bad), "--vocab 129281 is outside [261, 129280]");
  bad.vocab = 1024;
  EXPECT_EQ(error(Preset::kBench, bad), "--vocab is only for --preset pro and --preset flash");
  bad = {};
  bad.layers = 0;
  EXPECT_EQ(error(Preset::kPro, bad), "--layers 0 is outside [1, 61]");
  bad.layers = 44;
  EXPECT_EQ(error(Preset::kFlash, bad), "--layers 44 is outside [1, 43]");
  bad.layers = 2;
  EXPECT_EQ(error(Preset::kSmall, bad), "--layers is only for --preset pro and --preset flash");
  bad = {};
  bad.mtp = true;
  EXPECT_EQ(error(Preset::kTiny, bad), "--mtp is only for --preset pro and --preset flash");
}

// `mkfixture --preset pro --layers 1`: §2's Pro shapes, and its size.
TEST(FixtureTest, ProLayerHasTheReferenceShapes) {
  const std::vector<FixtureTensor> ts = FixtureTensors(MakeConfig(Arch::kDeepseekV4, Preset::kPro));
  std::map<std::string, std::vector<int64_t>> stored;
  uint64_t bytes = 0;
  for (const FixtureTensor& t : ts) {
    for (const checkpoint::TensorSpec& s : t.Stored()) {
      stored[s.name] = s.shape;
      bytes += s.bytes();
    }
  }
  auto logical = [&](const std::string& name) { return FindSpec(ts, name).shape; };
  using Shape = std::vector<int64_t>;
  EXPECT_EQ(logical("layers.0.attn.wq_a.weight"), (Shape{1536, 7168}));
  EXPECT_EQ(stored["layers.0.attn.wq_a.scale"], (Shape{12, 56}));
  EXPECT_EQ(logical("layers.0.attn.wq_b.weight"), (Shape{65536, 1536}));
  EXPECT_EQ(logical("layers.0.attn.wo_a.weight"), (Shape{16384, 4096}));
  EXPECT_EQ(stored["layers.0.attn.wo_a.scale"], (Shape{128, 32}));
  EXPECT_EQ(logical("layers.0.attn.wo_b.weight"), (Shape{7168, 16384}));
  EXPECT_EQ(stored["layers.0.attn.wo_b.scale"], (Shape{56, 128}));
  EXPECT_EQ(logical("layers.0.ffn.experts.383.w2.weight"), (Shape{7168, 3072}));
  EXPECT_EQ(stored["layers.0.ffn.experts.383.w2.weight"], (Shape{7168, 1536}));
  EXPECT_EQ(stored["layers.0.ffn.experts.383.w2.scale"], (Shape{7168, 96}));
  EXPECT_EQ(stored["layers.0.ffn.experts.0.w1.weight"], (Shape{3072, 3584}));
  EXPECT_EQ(stored["layers.0.ffn.experts.0.w1.scale"], (Shape{3072, 224}));
  EXPECT_EQ(logical("layers.0.ffn.shared_experts.w1.weight"), (Shape{3072, 7168}));
  EXPECT_EQ(stored["layers.0.ffn.shared_experts.w2.scale"], (Shape{56, 24}));
  EXPECT_EQ(logical("layers.0.ffn.gate.weight"), (Shape{384, 7168}));
  EXPECT_EQ(stored["layers.0.ffn.gate.tid2eid"], (Shape{129280, 6}));  // a hash layer
  EXPECT_EQ(stored["layers.0.hc_attn_fn"], (Shape{24, 28672}));
  EXPECT_EQ(stored["layers.0.attn.compressor.ape"], (Shape{128, 512}));  // ratio 128
  EXPECT_EQ(stored["layers.0.attn.compressor.wkv.weight"], (Shape{512, 7168}));
  EXPECT_EQ(logical("embed.weight"), (Shape{129280, 7168}));
  EXPECT_EQ(logical("head.weight"), (Shape{129280, 7168}));
  EXPECT_EQ(stored["hc_head_fn"], (Shape{4, 28672}));
  EXPECT_EQ(stored.count("layers.0.ffn.experts.384.w1.weight"), 0u);
  EXPECT_EQ(stored.count("layers.0.attn.indexer.wq_b.weight"), 0u);
  for (const auto& [name, shape] : stored) EXPECT_NE(name.rfind("mtp.", 0), 0u) << name;
  // embed + head 2 * 1853358080, 384 experts * 35094528, tid2eid 6205440, the rest 392435244.
  EXPECT_EQ(bytes, 17581655596u);
  uint64_t flash_bytes = 0;
  for (const FixtureTensor& t : FixtureTensors(MakeConfig(Arch::kDeepseekV4, Preset::kFlash))) {
    for (const checkpoint::TensorSpec& s : t.Stored()) flash_bytes += s.bytes();
  }
  EXPECT_EQ(flash_bytes, 5684542828u);  // as written by mkfixture --preset flash --layers 1

  // --layers 3 --mtp: the CSA layer 2 has its indexer, the MTP block its projections.
  FixtureCuts cuts;
  cuts.layers = 3;
  cuts.mtp = true;
  absl::StatusOr<FixtureConfig> c = MakeConfig(Arch::kDeepseekV4, Preset::kPro, cuts);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<FixtureTensor> deep = FixtureTensors(*c);
  EXPECT_EQ(FindSpec(deep, "layers.2.attn.indexer.wq_b.weight").shape, (Shape{8192, 1536}));
  EXPECT_EQ(FindSpec(deep, "layers.2.ffn.gate.tid2eid").shape, (Shape{129280, 6}));
  EXPECT_EQ(FindSpec(deep, "mtp.0.e_proj.weight").shape, (Shape{7168, 7168}));
  EXPECT_EQ(FindSpec(deep, "mtp.0.ffn.gate.bias").shape, (Shape{384}));
}

// Checks one FP8 tensor against DeepSeek's encoding of the generated floats; returns the number
// of all-zero 128x128 blocks.
int CheckFp8(const CheckpointDir& c, const FixtureTensor& t, uint64_t seed) {
  const TensorView* w = c.Find(t.name);
  const TensorView* s = c.Find(t.ScaleName());
  if (w == nullptr || s == nullptr) {
    ADD_FAILURE() << "missing " << t.name;
    return 0;
  }
  const bool e8m0 = s->dtype == Dtype::kF8E8M0;
  const int64_t rows = t.rows(), cols = t.cols(), bcs = (cols + 127) / 128;
  const std::vector<float> x = SourceRows(t, seed, 0, rows);
  int zero_blocks = 0, bad_scales = 0, bad_codes = 0, bad_error = 0;
  for (int64_t br = 0; br * 128 < rows; ++br) {
    for (int64_t bc = 0; bc < bcs; ++bc) {
      float amax = 0.0f;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
        for (int64_t k = bc * 128; k < std::min(cols, bc * 128 + 128); ++k) {
          amax = std::max(amax, std::fabs(x[r * cols + k]));
        }
      }
      zero_blocks += amax == 0.0f;
      const float ratio = std::max(amax, 1e-4f) / 448.0f;
      float scale;
      if (e8m0) {
        scale = formats::E8m0ToFloat(s->data[br * bcs + bc]);
        // 2^ceil(log2(ratio)): the smallest power of two >= ratio.
        bad_scales += !(scale >= ratio && scale / 2 < ratio);
      } else {
        memcpy(&scale, s->data + 4 * (br * bcs + bc), 4);
        bad_scales += scale != ratio;
      }
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
        for (int64_t k = bc * 128; k < std::min(cols, bc * 128 + 128); ++k) {
          const float v = x[r * cols + k];
          const uint8_t code = w->data[r * cols + k];
          bad_codes += code != formats::FloatToE4m3Sat(v / scale);
          // Half an E4M3 step: 2^-4 relative (3 mantissa bits), 2^-10 * scale for subnormals.
          const float err = std::fabs(formats::E4m3ToFloat(code) * scale - v);
          bad_error += err > std::max(std::fabs(v) * 0x1p-4f, scale * 0x1p-10f);
        }
      }
    }
  }
  EXPECT_EQ(bad_scales, 0) << t.name;
  EXPECT_EQ(bad_codes, 0) << t.name;
  EXPECT_EQ(bad_error, 0) << t.name;
  return zero_blocks;
}

// Same for one MXFP4 tensor; returns the number of all-zero 32-blocks.
int CheckMxfp4(const CheckpointDir& c, const FixtureTensor& t, uint64_t seed) {
  const TensorView* w = c.Find(t.name);
  const TensorView* s = c.Find(t.ScaleName());
  if (w == nullptr || s == nullptr) {
    ADD_FAILURE() << "missing " << t.name;
    return 0;
  }
  const int64_t rows = t.rows(), cols = t.cols();
  const std::vector<float> x = SourceRows(t, seed, 0, rows);
  int zero_blocks = 0, bad_scales = 0, bad_codes = 0, bad_error = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / 32; ++b) {
      float amax = 0.0f;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[r * cols + b * 32 + k]));
      zero_blocks += amax == 0.0f;
      const uint8_t sbyte = s->data[r * (cols / 32) + b];
      if (amax == 0.0f) bad_scales += sbyte != 1;  // 2^ceil(log2(2^-126)) = 2^-126
      const float ratio = std::max(amax, 6.0f * 0x1p-126f) / 6.0f;
      const float scale = formats::E8m0ToFloat(sbyte);
      bad_scales += !(scale >= ratio && scale / 2 < ratio);
      for (int k = 0; k < 32; ++k) {
        const int64_t col = b * 32 + k;
        const float v = x[r * cols + col];
        const uint8_t byte = w->data[r * (cols / 2) + col / 2];
        const uint8_t code = (col % 2 == 0) ? (byte & 0xF) : (byte >> 4);  // low nibble first
        bad_codes += code != formats::FloatToE2m1(v / scale);
        // Half the E2M1 gap around |v|/scale: 0.25 below 2, 0.5 below 4, 1 above.
        const float m = std::fabs(v) / scale;
        const float half_gap = m < 2.0f ? 0.25f : (m < 4.0f ? 0.5f : 1.0f);
        bad_error += std::fabs(formats::E2m1ToFloat(code) * scale - v) > half_gap * scale;
      }
    }
  }
  EXPECT_EQ(bad_scales, 0) << t.name;
  EXPECT_EQ(bad_codes, 0) << t.name;
  EXPECT_EQ(bad_error, 0) << t.name;
  return zero_blocks;
}

TEST(FixtureTest, V4EncodingsMatchDeepSeeksQuantizers) {
  const uint64_t seed = 3;
  std::unique_ptr<CheckpointDir> c = Open(WriteTiny(Arch::kDeepseekV4, seed, "enc"));
  ASSERT_NE(c, nullptr);
  const std::vector<FixtureTensor> ts = FixtureTensors(MakeConfig(Arch::kDeepseekV4, Preset::kTiny));
  int fp8_tensors = 0, fp8_zero_blocks = 0, mxfp4_tensors = 0;
  for (const FixtureTensor& t : ts) {
    if (t.encoding == Encoding::kFp8E8m0) {
      ++fp8_tensors;
      fp8_zero_blocks += CheckFp8(*c, t, seed);
    } else if (t.encoding == Encoding::kMxfp4) {
      ++mxfp4_tensors;
      EXPECT_GE(CheckMxfp4(*c, t, seed), 1) << t.name;  // every expert has an all-zero block
    }
  }
  EXPECT_EQ(fp8_tensors, 35);
  EXPECT_EQ(mxfp4_tensors, 96);
  // The FP8 tensors with >= 4 blocks ([512,128] wq_b and [256,256] wo_a/wo_b, e_proj, h_proj,
  // indexer wq_b... ) each get one all-zero block.
  EXPECT_GE(fp8_zero_blocks, 10);
  // All-zero FP8 block: amax floored at 1e-4 -> 2^ceil(log2(1e-4/448)) = 2^-22 (byte 105).
  const TensorView* wq_b = c->Find("layers.0.attn.wq_b.weight");
  const TensorView* wq_b_scale = c->Find("layers.0.attn.wq_b.scale");
  ASSERT_NE(wq_b, nullptr);
  int zero_scale_blocks = 0;
  for (int64_t i = 0; i < 4; ++i) zero_scale_blocks += wq_b_scale->data[i] == 105;
  EXPECT_EQ(zero_scale_blocks, 1);
}

TEST(FixtureTest, V3EncodingsUsePartialBlockF32Scales) {
  const uint64_t seed = 5;
  std::unique_ptr<CheckpointDir> c = Open(WriteTiny(Arch::kDeepseekV3, seed, "enc"));
  ASSERT_NE(c, nullptr);
  const std::vector<FixtureTensor> ts = FixtureTensors(MakeConfig(Arch::kDeepseekV3, Preset::kTiny));
  int fp8_tensors = 0, zero_blocks = 0;
  for (const FixtureTensor& t : ts) {
    if (t.encoding != Encoding::kFp8F32) continue;
    ++fp8_tensors;
    zero_blocks += CheckFp8(*c, t, seed);
  }
  EXPECT_EQ(fp8_tensors, 105);
  EXPECT_GE(zero_blocks, 1);
}

TEST(FixtureTest, UnquantizedTensorsAndExpertIds) {
  const uint64_t seed = 11;
  std::unique_ptr<CheckpointDir> c = Open(WriteTiny(Arch::kDeepseekV4, seed, "plain"));
  ASSERT_NE(c, nullptr);
  const std::vector<FixtureTensor> ts = FixtureTensors(MakeConfig(Arch::kDeepseekV4, Preset::kTiny));

  const FixtureTensor& embed = FindSpec(ts, "embed.weight");
  const std::vector<float> x = SourceRows(embed, seed, 0, embed.rows());
  const TensorView* e = c->Find("embed.weight");
  ASSERT_NE(e, nullptr);
  int bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    uint16_t b;
    memcpy(&b, e->data + 2 * i, 2);
    bad += b != formats::FloatToBf16(x[i]);
  }
  EXPECT_EQ(bad, 0);

  const FixtureTensor& sink = FindSpec(ts, "layers.1.attn.attn_sink");
  const std::vector<float> sx = SourceRows(sink, seed, 0, 1);
  const TensorView* s = c->Find("layers.1.attn.attn_sink");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(memcmp(s->data, sx.data(), 4 * sx.size()), 0);

  // tid2eid: 2 distinct expert ids in [0, 8) per token.
  const TensorView* ids = c->Find("layers.0.ffn.gate.tid2eid");
  ASSERT_NE(ids, nullptr);
  std::vector<int> uses(8, 0);
  for (int64_t tok = 0; tok < 1024; ++tok) {
    int64_t a, b;
    memcpy(&a, ids->data + 16 * tok, 8);
    memcpy(&b, ids->data + 16 * tok + 8, 8);
    ASSERT_TRUE(a >= 0 && a < 8 && b >= 0 && b < 8 && a != b) << tok;
    ++uses[a];
    ++uses[b];
  }
  for (int n : uses) EXPECT_GT(n, 128);  // 2048 draws over 8 experts: ~256 each
}

TEST(FixtureTest, LinearWeightsHaveOutlierChannelsAndRowScales) {
  const std::vector<FixtureTensor> ts = FixtureTensors(MakeConfig(Arch::kDeepseekV4, Preset::kTiny));
  const FixtureTensor& t = FindSpec(ts, "layers.1.ffn.shared_experts.w2.weight");  // [256, 128]
  const std::vector<float> x = SourceRows(t, 1, 0, t.rows());
  const int64_t rows = t.rows(), cols = t.cols();
  std::vector<double> col_rms(cols, 0.0), row_rms(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < cols; ++k) {
      col_rms[k] += x[r * cols + k] * x[r * cols + k];
      row_rms[r] += x[r * cols + k] * x[r * cols + k];
    }
  }
  std::vector<double> sorted = col_rms;
  std::sort(sorted.begin(), sorted.end());
  // One outlier input channel (cols / 256 rounded up to 1) with gain 8..16: its energy is
  // >= 64x the median channel's (allow 2x for sampling noise).
  EXPECT_GT(sorted.back(), 32.0 * sorted[cols / 2]);
  EXPECT_LT(sorted[cols - 2], 4.0 * sorted[cols / 2]);
  // Per-output-channel log-normal scales (sigma 0.3): rows differ by well over sampling noise.
  std::sort(row_rms.begin(), row_rms.end());
  EXPECT_GT(row_rms.back(), 2.0 * row_rms.front());
}

TEST(FixtureTest, RowsDoNotDependOnHowTheTensorIsSplit) {
  const std::vector<FixtureTensor> ts = FixtureTensors(MakeConfig(Arch::kDeepseekV4, Preset::kTiny));
  for (const char* name : {"layers.0.attn.wq_b.weight", "layers.2.ffn.experts.5.w2.weight",
                           "embed.weight"}) {
    const FixtureTensor& t = FindSpec(ts, name);
    const std::vector<float> all = SourceRows(t, 9, 0, t.rows());
    const std::vector<float> part = SourceRows(t, 9, 100, 201);
    ASSERT_EQ(part.size(), static_cast<size_t>(101 * t.cols()));
    EXPECT_TRUE(std::equal(part.begin(), part.end(), all.begin() + 100 * t.cols())) << name;
  }
}

// pro and flash draw their values from the triangular law (four per random draw): an F32
// parameter of mean 0 and stddev 1 is (a + b - 255) / sigma for bytes a, b, so sigma * x is
// (to float rounding) an integer in [-255, 255], and its sample moments are those of unit
// variance; tiny keeps normals.
TEST(FixtureTest, ProAndFlashValuesFollowTheTriangularLaw) {
  absl::StatusOr<FixtureConfig> pro = MakeConfig(Arch::kDeepseekV4, Preset::kPro, {});
  ASSERT_TRUE(pro.ok()) << pro.status();
  EXPECT_TRUE(pro->triangular_values);
  EXPECT_FALSE(MakeConfig(Arch::kDeepseekV4, Preset::kTiny).triangular_values);
  const std::vector<FixtureTensor> ts = FixtureTensors(*pro);
  const FixtureTensor& sink = FindSpec(ts, "layers.0.attn.attn_sink");  // [128], N(0, 1)
  ASSERT_TRUE(sink.dist.triangular);
  const float sigma = std::sqrt(2.0f * (256.0f * 256.0f - 1.0f) / 12.0f);
  double sum = 0, squares = 0;
  const int kRows = 64;  // 64 seeds x 128 values
  for (int seed = 1; seed <= kRows; ++seed) {
    for (float x : SourceRows(sink, seed, 0, 1)) {
      const float v = x * sigma;
      ASSERT_NEAR(v, std::round(v), 1e-3) << x;  // two float roundings off an integer
      ASSERT_LE(std::fabs(v), 255.0f);
      sum += x;
      squares += x * x;
    }
  }
  const double n = kRows * 128.0;
  // Mean 0 (standard error 1/sqrt(n) = 0.011) and variance 1 (standard error about
  // sqrt(2.4 / n) = 0.017 for this law's kurtosis): within 4 standard errors.
  EXPECT_NEAR(sum / n, 0.0, 0.045);
  EXPECT_NEAR(squares / n, 1.0, 0.07);
  // A linear weight keeps its structure: rows of one tensor do not depend on the split.
  const FixtureTensor& w = FindSpec(ts, "layers.0.ffn.experts.0.w2.weight");
  const std::vector<float> all = SourceRows(w, 3, 0, 8);
  const std::vector<float> part = SourceRows(w, 3, 5, 8);
  EXPECT_TRUE(std::equal(part.begin(), part.end(), all.begin() + 5 * w.cols()));
}

// mkfixture generates and encodes MXFP4, BF16 and F32 tensors row by row (TensorSource::
// EncodeRows, no float32 chunk, E2M1 codes by table): the bytes of encoding the generated chunk,
// with formats::FloatToE2m1 and formats::FloatToBf16 themselves, on pro-shaped tensors.
TEST(FixtureTest, RowByRowEncodingGivesTheBytesOfTheChunkEncoding) {
  absl::StatusOr<FixtureConfig> pro = MakeConfig(Arch::kDeepseekV4, Preset::kPro, {.experts = 6});
  ASSERT_TRUE(pro.ok()) << pro.status();
  const std::vector<FixtureTensor> ts = FixtureTensors(*pro);
  for (const char* name : {"layers.0.ffn.experts.3.w1.weight", "layers.0.ffn.experts.5.w2.weight",
                           "embed.weight", "layers.0.attn.attn_sink"}) {
    const FixtureTensor& t = FindSpec(ts, name);
    const int64_t rows = std::min<int64_t>(t.rows(), 40), cols = t.cols(), first = t.rows() - rows;
    const std::vector<float> x = SourceRows(t, 4, first, first + rows);
    std::vector<uint8_t> bytes(static_cast<size_t>(rows * cols) * 4), scales(rows * cols / 32);
    TensorSource(t, 4).EncodeRows(first, first + rows, bytes.data(), scales.data());
    int bad = 0;
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float v = x[i];
      if (t.encoding == Encoding::kMxfp4) {
        const float inv = 1.0f / formats::E8m0ToFloat(scales[i / 32]);
        const uint8_t code = i % 2 == 0 ? bytes[i / 2] & 0xF : bytes[i / 2] >> 4;
        bad += code != formats::FloatToE2m1(v * inv);
        if (i % 32 == 0) {
          float amax = 0.0f;
          for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[i + k]));
          bad += scales[i / 32] != formats::E8m0ScaleForAmax(amax, formats::kE2m1Max,
                                                             formats::kE2m1Max * 0x1p-126f);
        }
      } else if (t.encoding == Encoding::kBf16) {
        uint16_t b;
        memcpy(&b, bytes.data() + 2 * i, 2);
        bad += b != formats::FloatToBf16(v);
      } else {
        float f;
        memcpy(&f, bytes.data() + 4 * i, 4);
        bad += memcmp(&f, &v, 4) != 0;
      }
    }
    EXPECT_EQ(bad, 0) << name;
    if (t.encoding == Encoding::kMxfp4) {  // also the encoder of whole chunks
      std::vector<uint8_t> chunk(rows * cols / 2), chunk_scales(rows * cols / 32);
      EncodeMxfp4(x.data(), rows, cols, chunk.data(), chunk_scales.data());
      EXPECT_EQ(memcmp(chunk.data(), bytes.data(), chunk.size()), 0) << name;
      EXPECT_EQ(chunk_scales, scales) << name;
    }
  }
}

TEST(FixtureTest, PortableMathMatchesLibm) {
  double worst_log = 0, worst_sin = 0, worst_cos = 0, worst_exp = 0;
  Rng rng(42);
  for (int i = 0; i < 100000; ++i) {
    const double u = static_cast<double>((rng.Next() >> 11) + 1) * 0x1.0p-53;
    worst_log = std::max(worst_log, std::fabs(PortableLog(u) - std::log(u)) /
                                        std::max(1e-300, std::fabs(std::log(u))));
    double s, c;
    PortableSinCosTurns(u - 0x1.0p-53, &s, &c);
    worst_sin = std::max(worst_sin, std::fabs(s - std::sin(6.283185307179586 * (u - 0x1.0p-53))));
    worst_cos = std::max(worst_cos, std::fabs(c - std::cos(6.283185307179586 * (u - 0x1.0p-53))));
    const double x = 8.0 * u - 4.0;
    worst_exp = std::max(worst_exp, std::fabs(PortableExp(x) - std::exp(x)) / std::exp(x));
  }
  EXPECT_LT(worst_log, 1e-14);
  EXPECT_LT(worst_sin, 1e-15);
  EXPECT_LT(worst_cos, 1e-15);
  EXPECT_LT(worst_exp, 1e-13);
  EXPECT_EQ(PortableLog(1.0), 0.0);
  // Normals: mean 0, variance 1 within sampling error (n = 1e5: sd of the mean 0.003).
  double sum = 0, sum2 = 0;
  for (int i = 0; i < 100000; ++i) {
    const double z = rng.Normal();
    sum += z;
    sum2 += z * z;
  }
  EXPECT_LT(std::fabs(sum / 1e5), 0.015);
  EXPECT_LT(std::fabs(sum2 / 1e5 - 1.0), 0.02);
}

TEST(FixtureTest, RefusesNonEmptyDirectoryUnlessForced) {
  const std::string dir = TestDir("busy");
  fs::create_directories(dir);
  std::ofstream(dir + "/notes.txt") << "keep me";
  std::ofstream(dir + "/model-00009-of-00009.safetensors") << "stale";
  const FixtureConfig config = MakeConfig(Arch::kDeepseekV4, Preset::kTiny);
  absl::StatusOr<FixtureSummary> s = WriteFixture(config, 1, dir, {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find(dir), std::string::npos) << s.status();
  WriteOptions force;
  force.force = true;
  s = WriteFixture(config, 1, dir, force);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(fs::exists(dir + "/notes.txt"));
  EXPECT_FALSE(fs::exists(dir + "/model-00009-of-00009.safetensors"));
  EXPECT_TRUE(CheckpointDir::Open(dir).ok());
}

}  // namespace
}  // namespace quantd::fixture
