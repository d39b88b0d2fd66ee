// CheckV4ConfigAgainstTensors on the tiny DeepSeek-V4 fixture (with a CSA and an HCA layer): its
// own config.json holds; a config.json claiming other layers, dimensions or compressors than the
// tensors fails naming config.json and the field.
#include "server/model/v4_config_check.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/fixture/fixture.h"
#include "server/fixture/fixture_spec.h"
#include "server/model/v4_config.h"
#include "tests/unit/test_dirs.h"

namespace quantd::model {
namespace {

class V4ConfigCheckTest : public testing_util::TempDirTest {
 protected:
  void SetUp() override {
    testing_util::TempDirTest::SetUp();
    fixture::FixtureConfig config =
        fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny);
    config.compress_ratios = {0, 4, 128, 0};  // layer 1 CSA (compressor and indexer), 2 HCA
    ASSERT_TRUE(fixture::WriteFixture(config, 7, dir_, {}).ok());
    auto source = checkpoint::CheckpointDir::Open(dir_);
    ASSERT_TRUE(source.ok()) << source.status();
    auto inventory = checkpoint::BuildInventory(**source);
    ASSERT_TRUE(inventory.ok()) << inventory.status();
    inventory_ = std::move(*inventory);
    auto parsed = ParseV4Config((*source)->config(), "m/config.json");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    config_ = *parsed;
  }

  // The check's message for config_ (OK: "").
  std::string Check() {
    const absl::Status s = CheckV4ConfigAgainstTensors(config_, inventory_, "m/config.json");
    return std::string(s.message());
  }

  checkpoint::TensorInventory inventory_;
  V4Config config_;
};

TEST_F(V4ConfigCheckTest, TheFixturesOwnConfigHolds) { EXPECT_EQ(Check(), ""); }

TEST_F(V4ConfigCheckTest, TheLayerCountMustBeTheLayersPresent) {
  config_.num_hidden_layers = 400000;
  EXPECT_EQ(Check(),
            "m/config.json: field \"num_hidden_layers\" is 400000, but the checkpoint has tensors "
            "of 3 decoder layers (layers.0 to layers.2)");
  config_.num_hidden_layers = 2;
  EXPECT_EQ(Check(),
            "m/config.json: field \"num_hidden_layers\" is 2, but the checkpoint has tensors of 3 "
            "decoder layers (layers.0 to layers.2)");
}

TEST_F(V4ConfigCheckTest, EveryDimensionMustBeTheTensors) {
  const V4Config good = config_;
  config_.hidden_size = 512;
  EXPECT_EQ(Check(), "m/config.json: field \"hidden_size\" gives 512 for "
                     "layers.0.attn.wq_a.weight, which has shape [128, 256]");
  config_ = good;
  config_.head_dim = 64;
  EXPECT_EQ(Check(), "m/config.json: field \"num_attention_heads\" gives 256 for "
                     "layers.0.attn.wq_b.weight, which has shape [512, 128]");
  config_ = good;
  config_.o_lora_rank = 64;
  EXPECT_EQ(Check(), "m/config.json: field \"o_lora_rank\" gives 128 for "
                     "layers.0.attn.wo_a.weight, which has shape [256, 256]");
  config_ = good;
  config_.n_shared_experts = 2;
  EXPECT_EQ(Check(), "m/config.json: field \"n_shared_experts\" gives 256 for "
                     "layers.0.ffn.shared_experts.w1.weight, which has shape [128, 256]");
  config_ = good;
  config_.num_experts_per_tok = 3;
  EXPECT_EQ(Check(), "m/config.json: field \"num_experts_per_tok\" gives 3 for "
                     "layers.0.ffn.gate.tid2eid, which has shape [1024, 2]");
  config_ = good;
  config_.index_n_heads = 4;
  EXPECT_EQ(Check(), "m/config.json: field \"index_n_heads\" gives 512 for "
                     "layers.1.attn.indexer.wq_b.weight, which has shape [256, 128]");
}

TEST_F(V4ConfigCheckTest, ACompressorExactlyWhereCompressRatiosSays) {
  const V4Config good = config_;
  config_.compress_ratios = {4, 4, 128, 0};
  EXPECT_EQ(Check(), "m/config.json: field \"compress_ratios\" gives layers.0. ratio 4, but "
                     "layers.0.attn.compressor.ape is absent");
  config_ = good;
  config_.compress_ratios = {0, 0, 128, 0};
  EXPECT_EQ(Check(), "m/config.json: field \"compress_ratios\" gives layers.1. ratio 0, but "
                     "layers.1.attn.compressor.ape is present");
  config_ = good;
  config_.compress_ratios = {0, 128, 128, 0};
  EXPECT_EQ(Check(), "m/config.json: field \"compress_ratios\" gives 128 for "
                     "layers.1.attn.compressor.ape, which has shape [4, 256]");
}

}  // namespace
}  // namespace quantd::model
