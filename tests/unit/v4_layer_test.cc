// The DeepSeek-V4 layer API on the tiny fixture (hash, CSA and HCA layers): LoadLayer/RunLayer in
// both numerics, what the observer sees, spilled activations, and argument errors. The numerical
// equality with transformers is tests/interop/test_v4_forward.py's.
#include "server/model/v4_layer.h"

#include <malloc.h>
#include <string.h>

#include <cmath>
#include <map>
#include <set>

#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "server/model/v4_memory.h"
#include "tests/unit/v4_tiny_checkpoint.h"

namespace quantd::model {
namespace {

// Records per module: the largest |x|, the expert id, and checks per-call invariants.
class RecordingObserver final : public Observer {
 public:
  void OnLinearInput(const LinearInput& in) override {
    const std::string& m = *in.module;
    float amax = 0.0f;
    for (int64_t r = 0; r < in.rows; ++r) {
      for (int64_t c = 0; c < in.cols; ++c) amax = std::max(amax, std::fabs(in.x[r * in.ld + c]));
    }
    amax_[m] = std::max(amax_[m], amax);
    const bool expert = m.find(".experts.") != std::string::npos;
    EXPECT_EQ(in.expert >= 0, expert) << m;
    EXPECT_EQ(in.tokens != nullptr, expert) << m;
    const bool w2 = expert && m.size() > 3 && m.compare(m.size() - 3, 3, ".w2") == 0;
    EXPECT_EQ(in.routing_weights != nullptr, w2) << m;
    if (w2) {
      for (int64_t r = 0; r < in.rows; ++r) {
        EXPECT_GT(in.routing_weights[r], 0.0f);
        weight_sum_[in.tokens[r]] += in.routing_weights[r];
      }
    }
  }
  void OnKvCache(const KvCacheInput& in) override { kv_.insert(*in.module); }

  std::map<std::string, float> amax_;     // module -> max |input|
  std::map<int64_t, double> weight_sum_;  // token -> sum of its routing weights (one layer)
  std::set<std::string> kv_;              // KV cache modules seen
};

class V4LayerTest : public testing_util::V4TinyCheckpointTest {
 protected:
  void SetUp() override {
    V4TinyCheckpointTest::SetUp();
    if (HasFatalFailure()) return;
    for (int64_t i = 0; i < kSequences * kSeqLen; ++i) {
      ids_.push_back(static_cast<int32_t>((i * 7919 + 13) % ckpt_->config.vocab_size));
    }
  }

