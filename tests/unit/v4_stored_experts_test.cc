// The bookkeeping of the CUDA ops' per-layer caches, run on the CPU backend (the same code the
// CUDA ops run with their device's backend): a layer's routed experts stored in one buffer and
// decoded from it exactly as RoutedExperts decodes them from the source (StoredExperts,
// DecodeStoredLinear), and small parameters copied once and refreshed when their values change
// (ParameterCache).
#include "server/model/v4_stored_experts.h"

#include <string.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/model/v4_forward_ops.h"
#include "server/model/v4_layer.h"
#include "server/model/v4_parameter_cache.h"
#include "tests/unit/v4_tiny_checkpoint.h"

namespace quantd::model {
namespace {

using testing_util::V4TinyCheckpointTest;

// Whether a and b are the same values (dtype, shape and bytes) with the same input treatment.
void ExpectSameWeight(const LinearWeight& a, const LinearWeight& b) {
  EXPECT_EQ(a.module, b.module);
  EXPECT_EQ(a.quantized_source, b.quantized_source) << a.module;
  EXPECT_EQ(a.input_scale, b.input_scale) << a.module;
  ASSERT_EQ(a.view.type, b.view.type) << a.module;
  ASSERT_EQ(a.view.rows, b.view.rows) << a.module;
  ASSERT_EQ(a.view.cols, b.view.cols) << a.module;
  const size_t bytes = static_cast<size_t>(a.view.rows * a.view.cols) *
                       (a.view.type == kernels::FloatType::kBF16 ? 2 : 4);
  EXPECT_EQ(memcmp(a.view.data, b.view.data, bytes), 0) << a.module;
}

class V4StoredExpertsTest : public V4TinyCheckpointTest {};

TEST_F(V4StoredExpertsTest, ALayerIsStoredOnceAndEachExpertDecodesAsFromTheSource) {
  const V4Config& c = ckpt_->config;
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    auto weights = LoadLayer(*ckpt_, layer, *device_);
    ASSERT_TRUE(weights.ok()) << weights.status();
    const RoutedExperts& experts = weights->moe.experts;
    auto stored = StoredExperts::Upload(experts, device_->backend());
    ASSERT_TRUE(stored.ok()) << stored.status();
    EXPECT_TRUE(stored->Holds(experts));
    EXPECT_EQ(stored->size(), c.n_routed_experts);
    // Every stored tensor (MXFP4 codes and E8M0 scales), each at a 256-byte boundary.
    const int64_t d = c.hidden_size, inter = c.moe_intermediate_size;
    size_t expected = 0;
    for (int64_t e = 0; e < c.n_routed_experts; ++e) {
      for (const char* w : {"w1", "w2", "w3"}) {
        const std::string p = absl::StrCat("layers.", layer, ".ffn.experts.", e, ".", w);
        const checkpoint::TensorView* codes = ckpt_->dir->Find(p + ".weight");
        const checkpoint::TensorView* scales = ckpt_->dir->Find(p + ".scale");
        ASSERT_NE(codes, nullptr) << p;
        ASSERT_NE(scales, nullptr) << p;
        EXPECT_EQ(codes->size, static_cast<uint64_t>(d * inter / 2)) << p;
        expected += (codes->size + 255) / 256 * 256 + (scales->size + 255) / 256 * 256;
      }
    }
    EXPECT_EQ(stored->bytes(), expected);

    ExpertWeights from_store, from_source;  // each reuses its previous buffers
    for (int64_t e = 0; e < c.n_routed_experts; ++e) {
      const void* previous_w2 = from_store.w2.decoded.holder.data();
      auto a = stored->Decode(e, std::move(from_store));
      ASSERT_TRUE(a.ok()) << a.status();
      auto b = experts.Decode(e, std::move(from_source));
      ASSERT_TRUE(b.ok()) << b.status();
      ExpectSameWeight(a->w1, b->w1);
      ExpectSameWeight(a->w2, b->w2);
      ExpectSameWeight(a->w3, b->w3);
      EXPECT_TRUE(a->w1.quantized_source);  // MXFP4: official numerics FP8-simulate the input
      if (e > 0) {
        EXPECT_EQ(a->w2.decoded.holder.data(), previous_w2);  // no new allocation
      }
      from_store = std::move(*a);
      from_source = std::move(*b);
    }
    EXPECT_EQ(stored->Decode(c.n_routed_experts).status().code(), absl::StatusCode::kOutOfRange);
  }
}

TEST_F(V4StoredExpertsTest, HoldsOnlyTheLayerItWasUploadedFrom) {
  auto l0 = LoadLayer(*ckpt_, 0, *device_);
  auto l1 = LoadLayer(*ckpt_, 1, *device_);
  ASSERT_TRUE(l0.ok() && l1.ok());
  auto stored = StoredExperts::Upload(l0->moe.experts, device_->backend());
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_TRUE(stored->Holds(l0->moe.experts));
  EXPECT_FALSE(stored->Holds(l1->moe.experts));
  EXPECT_FALSE(stored->Holds(RoutedExperts()));
  EXPECT_EQ(StoredExperts::Upload(RoutedExperts(), device_->backend()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// FP8-block and BF16 linears from bytes in backend memory: LoadLinear's values (the BF16 one read
// in place, not copied).
TEST_F(V4StoredExpertsTest, StoredLinearsDecodeAsLoadLinear) {
  const V4Config& c = ckpt_->config;
  struct Case {
    std::string module;
    int64_t out, in;
    checkpoint::TensorFormat format;
  };
  const std::vector<Case> cases = {
      {"layers.0.attn.wq_b", c.num_attention_heads * c.head_dim, c.q_lora_rank,
       checkpoint::TensorFormat::kFp8BlockE8m0},
      {"layers.0.ffn.gate", c.n_routed_experts, c.hidden_size, checkpoint::TensorFormat::kBf16},
  };
  for (const Case& k : cases) {
    auto s = FindStoredLinear(*ckpt_, k.module, k.out, k.in);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->format, k.format) << k.module;
    auto loaded = LoadLinear(*ckpt_, device_->backend(), k.module, k.out, k.in);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    // A copy of the stored bytes, as an upload makes it.
    std::vector<uint8_t> codes(s->weight->data, s->weight->data + s->weight->size);
    std::vector<uint8_t> scales;
    if (s->scale != nullptr) scales.assign(s->scale->data, s->scale->data + s->scale->size);
    auto decoded = DecodeStoredLinear(device_->backend(), *s, codes.data(),
                                      scales.empty() ? nullptr : scales.data());
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ExpectSameWeight(*decoded, *loaded);
    if (k.format == checkpoint::TensorFormat::kBf16) {
      EXPECT_EQ(decoded->view.data, codes.data());
      EXPECT_EQ(decoded->decoded.holder.data(), nullptr);
    }
  }
  EXPECT_EQ(FindStoredLinear(*ckpt_, "layers.0.attn.wq_b", 1, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(FindStoredLinear(*ckpt_, "layers.0.attn.nothing", 1, 1).ok());
}

TEST_F(V4StoredExpertsTest, ParametersAreCopiedOnceAndAgainOnlyWhenTheirValuesChange) {
  int copies = 0;
  ParameterCache cache(&device_->backend(), [&](void* dst, const void* host, size_t bytes) {
    ++copies;
    return device_->backend().CopyToBackend(dst, host, bytes);
  });
  std::vector<float> norm = {1.0f, 2.0f, 3.0f};
  std::vector<float> bias = {0.5f};
  auto a = cache.Get(&norm, 0, norm.data(), 12, "norm");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_NE(*a, static_cast<const void*>(norm.data()));  // a copy
  EXPECT_EQ(memcmp(*a, norm.data(), 12), 0);
  for (int i = 0; i < 3; ++i) {
    auto again = cache.Get(&norm, 0, norm.data(), 12, "norm");
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*again, *a);
  }
  EXPECT_EQ(cache.uploads(), 1);
  EXPECT_EQ(cache.upload_bytes(), 12);
  EXPECT_EQ(cache.hits(), 3);

  auto b = cache.Get(&bias, 0, bias.data(), 4, "bias");
  ASSERT_TRUE(b.ok());
  EXPECT_NE(*b, *a);
  // Another part of the same owner is another entry.
  auto part = cache.Get(&norm, 1, bias.data(), 4, "part");
  ASSERT_TRUE(part.ok());
  EXPECT_NE(*part, *b);
  EXPECT_EQ(cache.uploads(), 3);
  EXPECT_EQ(cache.held_bytes(), 12u + 4u + 4u);

  // New values at the same address are copied again, into the same memory.
  norm[1] = -2.0f;
  auto changed = cache.Get(&norm, 0, norm.data(), 12, "norm");
  ASSERT_TRUE(changed.ok());
  EXPECT_EQ(*changed, *a);
  EXPECT_EQ(static_cast<const float*>(*changed)[1], -2.0f);
  EXPECT_EQ(cache.uploads(), 4);
  EXPECT_EQ(cache.upload_bytes(), 12 + 4 + 4 + 12);
  EXPECT_EQ(cache.hits(), 3);
  // More values than the entry held: a larger copy replaces it.
  norm.push_back(4.0f);
  auto grown = cache.Get(&norm, 0, norm.data(), 16, "norm");
  ASSERT_TRUE(grown.ok());
  EXPECT_EQ(static_cast<const float*>(*grown)[3], 4.0f);
  EXPECT_EQ(cache.held_bytes(), 16u + 4u + 4u);
  EXPECT_EQ(cache.uploads(), 5);
  EXPECT_EQ(copies, 5);
}

// The host ops read parameters in place and count no uploads.
TEST_F(V4StoredExpertsTest, HostOpsReadParametersInPlace) {
  auto ctx = MakeForwardContext(*device_, Numerics::kOfficial, nullptr);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  const std::vector<float> sink = {1.0f, 2.0f};
  auto p = OpsOf(*ctx).Parameter(sink, "sink");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, sink.data());
  const OpsUploads u = OpsOf(*ctx).uploads();
  EXPECT_EQ(u.expert_layers + u.parameters + u.parameter_hits + u.experts_decoded, 0);
}

}  // namespace
}  // namespace quantd::model
