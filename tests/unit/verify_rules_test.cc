// VerifyCheckpoint on small hand-made NVFP4 checkpoints (ModelOpt and compressed-tensors layouts):
// a correct one passes, and each export rule, broken on purpose, is reported with its rule id and
// the tensor or module concerned. Also the error statistics and the report printers.
#include "server/pipeline/stages/verify_rules.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backends.h"
#include "kernels/formats.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/safetensors_writer.h"

namespace quantd::pipeline {
namespace {

namespace fs = std::filesystem;
using checkpoint::Dtype;
using nlohmann::json;

struct Tensor {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::string F32Bytes(float f) { return std::string(reinterpret_cast<const char*>(&f), 4); }

// An in-memory checkpoint: shards of tensors, config.json and (optionally) hf_quant_config.json.
struct Checkpoint {
  std::vector<std::vector<Tensor>> shards;
  json config;
  json hf_quant_config;  // null: not written

  Tensor& Get(const std::string& name) {
    for (auto& shard : shards) {
      for (Tensor& t : shard) {
        if (t.name == name) return t;
      }
    }
    ADD_FAILURE() << "no tensor " << name;
    return shards[0][0];
  }
  void Remove(const std::string& name) {
    for (auto& shard : shards) {
      std::erase_if(shard, [&](const Tensor& t) { return t.name == name; });
    }
  }
  static std::string ShardName(size_t i, size_t n) {
    return "model-0000" + std::to_string(i + 1) + "-of-0000" + std::to_string(n) + ".safetensors";
  }
  // Writes the shards, an index that agrees with them, and the configs.
  void Write(const std::string& dir) const {
    checkpoint::ShardIndex index;
    for (size_t i = 0; i < shards.size(); ++i) {
      std::vector<checkpoint::TensorSpec> specs;
      for (const Tensor& t : shards[i]) {
        specs.push_back({t.name, t.dtype, t.shape});
        index.weight_map[t.name] = ShardName(i, shards.size());
        index.total_size += t.bytes.size();
      }
      auto w = checkpoint::SafetensorsWriter::Create(dir + "/" + ShardName(i, shards.size()), specs);
      ASSERT_TRUE(w.ok()) << w.status();
      for (const Tensor& t : shards[i]) {
        ASSERT_TRUE((*w)->WriteTensor(t.name, t.bytes.data(), t.bytes.size()).ok()) << t.name;
      }
      ASSERT_TRUE((*w)->Finish().ok());
    }
    ASSERT_TRUE(checkpoint::WriteShardIndex(dir + "/model.safetensors.index.json", index).ok());
    ASSERT_TRUE(checkpoint::WriteFileAtomically(dir + "/config.json", config.dump(2)).ok());
    if (!hf_quant_config.is_null()) {
      ASSERT_TRUE(
          checkpoint::WriteFileAtomically(dir + "/hf_quant_config.json", hf_quant_config.dump(2))
              .ok());
    }
  }
};

// Deterministic weights with a spread of magnitudes (row scales 1..4, a sine pattern).
std::vector<float> Weights(int64_t rows, int64_t cols, int seed) {
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) {
    w[i] = std::sin(0.37f * static_cast<float>(i + seed * 101)) *
           static_cast<float>(1 + (i / cols + seed) % 4);
  }
  return w;
}

std::vector<Tensor> BF16Weight(const std::string& module, int64_t rows, int64_t cols) {
  std::string bytes;
  for (float v : Weights(rows, cols, 9)) {
    const uint16_t b = formats::FloatToBf16(v);
    bytes.append(reinterpret_cast<const char*>(&b), 2);
  }
  return {{module + ".weight", Dtype::kBF16, {rows, cols}, bytes}};
}

class VerifyRulesTest : public testing::Test {
 protected:
  void SetUp() override {
    auto backend = kernels::MakeCpuBackend({});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
    const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
    dir_ = (fs::path(testing::TempDir()) /
            (std::string("verify_rules_test_") + info->name() + "_" + std::to_string(getpid())))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // An NVFP4 module quantized with the CPU backend against `group_amax` (shared by fused
  // partners), with input scale `input_scale` (none when 0).
  std::vector<Tensor> Nvfp4Module(const std::string& module, int64_t rows, int64_t cols,
                                  int seed, float group_amax, float input_scale, bool ct) {
    const std::vector<float> w = Weights(rows, cols, seed);
    std::string data(static_cast<size_t>(rows * cols / 2), '\0');
    std::string scales(static_cast<size_t>(rows * cols / 16), '\0');
    float scale_2 = 0;
    kernels::Nvfp4Out out{reinterpret_cast<uint8_t*>(data.data()),
                          reinterpret_cast<uint8_t*>(scales.data()), &scale_2};
    EXPECT_TRUE(backend_
                    ->Nvfp4Quantize({w.data(), kernels::FloatType::kF32, rows, cols},
                                    group_amax, out)
                    .ok());
    const std::vector<int64_t> scalar = ct ? std::vector<int64_t>{1} : std::vector<int64_t>{};
    std::vector<Tensor> t = {
        {module + (ct ? ".weight_packed" : ".weight"), Dtype::kU8, {rows, cols / 2}, data},
        {module + ".weight_scale", Dtype::kF8E4M3, {rows, cols / 16}, scales},
        {module + (ct ? ".weight_global_scale" : ".weight_scale_2"), Dtype::kF32, scalar,
         F32Bytes(ct ? 1.0f / scale_2 : scale_2)}};
    if (input_scale > 0) {
      t.push_back({module + (ct ? ".input_global_scale" : ".input_scale"), Dtype::kF32, scalar,
                   F32Bytes(ct ? 1.0f / input_scale : input_scale)});
    }
    return t;
  }

  // Llama-style: shard 1 holds the MLP (gate/up fused, down alone), shard 2 the attention
  // (q/k/v fused), the head and the embedding in BF16, and a norm.
  Checkpoint Good(bool ct = false, bool w4a4 = true) {
    const float in = w4a4 ? 0.25f : 0.0f;
    const std::string p = "model.layers.0.";
    Checkpoint c;
    c.shards.resize(2);
    auto add = [](std::vector<Tensor>& shard, std::vector<Tensor> t) {
      shard.insert(shard.end(), t.begin(), t.end());
    };
    add(c.shards[0], Nvfp4Module(p + "mlp.gate_proj", 64, 64, 1, 4.0f, in, ct));
    add(c.shards[0], Nvfp4Module(p + "mlp.up_proj", 64, 64, 2, 4.0f, in, ct));
    add(c.shards[0], Nvfp4Module(p + "mlp.down_proj", 64, 64, 3, 3.5f, in * 2, ct));
    add(c.shards[1], Nvfp4Module(p + "self_attn.q_proj", 64, 64, 4, 4.0f, in, ct));
    add(c.shards[1], Nvfp4Module(p + "self_attn.k_proj", 32, 64, 5, 4.0f, in, ct));
    add(c.shards[1], Nvfp4Module(p + "self_attn.v_proj", 32, 64, 6, 4.0f, in, ct));
    add(c.shards[1], BF16Weight("lm_head", 16, 64));
    add(c.shards[1], BF16Weight("model.embed_tokens", 16, 64));
    c.shards[1].push_back({"model.norm.weight", Dtype::kBF16, {64}, std::string(128, '\0')});

    const json excludes = {"lm_head", "model.embed_tokens"};
    json group = {{"weights", {{"dynamic", false}, {"num_bits", 4}, {"type", "float"},
                               {"group_size", 16}}},
                  {"targets", {"Linear"}}};
    if (ct) {
      group["format"] = "nvfp4-pack-quantized";
      if (w4a4) group["input_activations"] = group["weights"];
      c.config = {{"model_type", "llama"},
                  {"quantization_config",
                   {{"quant_method", "compressed-tensors"},
                    {"format", "nvfp4-pack-quantized"},
                    {"config_groups", {{"group_0", group}}},
                    {"ignore", excludes},
                    {"kv_cache_scheme", nullptr}}}};
      return c;
    }
    if (w4a4) group["input_activations"] = group["weights"];
    const std::string algo = w4a4 ? "NVFP4" : "W4A16_NVFP4";
    c.hf_quant_config = {{"producer", {{"name", "quantd"}}},
                         {"quantization",
                          {{"quant_algo", algo},
                           {"kv_cache_quant_algo", nullptr},
                           {"group_size", 16},
                           {"exclude_modules", excludes}}}};
    c.config = {{"model_type", "llama"},
                {"quantization_config",
                 {{"quant_method", "modelopt"},
                  {"quant_algo", algo},
                  {"config_groups", {{"group_0", group}}},
                  {"ignore", excludes}}}};
    return c;
  }

  VerifyReport Verify(const Checkpoint& c) {
    c.Write(dir_);
    absl::StatusOr<VerifyReport> r = VerifyCheckpoint(dir_);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : VerifyReport{};
  }

  // Expects exactly the violations {rule, subject} (messages checked by the caller if needed).
  void ExpectViolations(const VerifyReport& r,
                        const std::vector<std::pair<std::string, std::string>>& expected) {
    std::vector<std::pair<std::string, std::string>> got;
    for (const Violation& v : r.violations) got.push_back({v.rule, v.subject});
    EXPECT_EQ(got, expected) << FormatViolations(r.violations);
  }

  std::string Message(const VerifyReport& r, size_t i = 0) {
    return r.violations.size() > i ? r.violations[i].message : "";
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::string dir_;
};

const char kDown[] = "model.layers.0.mlp.down_proj";
const char kGate[] = "model.layers.0.mlp.gate_proj";
const char kUp[] = "model.layers.0.mlp.up_proj";

TEST_F(VerifyRulesTest, CorrectModelOptCheckpointPasses) {
  const VerifyReport r = Verify(Good());
  EXPECT_TRUE(r.ok()) << FormatViolations(r.violations);
  EXPECT_EQ(r.layout, "modelopt");
  EXPECT_EQ(r.quant_algo, "NVFP4");
  EXPECT_EQ(r.shards, 2);
  EXPECT_EQ(r.tensors, 6 * 4 + 3);
  EXPECT_EQ(r.nvfp4_modules, 6);
  EXPECT_EQ(r.input_scales, 6);
}

TEST_F(VerifyRulesTest, CorrectCompressedTensorsAndWeightsOnlyCheckpointsPass) {
  VerifyReport r = Verify(Good(/*ct=*/true));
  EXPECT_TRUE(r.ok()) << FormatViolations(r.violations);
  EXPECT_EQ(r.layout, "compressed-tensors");
  EXPECT_EQ(r.quant_algo, "NVFP4");
  EXPECT_EQ(r.input_scales, 6);
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  r = Verify(Good(/*ct=*/false, /*w4a4=*/false));
  EXPECT_TRUE(r.ok()) << FormatViolations(r.violations);
  EXPECT_EQ(r.quant_algo, "W4A16_NVFP4");
  EXPECT_EQ(r.input_scales, 0);
}

TEST_F(VerifyRulesTest, TensorLayout) {
  Checkpoint c = Good();
  c.Get(std::string(kDown) + ".weight_scale_2").shape = {1};  // compressed-tensors' shape
  Tensor& s = c.Get(std::string(kDown) + ".weight_scale");   // as if padded for a swizzle
  s.shape = {128, 2};
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleTensorLayout, kDown}, {kRuleTensorLayout, kDown}});
  EXPECT_EQ(Message(r, 0), "weight_scale has shape [128, 2], expected [64, 4] (linear layout, one "
                           "per 16 inputs)");
  EXPECT_EQ(Message(r, 1), "weight_scale_2 is F32 [1], expected F32 [] (0-dim)");
}

TEST_F(VerifyRulesTest, TensorLayoutOfCompressedTensors) {
  Checkpoint c = Good(/*ct=*/true);
  c.Get(std::string(kDown) + ".weight_global_scale").shape = {};
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleTensorLayout, kDown}});
  EXPECT_EQ(Message(r), "weight_global_scale is F32 [], expected F32 [1]");
}

