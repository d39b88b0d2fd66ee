// The layer memory model (model/v4_memory.h) and the layer tasks' memory built on it
// (pipeline/stages/layer_task_memory.h), on an inventory of known tensors: every figure is the
// arithmetic of its shapes and formats.
#include "server/model/v4_memory.h"

#include "gtest/gtest.h"
#include "server/pipeline/stages/layer_task_memory.h"

namespace quantd::model {
namespace {

using checkpoint::Dtype;
using checkpoint::LinearModule;
using checkpoint::TensorFormat;
using checkpoint::TensorInfo;

void AddLinear(checkpoint::TensorInventory& inv, const std::string& name, TensorFormat format,
               int64_t out, int64_t in, uint64_t stored_bytes) {
  inv.linears.push_back({name, format, out, in, {name + ".weight", name + ".scale"}, stored_bytes});
  TensorInfo weight;
  weight.name = name + ".weight";
  weight.module = name;
  weight.format = format;
  weight.shape = {out, in};
  inv.tensors.push_back(weight);
  TensorInfo scale;
  scale.name = name + ".scale";
  scale.module = name;
  scale.format = TensorFormat::kScale;
  scale.shape = {out / 128, in / 128};
  inv.tensors.push_back(scale);
}

void AddParameter(checkpoint::TensorInventory& inv, const std::string& name,
                  std::vector<int64_t> shape) {
  TensorInfo t;
  t.name = name;
  t.module = name.substr(0, name.rfind('.'));
  t.format = TensorFormat::kOther;
  t.dtype = Dtype::kBF16;
  t.shape = std::move(shape);
  inv.tensors.push_back(t);
}

// Layer 3 of a small model: an FP8 projection, a BF16 router, an NVFP4 shared expert projection,
// two MXFP4 routed experts (the second wider), two parameters; plus layer 30 and the head, which
// must not count.
checkpoint::TensorInventory Inventory() {
  checkpoint::TensorInventory inv;
  AddLinear(inv, "layers.3.attn.wq_a", TensorFormat::kFp8BlockE8m0, 256, 512, 256 * 512 + 8);
  AddLinear(inv, "layers.3.ffn.gate", TensorFormat::kBf16, 8, 512, 8 * 512 * 2);
  AddLinear(inv, "layers.3.ffn.shared_experts.w1", TensorFormat::kNvfp4, 128, 512, 128 * 256);
  for (const char* w : {"w1", "w2", "w3"}) {
    AddLinear(inv, std::string("layers.3.ffn.experts.0.") + w, TensorFormat::kMxfp4, 128, 512,
              1000);
    AddLinear(inv, std::string("layers.3.ffn.experts.1.") + w, TensorFormat::kMxfp4, 256, 512,
              2000);
  }
  AddParameter(inv, "layers.3.attn_norm.weight", {512});
  AddParameter(inv, "layers.3.hc_attn_fn", {24, 2048});
  AddLinear(inv, "layers.30.attn.wq_a", TensorFormat::kFp8BlockE8m0, 256, 512, 1);
  AddParameter(inv, "layers.30.attn_norm.weight", {512});
  AddLinear(inv, "head", TensorFormat::kBf16, 1024, 512, 1);
  return inv;
}

TEST(V4MemoryTest, DenseWeightsDecodedOneExpertAtATimeTheRestAsStored) {
  const LayerMemory m = EstimateLayerMemory(Inventory(), "layers.3.", DecodedWidth::kAsStored);
  // FP8 and BF16 decode to BF16, NVFP4 to float32; parameters as float32.
  EXPECT_EQ(m.dense_bytes, 256 * 512 * 2 + 8 * 512 * 2 + 128 * 512 * 4 + 512 * 4 + 24 * 2048 * 4);
  EXPECT_EQ(m.expert_bytes, 3 * 256 * 512 * 2);  // the wider expert, in BF16
  EXPECT_EQ(m.stored_expert_bytes, 3 * 1000 + 3 * 2000);
  EXPECT_EQ(m.resident_bytes(), m.dense_bytes + m.expert_bytes);
}

TEST(V4MemoryTest, Float32WidthCountsEveryLinearAtFourBytes) {
  const LayerMemory m = EstimateLayerMemory(Inventory(), "layers.3.", DecodedWidth::kFloat32);
  EXPECT_EQ(m.dense_bytes, (256 * 512 + 8 * 512 + 128 * 512) * 4 + 512 * 4 + 24 * 2048 * 4);
  EXPECT_EQ(m.expert_bytes, 3 * 256 * 512 * 4);
}

TEST(V4MemoryTest, LayerTasksAddTheirActivations) {
  const checkpoint::TensorInventory inv = Inventory();
  V4Config c;
  c.hidden_size = 512;
  c.hc_mult = 4;
  c.vocab_size = 1024;
  const int64_t stored =
      EstimateLayerMemory(inv, "layers.3.", DecodedWidth::kAsStored).resident_bytes();
  const int64_t f32 =
      EstimateLayerMemory(inv, "layers.3.", DecodedWidth::kFloat32).resident_bytes();
  const int64_t stream = 4 * 512 * 4 + 4;  // per token: 4 streams of 512 floats and its id
  EXPECT_EQ(pipeline::StreamBytes(c, 10), 10 * stream);
  EXPECT_EQ(pipeline::CalibrateLayerTaskBytes(c, inv, 3, 100, 5000),
            stored + 5000 + 2 * 100 * stream);
  EXPECT_EQ(pipeline::EvaluateLayerTaskBytes(c, inv, 3, 100, 5000),
            stored + f32 + 5000 + 4 * 100 * stream);
  EXPECT_EQ(pipeline::EvaluateHeadTaskBytes(c, 100, 50),
            2 * 4 * 1024 * 512 + 2 * 4 * 50 * 1024 + 2 * 100 * stream);
}

}  // namespace
}  // namespace quantd::model