  static constexpr int64_t kSequences = 2;
  static constexpr int64_t kSeqLen = 140;  // > 128: HCA gets an entry, the window slides
  std::vector<int32_t> ids_;
};

bool Bf16Exact(const std::vector<float>& v) {
  for (float f : v) {
    if (formats::Bf16ToFloat(formats::FloatToBf16(f)) != f) return false;
  }
  return true;
}

TEST_F(V4LayerTest, OfficialForwardKeepsBf16StreamsAndShowsEveryLinear) {
  const V4Config& c = ckpt_->config;
  ASSERT_EQ(c.compress_ratios, (std::vector<int64_t>{0, 4, 128, 0}));
  RecordingObserver observer;
  auto ctx = MakeForwardContext(*device_, Numerics::kOfficial, &observer);
  ASSERT_TRUE(ctx.ok());
  auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
  ASSERT_TRUE(acts.ok()) << acts.status();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    auto weights = LoadLayer(*ckpt_, l, *device_);
    ASSERT_TRUE(weights.ok()) << weights.status();
    observer.weight_sum_.clear();
    auto out = RunLayer(*ctx, c, *weights, *acts);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(Bf16Exact(out->streams)) << "layer " << l;
    for (float f : out->streams) ASSERT_TRUE(std::isfinite(f));
    EXPECT_NE(out->streams, acts->streams);
    // The fixture is well-conditioned: the streams neither vanish nor blow up.
    double sq = 0.0;
    for (float f : out->streams) sq += double(f) * f;
    const double rms = std::sqrt(sq / out->streams.size());
    EXPECT_GT(rms, 0.5) << "layer " << l;
    EXPECT_LT(rms, 50.0) << "layer " << l;
    // Every token's routing weights sum to route_scale (renormalized top-k).
    ASSERT_EQ(static_cast<int64_t>(observer.weight_sum_.size()), kSequences * kSeqLen);
    for (const auto& [token, sum] : observer.weight_sum_) {
      ASSERT_NEAR(sum, c.routed_scaling_factor, 1e-5) << "layer " << l << " token " << token;
    }
    acts = std::move(out);
  }
  const std::string p = "layers.1.";
  for (const char* m :
       {"attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.compressor.wkv",
        "attn.indexer.wq_b", "attn.indexer.weights_proj", "ffn.gate", "ffn.shared_experts.w1",
        "ffn.shared_experts.w2", "ffn.shared_experts.w3"}) {
    EXPECT_GT(observer.amax_.count(p + m), 0u) << p + m;
  }
  EXPECT_GT(observer.kv_.count("layers.1.attn.kv"), 0u);
  // Every routed expert of every layer receives tokens (distinct tid2eid rows, spread scores).
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (int64_t e = 0; e < c.n_routed_experts; ++e) {
      const std::string m = "layers." + std::to_string(l) + ".ffn.experts." + std::to_string(e);
      EXPECT_GT(observer.amax_.count(m + ".w1"), 0u) << m;
    }
  }
  // The clamped SwiGLU bounds every w2 input: |wt * silu(min(g,10)) * clamp(u,+-10)| <=
  // route_scale * 10 * silu(10) (calibration_runtime.md §7.3).
  const double bound = c.routed_scaling_factor * 10.0 * 10.0 / (1.0 + std::exp(-10.0));
  for (const auto& [module, amax] : observer.amax_) {
    if (module.find(".experts.") != std::string::npos &&
        module.compare(module.size() - 3, 3, ".w2") == 0) {
      EXPECT_LE(amax, bound * (1 + 1.0 / 128)) << module;  // + BF16 rounding
    }
  }

  auto head = LoadHead(*ckpt_, *device_);
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<float> hidden, logits;
  ASSERT_TRUE(HeadForward(*ctx, c, *head, *acts, &hidden, &logits).ok());
  EXPECT_EQ(static_cast<int64_t>(logits.size()), kSequences * kSeqLen * c.vocab_size);
  EXPECT_TRUE(Bf16Exact(hidden));