TEST_F(VerifyRulesTest, WeightScaleBytes) {
  Checkpoint c = Good();
  std::string& bytes = c.Get(std::string(kDown) + ".weight_scale").bytes;
  bytes[1 * 4 + 2] = static_cast<char>(0x7F);   // NaN at [1, 2]
  bytes[5 * 4 + 0] = static_cast<char>(0x80);   // -0 at [5, 0]
  bytes[6 * 4 + 3] = static_cast<char>(0xB8);   // -1.0 at [6, 3]
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleWeightScaleBytes, kDown}});
  EXPECT_EQ(Message(r), "weight_scale has 1 NaN, 1 zero and 1 negative byte(s); the first is 0x7f "
                        "at [1, 2]");
}

TEST_F(VerifyRulesTest, WeightScale2) {
  Checkpoint c = Good();
  c.Get(std::string(kDown) + ".weight_scale_2").bytes = F32Bytes(0.0f);
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleWeightScale2, kDown}});
  EXPECT_EQ(Message(r), "weight_scale_2 is 0 (0x00000000), expected finite and positive");

  c.Get(std::string(kDown) + ".weight_scale_2").bytes =
      F32Bytes(std::numeric_limits<float>::quiet_NaN());
  ExpectViolations(Verify(c), {{kRuleWeightScale2, kDown}});
}

TEST_F(VerifyRulesTest, InputScale) {
  Checkpoint c = Good();
  c.Remove(std::string(kDown) + ".input_scale");
  c.Get(std::string(kGate) + ".input_scale").bytes = F32Bytes(-0.25f);
  c.Get(std::string(kUp) + ".input_scale").bytes = F32Bytes(-0.25f);
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleInputScale, kDown}, {kRuleInputScale, kGate}, {kRuleInputScale, kUp}});
  EXPECT_EQ(Message(r, 0), "has no input_scale in a W4A4 checkpoint (readers load it as 0)");
  EXPECT_EQ(Message(r, 1), "input_scale is -0.25 (0xbe800000), expected finite and positive");
}

TEST_F(VerifyRulesTest, InputScaleOfCompressedTensorsIsItsReciprocal) {
  Checkpoint c = Good(/*ct=*/true);
  // 1 / 1e-39 overflows: readers would divide by an infinite global scale.
  c.Get(std::string(kDown) + ".input_global_scale").bytes = F32Bytes(1e-39f);
  ExpectViolations(Verify(c), {{kRuleInputScale, kDown}});
}

TEST_F(VerifyRulesTest, FusedPartnersShareScales) {
  Checkpoint c = Good();
  std::string& s2 = c.Get(std::string(kUp) + ".weight_scale_2").bytes;
  uint32_t bits;
  memcpy(&bits, s2.data(), 4);
  ++bits;  // one ulp: still finite and positive, but not bit-identical
  memcpy(s2.data(), &bits, 4);
  c.Get("model.layers.0.self_attn.v_proj.input_scale").bytes = F32Bytes(0.5f);
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleFusedPartners, kUp},
                       {kRuleFusedPartners, "model.layers.0.self_attn.v_proj"}});
  EXPECT_NE(Message(r, 0).find("differs from fused partner model.layers.0.mlp.gate_proj's"),
            std::string::npos);
  EXPECT_EQ(Message(r, 1), "input_scale 0.5 (0x3f000000) differs from fused partner "
                           "model.layers.0.self_attn.q_proj's 0.25 (0x3e800000)");
}