  // The MTP block on the last layer's streams and the next tokens' ids.
  auto mtp = LoadMtp(*ckpt_, *device_);
  ASSERT_TRUE(mtp.ok()) << mtp.status();
  std::vector<int32_t> next(ids_.begin() + 1, ids_.end());
  next.push_back(ids_.front());
  EXPECT_EQ(RunMtp(*ctx, *ckpt_, *mtp, *acts, {1, 2, 3}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto mtp_out = RunMtp(*ctx, *ckpt_, *mtp, *acts, next);
  ASSERT_TRUE(mtp_out.ok()) << mtp_out.status();
  EXPECT_TRUE(Bf16Exact(mtp_out->streams));
  EXPECT_EQ(mtp_out->token_ids, next);
  for (const char* m : {"mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.attn.wq_a", "mtp.0.ffn.gate",
                        "mtp.0.ffn.shared_experts.w2"}) {
    EXPECT_GT(observer.amax_.count(m), 0u) << m;
  }
  std::vector<float> mtp_hidden, mtp_logits;
  ASSERT_TRUE(HeadForward(*ctx, c, mtp->head, *mtp_out, &mtp_hidden, &mtp_logits).ok());
  for (float f : mtp_logits) ASSERT_TRUE(std::isfinite(f));
}

// A task's sign of life: LoadLayer calls `alive` after the attention weights and after each
// routed expert, RunLayer after every product on the host; the results do not change.
TEST_F(V4LayerTest, LoadAndForwardSignLifeWithoutChangingABit) {
  const V4Config& c = ckpt_->config;
  int loads = 0, products = 0;
  auto weights = LoadLayer(*ckpt_, 0, *device_, [&loads] { ++loads; });
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(loads, 1 + c.n_routed_experts);
  auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
  ASSERT_TRUE(acts.ok());
  auto quiet = MakeForwardContext(*device_, Numerics::kOfficial, nullptr);
  ASSERT_TRUE(quiet.ok());
  ForwardContext signing = *quiet;
  signing.alive = [&products] { ++products; };
  auto a = RunLayer(*quiet, c, *weights, *acts);
  auto b = RunLayer(signing, c, *weights, *acts);
  ASSERT_TRUE(a.ok() && b.ok());
  // At least the router and the shared expert's three products, and one per expert reached.
  EXPECT_GE(products, 4);
  EXPECT_EQ(a->streams, b->streams);
}

// Bytes the process's malloc holds now, every arena and mmapped chunk.
int64_t HeapBytes() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

TEST_F(V4LayerTest, ALoadedLayerHoldsItsDenseWeightsAndNoRoutedExpert) {
  const V4Config& c = ckpt_->config;
  const LayerMemory model =
      EstimateLayerMemory(ckpt_->inventory, "layers.1.", DecodedWidth::kAsStored);
  // Names, vectors' headers, alignment: far less than one decoded expert.
  constexpr int64_t kSlack = 64 << 10;
  ASSERT_EQ(model.expert_bytes, 3 * c.moe_intermediate_size * c.hidden_size * 2);
  ASSERT_LT(kSlack, model.expert_bytes);
  auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
  auto ctx = MakeForwardContext(*device_, Numerics::kOfficial, nullptr);
  ASSERT_TRUE(acts.ok() && ctx.ok());
  const int64_t before = HeapBytes();
  auto weights = LoadLayer(*ckpt_, 1, *device_);
  ASSERT_TRUE(weights.ok()) << weights.status();
  const int64_t loaded = HeapBytes() - before;
  EXPECT_GE(loaded, model.dense_bytes - kSlack);
  EXPECT_LE(loaded, model.dense_bytes + kSlack);
  // The forward decodes the experts its tokens reach and keeps none of them (the first run also
  // leaves the thread pools' and BLAS's one-time buffers, so the second is measured).
  ASSERT_TRUE(RunLayer(*ctx, c, *weights, *acts).ok());
  const int64_t warm = HeapBytes();
  ASSERT_TRUE(RunLayer(*ctx, c, *weights, *acts).ok());
  EXPECT_LE(HeapBytes() - warm, kSlack);
}

TEST_F(V4LayerTest, OfficialStaysAbove20DbSqnrOfMathInOneLayer) {
  const V4Config& c = ckpt_->config;
  auto weights = LoadLayer(*ckpt_, 0, *device_);
  ASSERT_TRUE(weights.ok());
  auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
  ASSERT_TRUE(acts.ok());
  auto math = MakeForwardContext(*device_, Numerics::kMath, nullptr);
  auto official = MakeForwardContext(*device_, Numerics::kOfficial, nullptr);
  auto a = RunLayer(*math, c, *weights, *acts);
  auto b = RunLayer(*official, c, *weights, *acts);
  ASSERT_TRUE(a.ok() && b.ok());
  double signal = 0.0, noise = 0.0;
  for (size_t i = 0; i < a->streams.size(); ++i) {
    signal += double(a->streams[i]) * a->streams[i];
    noise += double(a->streams[i] - b->streams[i]) * (a->streams[i] - b->streams[i]);
  }
  // FP8 E4M3 (3 mantissa bits, power-of-two block scales) on every FP8/FP4 GEMM input keeps
  // each product within ~25-30 dB; one layer must stay above 20 dB and must differ.
  EXPECT_GT(noise, 0.0);
  EXPECT_GT(10.0 * std::log10(signal / noise), 20.0);
}

// The embedding, every layer (hash, CSA, HCA) and the head in both numerics: the host threads
// split every non-GEMM loop (min_work 1), unevenly (3 threads of one pool, reused by every loop),
// and the bytes do not move. The device and its Gemm are the same for both runs, so only the
// host threads differ.
TEST_F(V4LayerTest, HostThreadCountDoesNotChangeABit) {
  const V4Config& c = ckpt_->config;
  auto head = LoadHead(*ckpt_, *device_);
  ASSERT_TRUE(head.ok()) << head.status();
  for (Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
    auto one = MakeForwardContext(*device_, numerics, nullptr);
    ASSERT_TRUE(one.ok());
    ASSERT_EQ(one->threads.count, 1);  // the device's cpu_threads
    ForwardContext three = *one;
    kernels::cpu::ThreadPool pool(3);
    three.threads = {.count = 3, .min_work = 1, .pool = &pool};
    auto a = Embed(*ckpt_, ids_, kSequences, kSeqLen);
    ASSERT_TRUE(a.ok());
    auto embedded_b = Embed(*ckpt_, ids_, kSequences, kSeqLen, three.threads);
    ASSERT_TRUE(embedded_b.ok());
    EXPECT_EQ(embedded_b->streams, a->streams);
    V4Activations b = std::move(*embedded_b);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      auto weights = LoadLayer(*ckpt_, l, *device_);
      ASSERT_TRUE(weights.ok()) << weights.status();
      auto next_a = RunLayer(*one, c, *weights, *a);
      auto next_b = RunLayer(three, c, *weights, b);
      ASSERT_TRUE(next_a.ok() && next_b.ok());
      a = std::move(next_a);
      b = std::move(*next_b);
      ASSERT_EQ(a->streams.size(), b.streams.size());
      EXPECT_EQ(memcmp(a->streams.data(), b.streams.data(), b.streams.size() * 4), 0)
          << NumericsName(numerics) << " layer " << l;
    }
    std::vector<float> hidden_a, logits_a, hidden_b, logits_b;
    ASSERT_TRUE(HeadForward(*one, c, *head, *a, &hidden_a, &logits_a).ok());
    ASSERT_TRUE(HeadForward(three, c, *head, b, &hidden_b, &logits_b).ok());
    EXPECT_EQ(hidden_a, hidden_b) << NumericsName(numerics);
    EXPECT_EQ(memcmp(logits_a.data(), logits_b.data(), logits_a.size() * 4), 0)
        << NumericsName(numerics);
  }
}

TEST_F(V4LayerTest, SpilledActivationsComeBackBitIdentical) {
  auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
  ASSERT_TRUE(acts.ok());
  acts->streams[5] = -0.0f;
  acts->streams[6] = 1e-40f;  // subnormal
  const std::string path = dir_ + "/acts.safetensors";
  ASSERT_TRUE(SpillActivations(*acts, path).ok());
  auto back = ReadActivations(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->sequences, kSequences);
  EXPECT_EQ(back->seq_len, kSeqLen);
  EXPECT_EQ(back->hc_mult, acts->hc_mult);
  EXPECT_EQ(back->hidden_size, acts->hidden_size);
  EXPECT_EQ(back->token_ids, acts->token_ids);
  ASSERT_EQ(back->streams.size(), acts->streams.size());
  EXPECT_EQ(memcmp(back->streams.data(), acts->streams.data(), acts->streams.size() * 4), 0);

  // A safetensors file without the two tensors (a checkpoint shard).
  const std::string shard = ckpt_->dir->shards().front()->path();
  const absl::Status s = ReadActivations(shard).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token_ids"), std::string::npos) << s;
}

TEST_F(V4LayerTest, RejectsBadLayersActivationsAndIds) {
  const V4Config& c = ckpt_->config;
  EXPECT_EQ(LoadLayer(*ckpt_, c.num_hidden_layers, *device_).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> bad = ids_;
  bad[17] = static_cast<int32_t>(c.vocab_size);
  const absl::Status s = Embed(*ckpt_, bad, kSequences, kSeqLen).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("position 17"), std::string::npos) << s;
  auto weights = LoadLayer(*ckpt_, 0, *device_);
  ASSERT_TRUE(weights.ok());
  auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
  ASSERT_TRUE(acts.ok());
  acts->streams.pop_back();
  auto ctx = MakeForwardContext(*device_, Numerics::kMath, nullptr);
  EXPECT_EQ(RunLayer(*ctx, c, *weights, *acts).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace quantd::model