TEST_F(VerifyRulesTest, FusedPartnersQuantizedTogether) {
  Checkpoint c = Good();
  for (const char* leaf : {".weight", ".weight_scale", ".weight_scale_2", ".input_scale"}) {
    c.Remove(std::string("model.layers.0.self_attn.k_proj") + leaf);
  }
  for (Tensor& t : BF16Weight("model.layers.0.self_attn.k_proj", 32, 64)) {
    c.shards[1].push_back(t);
  }
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleFusedPartners, "model.layers.0.self_attn.q_proj"},
                       {kRuleFusedPartners, "model.layers.0.self_attn.v_proj"}});
  EXPECT_EQ(Message(r), "is NVFP4 but its fused partner model.layers.0.self_attn.k_proj is not; "
                        "readers run them as one GEMM");
}

TEST_F(VerifyRulesTest, HfQuantConfigRequiredKeys) {
  Checkpoint c = Good();
  c.hf_quant_config["quantization"].erase("kv_cache_quant_algo");
  c.hf_quant_config["quantization"]["group_size"] = 32;
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleHfQuantConfig, "hf_quant_config.json"},
                       {kRuleHfQuantConfig, "hf_quant_config.json"}});
  EXPECT_EQ(Message(r, 0), "quantization.group_size is missing or not 16");
  EXPECT_EQ(Message(r, 1), "quantization.kv_cache_quant_algo is missing (write null when the KV "
                           "cache is not quantized)");

  fs::remove(dir_ + "/hf_quant_config.json");
  c.hf_quant_config = nullptr;
  r = Verify(c);
  ExpectViolations(r, {{kRuleHfQuantConfig, "hf_quant_config.json"}});
  EXPECT_EQ(Message(r), "file is missing");
}

TEST_F(VerifyRulesTest, HfQuantConfigMixedPrecisionCoversEveryModule) {
  Checkpoint c = Good();
  const json layer = {{"quant_algo", "NVFP4"}, {"group_size", 16}};
  const json layers = {{"model.layers.0.mlp", layer}};  // attention is not covered
  c.hf_quant_config["quantization"]["quant_algo"] = "MIXED_PRECISION";
  c.hf_quant_config["quantization"]["quantized_layers"] = layers;
  c.config["quantization_config"]["quant_algo"] = "MIXED_PRECISION";
  c.config["quantization_config"]["quantized_layers"] = layers;
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleHfQuantConfig, "model.layers.0.self_attn.k_proj"},
                       {kRuleHfQuantConfig, "model.layers.0.self_attn.q_proj"},
                       {kRuleHfQuantConfig, "model.layers.0.self_attn.v_proj"}});
  EXPECT_EQ(r.layout, "modelopt-mixed");
}

TEST_F(VerifyRulesTest, BlockQuantizedModulesNeedTheMixedLayout) {
  // An FP8-block attention projection and an MXFP4 one left next to NVFP4 modules: a plain
  // ModelOpt config cannot describe them; a MIXED_PRECISION one (which keeps the FP8 config)
  // can.
  Checkpoint c = Good();
  c.shards[1].push_back({"model.layers.0.self_attn.o_proj.weight", Dtype::kF8E4M3, {32, 32},
                         std::string(32 * 32, '\x38')});
  c.shards[1].push_back({"model.layers.0.self_attn.o_proj.weight_scale_inv", Dtype::kF32, {1, 1},
                         F32Bytes(1)});
  c.shards[1].push_back({"model.layers.0.mlp.shared.weight", Dtype::kI8, {32, 16},
                         std::string(32 * 16, '\x11')});
  c.shards[1].push_back({"model.layers.0.mlp.shared.scale", Dtype::kF8E8M0, {32, 1},
                         std::string(32, '\x7f')});
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleUndescribedFormat, "model.layers.0.self_attn.o_proj"},
                       {kRuleUndescribedFormat, "model.layers.0.mlp.shared"}});
  EXPECT_EQ(Message(r, 0),
            "is stored as FP8 blocks with its weight_scale_inv, but the config describes only "
            "NVFP4 modules: readers load it as an unquantized BF16 linear");
  EXPECT_EQ(Message(r, 1),
            "is stored as MXFP4 with its scale, but the config describes only NVFP4 modules: "
            "readers load it as an unquantized BF16 linear");

  const json layer = {{"quant_algo", "NVFP4"}, {"group_size", 16}};
  const json layers = {{"model.layers.0", layer}};
  c.hf_quant_config["quantization"]["quant_algo"] = "MIXED_PRECISION";
  c.hf_quant_config["quantization"]["quantized_layers"] = layers;
  c.config["quantization_config"]["quant_algo"] = "MIXED_PRECISION";
  c.config["quantization_config"]["quantized_layers"] = layers;
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  r = Verify(c);
  EXPECT_TRUE(r.ok()) << FormatViolations(r.violations);
  EXPECT_EQ(r.layout, "modelopt-mixed");
}

TEST_F(VerifyRulesTest, ConfigQuantization) {
  Checkpoint c = Good();
  c.config["quantization_config"]["quant_algo"] = "FP8";
  c.config["quantization_config"]["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}};
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleConfigQuantization, "config.json"},
                       {kRuleConfigQuantization, "config.json"}});
  EXPECT_EQ(Message(r, 0), "quantization_config.quant_algo \"FP8\" does not match "
                           "hf_quant_config.json's \"NVFP4\"");
  EXPECT_EQ(Message(r, 1), "quantization_config has a kv_cache_scheme but hf_quant_config.json's "
                           "kv_cache_quant_algo is null");

  c.config.erase("quantization_config");
  r = Verify(c);
  ExpectViolations(r, {{kRuleConfigQuantization, "config.json"}});
  EXPECT_EQ(Message(r), "has no quantization_config object");
}

TEST_F(VerifyRulesTest, ConfigQuantizationOfCompressedTensors) {
  Checkpoint c = Good(/*ct=*/true);
  c.config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32;
  VerifyReport r = Verify(c);
  // Without an NVFP4 group the config says nothing about inputs; the modules have input scales.
  ExpectViolations(r, {{kRuleConfigQuantization, "config.json"}});
}

TEST_F(VerifyRulesTest, ExcludeMatchesQuantized) {
  Checkpoint c = Good();
  // A glob over the MLP, and a plain name that vLLM matches as a substring.
  const json excludes = {"lm_head", "model.embed_tokens", "model.layers.0.mlp.*", "k_proj"};
  c.hf_quant_config["quantization"]["exclude_modules"] = excludes;
  c.config["quantization_config"]["ignore"] = excludes;
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleExcludeMatchesQuantized, "model.layers.0.mlp.*"},
                       {kRuleExcludeMatchesQuantized, "k_proj"}});
  EXPECT_EQ(Message(r, 0), "matches quantized module model.layers.0.mlp.down_proj and 2 more");
  EXPECT_EQ(Message(r, 1), "matches quantized module model.layers.0.self_attn.k_proj");
}

TEST_F(VerifyRulesTest, IgnoreMatchesQuantizedInCompressedTensors) {
  Checkpoint c = Good(/*ct=*/true);
  // compressed-tensors matches exact names and re.match regexes, not substrings.
  c.config["quantization_config"]["ignore"] = {"lm_head", "k_proj", "re:.*self_attn\\.v"};
  VerifyReport r = Verify(c);
  ExpectViolations(r, {{kRuleExcludeMatchesQuantized, "re:.*self_attn\\.v"}});
  EXPECT_EQ(Message(r), "matches quantized module model.layers.0.self_attn.v_proj");
}

TEST_F(VerifyRulesTest, IndexAgreesWithShards) {
  Checkpoint c = Good();
  c.Write(dir_);
  const std::string path = dir_ + "/model.safetensors.index.json";
  auto index = checkpoint::ParseShardIndex(path);
  ASSERT_TRUE(index.ok());
  index->weight_map["lm_head.weight"] = Checkpoint::ShardName(0, 2);
  index->weight_map.erase("model.norm.weight");
  index->weight_map["ghost.weight"] = Checkpoint::ShardName(0, 2);
  index->total_size += 1;
  ASSERT_TRUE(checkpoint::WriteShardIndex(path, *index).ok());
  absl::StatusOr<VerifyReport> r = VerifyCheckpoint(dir_);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectViolations(*r, {{kRuleIndex, "lm_head.weight"},
                        {kRuleIndex, "model.norm.weight"},
                        {kRuleIndex, "ghost.weight"},
                        {kRuleIndex, "model.safetensors.index.json"}});
  EXPECT_EQ(Message(*r, 0), "tensor is in model-00002-of-00002.safetensors but the index maps it "
                            "to model-00001-of-00002.safetensors");
  EXPECT_EQ(Message(*r, 1), "tensor in model-00002-of-00002.safetensors is not listed in the index");
  EXPECT_EQ(Message(*r, 2), "listed in model-00001-of-00002.safetensors by the index but absent "
                            "from it");
  EXPECT_EQ(Message(*r, 3), absl::StrCat("metadata.total_size is ", index->total_size,
                                         " but the shards hold ", index->total_size - 1,
                                         " tensor bytes"));
}

TEST_F(VerifyRulesTest, NotACheckpointIsAnError) {
  absl::StatusOr<VerifyReport> r = VerifyCheckpoint(dir_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(VerifyCheckpoint(dir_ + "/absent").ok());
}

TEST_F(VerifyRulesTest, ReportPrinters) {
  Checkpoint c = Good();
  c.Get(std::string(kDown) + ".weight_scale_2").bytes = F32Bytes(0.0f);
  const VerifyReport r = Verify(c);
  const std::string head =
      absl::StrCat(dir_, ": modelopt NVFP4 checkpoint, 2 shard(s), 27 tensors, 6 NVFP4 modules "
                         "(6 with an input scale)\n");
  EXPECT_EQ(FormatVerifyReport(r),
            head + "FAILED: 1 violation(s): weight-scale-2 1\n"
                   "[weight-scale-2] model.layers.0.mlp.down_proj: weight_scale_2 is 0 "
                   "(0x00000000), expected finite and positive\n");
  const json j = VerifyReportToJson(r);
  EXPECT_EQ(j["ok"], false);
  EXPECT_EQ(j["nvfp4_modules"], 6);
  EXPECT_EQ(j["violations"][0]["rule"], "weight-scale-2");
  EXPECT_EQ(j["violations"][0]["subject"], kDown);
  EXPECT_EQ(FormatVerifyReport(Verify(Good())), head + "OK: every export rule holds\n");
}

TEST(ErrorStatsTest, ValuesFromTheDefinitions) {
  ErrorStats s;
  const float ref[] = {3.0f, 4.0f, 0.0f};
  const float got[] = {3.0f, 5.0f, -0.5f};
  s.Add(ref, got, 2);
  s.Add(ref + 2, got + 2, 1);
  const store::TensorStatsRow row = s.Row("t");
  // sum ref^2 = 25, sum err^2 = 1.25.
  EXPECT_EQ(row.tensor, "t");
  EXPECT_DOUBLE_EQ(row.rel_rmse, std::sqrt(1.25 / 25.0));
  EXPECT_DOUBLE_EQ(row.sqnr_db, 10.0 * std::log10(25.0 / 1.25));
  EXPECT_EQ(row.max_abs_err, 1.0);

  ErrorStats exact;
  exact.Add(ref, ref, 3);
  EXPECT_EQ(exact.Row("e").rel_rmse, 0.0);
  EXPECT_EQ(exact.Row("e").sqnr_db, std::numeric_limits<double>::infinity());
  EXPECT_EQ(exact.Row("e").max_abs_err, 0.0);
}

}  // namespace
}  // namespace quantd::pipeline
