// The calibration core: the amax table (merge by max, idempotent, order-independent bytes), the
// observer (weighted / unweighted w2, the clamped-SwiGLU bound), the export policy under each
// option, and CalibrateLayerSlice on the tiny V4 fixture (spilling and data-parallel slices of
// the batches do not change the table or the activations).
#include <string.h>

#include <cmath>
#include <filesystem>

#include "gtest/gtest.h"
#include "server/calibration/amax_observer.h"
#include "server/calibration/amax_table.h"
#include "server/calibration/calibrate_layer.h"
#include "server/calibration/export_amax.h"
#include "server/checkpoint/atomic_file.h"
#include "server/model/v4_layer.h"
#include "tests/unit/v4_tiny_checkpoint.h"

namespace quantd::calibration {
namespace {

AmaxTable Slice(const std::string& name) {
  AmaxTable t;
  t.AddSlice(name);
  return t;
}

TEST(AmaxTableTest, MergeIsMaxAndSumAndIgnoresARerun) {
  AmaxTable a = Slice("layer 0 slice 0 of 2");
  a.Record("layers.0.attn.wq_a", 3.5f, 10);
  a.RecordW2("layers.0.ffn.experts.1.w2", 2.0f, 1.25f, 4);
  AmaxTable b = Slice("layer 0 slice 1 of 2");
  b.Record("layers.0.attn.wq_a", 2.5f, 6);
  b.RecordW2("layers.0.ffn.experts.1.w2", 1.0f, 1.5f, 3);
  b.Record("layers.0.ffn.experts.2.w1", 0.75f, 2);

  AmaxTable ab, ba;
  ASSERT_TRUE(ab.Merge(a).ok());
  ASSERT_TRUE(ab.Merge(b).ok());
  ASSERT_TRUE(ba.Merge(b).ok());
  ASSERT_TRUE(ba.Merge(a).ok());
  EXPECT_EQ(ab.Serialize(), ba.Serialize());
  const AmaxEntry& q = ab.entries().at("layers.0.attn.wq_a");
  EXPECT_EQ(q.amax, 3.5f);
  EXPECT_EQ(q.tokens, 16);
  EXPECT_FALSE(q.has_unweighted);
  const AmaxEntry& w2 = ab.entries().at("layers.0.ffn.experts.1.w2");
  EXPECT_EQ(w2.amax, 2.0f);
  EXPECT_EQ(w2.unweighted_amax, 1.5f);
  EXPECT_EQ(w2.tokens, 7);
  EXPECT_TRUE(w2.has_unweighted);

  // A rerun of a slice changes nothing; a table overlapping only partly is refused.
  const std::string before = ab.Serialize();
  ASSERT_TRUE(ab.Merge(a).ok());
  EXPECT_EQ(ab.Serialize(), before);
  AmaxTable partial = Slice("layer 0 slice 0 of 2");
  partial.AddSlice("layer 0 slice 9 of 2");
  AmaxTable c;
  ASSERT_TRUE(c.Merge(a).ok());
  EXPECT_EQ(c.Merge(partial).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.Merge(AmaxTable()).code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<AmaxTable> back = AmaxTable::Parse(before, "t.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == ab);
  EXPECT_EQ(back->Serialize(), before);
  // 0.1f is not 0.1: the serialization keeps every float bit.
  AmaxTable f = Slice("s");
  f.Record("m", 0.1f, 1);
  EXPECT_EQ(AmaxTable::Parse(f.Serialize(), "f")->entries().at("m").amax, 0.1f);
}

TEST(AmaxTableTest, ParseRejectsBadRowsNamingTheModule) {
  for (const char* text : {
           R"({"format":"quantd-amax-table/1","slices":[],"modules":{"m":{"amax":-1,"tokens":1}}})",
           R"({"format":"quantd-amax-table/1","slices":[],"modules":{"m":{"amax":0.1,"tokens":1}}})",
           R"({"format":"quantd-amax-table/1","slices":[],"modules":{"m":{"amax":1,"tokens":-1}}})",
           R"({"format":"quantd-amax-table/1","slices":[],"modules":{"m":{"amax":1}}})"}) {
    absl::StatusOr<AmaxTable> t = AmaxTable::Parse(text, "t.json");
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_NE(t.status().message().find("t.json: module m"), std::string::npos) << t.status();
  }
  EXPECT_FALSE(AmaxTable::Parse("{}", "t.json").ok());
}

TEST(AmaxObserverTest, RecordsBothW2InputsAndChecksTheSwigluBound) {
  // 10·silu(10) = 99.99546, plus one BF16 ulp of headroom.
  EXPECT_NEAR(UnweightedW2Bound(10.0f), 99.99546 * (1 + 1.0 / 256), 1e-3);
  EXPECT_EQ(UnweightedW2Bound(0.0f), 0.0f);
  AmaxTable table = Slice("s");
  AmaxObserver observer(&table, 4, 10.0f);
  const std::string q = "layers.4.attn.wq_a", w2 = "layers.4.ffn.experts.7.w2";
  const float x[6] = {1.0f, -5.5f, 2.0f, 0.0f, 3.0f, -1.0f};  // [2, 3]
  model::LinearInput in;
  in.module = &q;
  in.x = x;
  in.rows = 2;
  in.cols = 2;  // ld 3: the third column is not part of the input
  in.ld = 3;
  observer.OnLinearInput(in);
  EXPECT_EQ(table.entries().at(q).amax, 5.5f);
  EXPECT_EQ(table.entries().at(q).tokens, 2);

  const float weights[2] = {0.5f, 2.0f};
  const float unweighted[6] = {2.0f, -11.0f, 4.0f, 0.0f, 1.5f, -0.5f};
  in.module = &w2;
  in.expert = 7;
  in.routing_weights = weights;
  in.unweighted_x = unweighted;
  observer.OnLinearInput(in);
  EXPECT_TRUE(observer.status().ok());
  EXPECT_EQ(table.entries().at(w2).amax, 5.5f);
  EXPECT_EQ(table.entries().at(w2).unweighted_amax, 11.0f);

  const float too_large[6] = {100.5f, 0, 0, 0, 0, 0};
  in.unweighted_x = too_large;
  observer.OnLinearInput(in);
  EXPECT_EQ(observer.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(observer.status().message().find("layer 4 expert 7"), std::string::npos)
      << observer.status();

  AmaxObserver second(&table, 2, 10.0f);
  const float nan[6] = {NAN, 0, 0, 0, 0, 0};
  in.x = nan;
  in.unweighted_x = nullptr;
  second.OnLinearInput(in);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(second.status().message().find("layer 2"), std::string::npos);
}

// Two layers, three experts; layer 1 expert 2 never reached.
class ExportTest : public testing::Test {
 protected:
  void SetUp() override {
    config_.num_hidden_layers = 2;
    config_.n_routed_experts = 3;
    table_.AddSlice("s");
    table_.Record("layers.0.attn.wq_a", 7.0f, 5);
    for (int l = 0; l < 2; ++l) {
      for (int e = 0; e < (l == 0 ? 3 : 2); ++e) {
        const std::string p = "layers." + std::to_string(l) + ".ffn.experts." + std::to_string(e);
        table_.Record(p + ".w1", 1.0f + e + 10 * l, 1);
        table_.Record(p + ".w3", 2.0f + e + 10 * l, 1);
        // weighted 0.5 + e, unweighted 0.25 + 2e (e = 0: weighted larger).
        table_.RecordW2(p + ".w2", 0.5f + e + 10 * l, 0.25f + 2 * e + 10 * l, 1);
      }
    }
  }
  std::map<std::string, float> Export(const job::CalibrationSpec& spec, ExportReport* report) {
    absl::StatusOr<std::map<std::string, float>> m = ExportInputAmax(table_, config_, spec, report);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *m : std::map<std::string, float>{};
  }
  model::V4Config config_;
  AmaxTable table_;
};

TEST_F(ExportTest, DefaultsPerExpertMaxOfW2InputsLayerMaxFill) {
  job::CalibrationSpec spec;
  ExportReport report;
  std::map<std::string, float> m = Export(spec, &report);
  EXPECT_EQ(m.size(), 1u + 2 * 3 * 3);
  EXPECT_EQ(m["layers.0.attn.wq_a"], 7.0f);
  // w1 == w3 == max(w1, w3).
  EXPECT_EQ(m["layers.0.ffn.experts.1.w1"], 3.0f);
  EXPECT_EQ(m["layers.0.ffn.experts.1.w3"], 3.0f);
  EXPECT_EQ(m["layers.0.ffn.experts.0.w2"], 0.5f);   // weighted > unweighted
  EXPECT_EQ(m["layers.0.ffn.experts.2.w2"], 4.25f);  // unweighted > weighted
  // Layer 1 expert 2 takes layer 1's max per projection.
  EXPECT_EQ(m["layers.1.ffn.experts.2.w1"], 13.0f);
  EXPECT_EQ(m["layers.1.ffn.experts.2.w3"], 13.0f);
  EXPECT_EQ(m["layers.1.ffn.experts.2.w2"], 12.25f);
  EXPECT_EQ(report.filled, (std::vector<std::string>{"layers.1.ffn.experts.2.w1",
                                                     "layers.1.ffn.experts.2.w2",
                                                     "layers.1.ffn.experts.2.w3"}));
  EXPECT_TRUE(report.layers_without_experts.empty());
}

TEST_F(ExportTest, EachOptionChangesExactlyItsPart) {
  job::CalibrationSpec spec;
  ExportReport r1;
  spec.w2_input = job::W2Input::kUnweighted;
  EXPECT_EQ(Export(spec, &r1)["layers.0.ffn.experts.0.w2"], 0.25f);
  spec.w2_input = job::W2Input::kWeighted;
  EXPECT_EQ(Export(spec, &r1)["layers.0.ffn.experts.2.w2"], 2.5f);

  spec = {};
  spec.uncalibrated = job::UncalibratedFill::kModelMax;
  ExportReport r2;
  std::map<std::string, float> m = Export(spec, &r2);
  EXPECT_EQ(m["layers.1.ffn.experts.2.w2"], 12.25f);  // layer 1 holds the model max too
  EXPECT_EQ(m["layers.0.ffn.experts.0.w2"], 0.5f);
  EXPECT_EQ(r2.filled.size(), 3u);

  spec = {};
  spec.expert_amax = job::ExpertAmax::kLayerMax;
  ExportReport r3;
  m = Export(spec, &r3);
  for (int e = 0; e < 3; ++e) {
    const std::string p = "layers.0.ffn.experts." + std::to_string(e);
    EXPECT_EQ(m[p + ".w1"], 4.0f) << p;
    EXPECT_EQ(m[p + ".w3"], 4.0f) << p;
    EXPECT_EQ(m[p + ".w2"], 4.25f) << p;
  }
}

TEST_F(ExportTest, ZeroNonExpertAmaxAndNoCalibratedExpertAreErrors) {
  job::CalibrationSpec spec;
  ExportReport report;
  AmaxTable zero = Slice("z");
  zero.Record("layers.0.attn.wq_a", 0.0f, 3);
  ASSERT_TRUE(table_.Merge(zero).ok());
  absl::StatusOr<std::map<std::string, float>> m = ExportInputAmax(table_, config_, spec, &report);
  EXPECT_TRUE(m.ok());  // max(7, 0)
  AmaxTable only_zero = Slice("z");
  only_zero.Record("layers.0.attn.wq_a", 0.0f, 3);
  m = ExportInputAmax(only_zero, config_, spec, &report);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
}

class CalibrateLayerTest : public testing_util::V4TinyCheckpointTest {
 protected:
  void SetUp() override {
    V4TinyCheckpointTest::SetUp();
    if (HasFatalFailure()) return;
    // Six samples of two lengths.
    for (int s = 0; s < 6; ++s) {
      std::vector<int32_t> ids;
      for (int i = 0; i < (s % 2 == 0 ? 40 : 24); ++i) {
        ids.push_back(static_cast<int32_t>((s * 131 + i * 7919 + 13) % ckpt_->config.vocab_size));
      }
      samples_.push_back(std::move(ids));
    }
  }

  // Layers 0..1 over the samples, batched to `batch_bytes`, the batches split into `slices`
  // contiguous slices (a batch is the unit of work: a sequence's forward may differ in the last
  // bit with the other sequences of its GEMMs, so slices never regroup batches). The merged
  // table, and the outputs in batch order.
  void Run(int64_t slices, int64_t batch_bytes, const std::string& spill_dir, AmaxTable* table,
           std::vector<model::V4Activations>* out) {
    auto embedded = EmbedSlice(*ckpt_, samples_, batch_bytes);
    ASSERT_TRUE(embedded.ok()) << embedded.status();
    const int64_t n = static_cast<int64_t>(embedded->size());
    for (int64_t s = 0; s < slices; ++s) {
      std::vector<BatchActivations> acts;
      for (int64_t b = s * n / slices; b < (s + 1) * n / slices; ++b) {
        acts.push_back(std::move((*embedded)[b]));
      }
      for (int64_t layer = 0; layer < 2; ++layer) {
        SliceOptions options;
        options.slice = "layer " + std::to_string(layer) + " slice " + std::to_string(s);
        options.slice_index = s;
        options.spill_dir = spill_dir;
        auto r = CalibrateLayerSlice(*ckpt_, layer, std::move(acts), *device_, options);
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_TRUE(table->Merge(r->amax).ok());
        ReleaseBatches(acts);  // the caller drops a layer's input once it ran
        acts = std::move(r->output);
      }
      for (BatchActivations& b : acts) {
        if (b.spill_path.empty()) {
          out->push_back(std::move(b.host));
        } else {
          auto back = model::ReadActivations(b.spill_path);
          ASSERT_TRUE(back.ok());
          EXPECT_EQ(*checkpoint::Sha256File(b.spill_path), b.spill_sha256);
          out->push_back(std::move(*back));
        }
      }
    }
  }

  std::vector<std::vector<int32_t>> samples_;
};

void ExpectSame(const AmaxTable& a, const AmaxTable& b) {
  ASSERT_EQ(a.entries().size(), b.entries().size());
  for (const auto& [module, e] : a.entries()) {
    const AmaxEntry& o = b.entries().at(module);
    EXPECT_EQ(e.amax, o.amax) << module;
    EXPECT_EQ(e.unweighted_amax, o.unweighted_amax) << module;
    EXPECT_EQ(e.tokens, o.tokens) << module;
  }
}

void ExpectSameBytes(const std::vector<model::V4Activations>& a,
                     const std::vector<model::V4Activations>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].token_ids, b[i].token_ids) << "batch " << i;
    ASSERT_EQ(a[i].streams.size(), b[i].streams.size()) << "batch " << i;
    EXPECT_EQ(memcmp(a[i].streams.data(), b[i].streams.data(), a[i].streams.size() * 4), 0)
        << "batch " << i;
  }
}

TEST_F(CalibrateLayerTest, SlicesAndSpillingGiveTheSameTableAndActivations) {
  for (int64_t batch_bytes : {int64_t{1} << 40, int64_t{1}}) {
    SCOPED_TRACE(batch_bytes);
    AmaxTable one;
    std::vector<model::V4Activations> one_out;
    Run(1, batch_bytes, "", &one, &one_out);
    // Batches hold samples of one length: 2 (3 x 40, 3 x 24 tokens) or 6 (one each).
    ASSERT_EQ(one_out.size(), batch_bytes == 1 ? 6u : 2u);
    const int64_t tokens = 3 * 40 + 3 * 24;
    EXPECT_EQ(one.entries().at("layers.0.attn.wq_a").tokens, tokens);
    EXPECT_EQ(one.entries().at("layers.1.ffn.shared_experts.w1").tokens, tokens);
    int64_t routed = 0;
    for (const auto& [module, e] : one.entries()) {
      if (module.rfind("layers.1.ffn.experts.", 0) == 0 &&
          module.compare(module.size() - 3, 3, ".w2") == 0) {
        routed += e.tokens;
        EXPECT_TRUE(e.has_unweighted);
        EXPECT_GT(e.unweighted_amax, 0.0f);
        EXPECT_LE(e.unweighted_amax, UnweightedW2Bound(ckpt_->config.swiglu_limit));
      }
    }
    EXPECT_EQ(routed, tokens * ckpt_->config.num_experts_per_tok);

    // Two slices, spilled between layers: the same table and bytes.
    AmaxTable two;
    std::vector<model::V4Activations> two_out;
    const std::string spill = dir_ + "/spill" + std::to_string(batch_bytes);
    std::filesystem::create_directories(spill);
    Run(2, batch_bytes, spill, &two, &two_out);
    ExpectSame(one, two);
    ExpectSameBytes(one_out, two_out);
    EXPECT_EQ(two.slices().size(), 4u);
    // Only the last layer's spill files remain (the caller's); the inputs were removed.
    size_t files = 0;
    for (const auto& f : std::filesystem::directory_iterator(spill)) {
      EXPECT_EQ(f.path().filename().string().rfind("layer1.", 0), 0u) << f.path();
      ++files;
    }
    EXPECT_EQ(files, one_out.size());
  }
}

TEST_F(CalibrateLayerTest, AllExpertsSeeEveryTokenAndLeaveTheOutputUnchanged) {
  auto routed_in = EmbedSlice(*ckpt_, samples_, int64_t{1} << 40);
  auto all_in = EmbedSlice(*ckpt_, samples_, int64_t{1} << 40);
  ASSERT_TRUE(routed_in.ok() && all_in.ok());
  SliceOptions options;
  options.slice = "s";
  auto routed = CalibrateLayerSlice(*ckpt_, 1, std::move(*routed_in), *device_, options);
  options.all_experts = true;
  auto all = CalibrateLayerSlice(*ckpt_, 1, std::move(*all_in), *device_, options);
  ASSERT_TRUE(routed.ok() && all.ok()) << routed.status() << all.status();
  ASSERT_EQ(routed->output.size(), all->output.size());
  for (size_t i = 0; i < all->output.size(); ++i) {
    EXPECT_EQ(routed->output[i].host.streams, all->output[i].host.streams) << "batch " << i;
  }
  const int64_t tokens = 3 * 40 + 3 * 24;
  const float layer_input = all->amax.entries().at("layers.1.ffn.shared_experts.w1").amax;
  for (int64_t e = 0; e < ckpt_->config.n_routed_experts; ++e) {
    const std::string p = "layers.1.ffn.experts." + std::to_string(e);
    const AmaxEntry& w1 = all->amax.entries().at(p + ".w1");
    const AmaxEntry& w2 = all->amax.entries().at(p + ".w2");
    const AmaxEntry& routed_w2 = routed->amax.entries().at(p + ".w2");
    EXPECT_EQ(w1.tokens, tokens) << p;
    EXPECT_EQ(w2.tokens, tokens) << p;
    EXPECT_EQ(w1.amax, layer_input) << p;  // every token's ffn-normed input
    // The weighted input comes from the routed rows only; the unweighted one from all.
    EXPECT_EQ(w2.amax, routed_w2.amax) << p;
    EXPECT_GE(w2.unweighted_amax, routed_w2.unweighted_amax) << p;
  }
}

TEST_F(CalibrateLayerTest, ErrorsNameTheLayer) {
  auto batches = EmbedSlice(*ckpt_, {samples_[0]}, 1);
  ASSERT_TRUE(batches.ok());
  SliceOptions options;
  options.slice = "s";
  auto r = CalibrateLayerSlice(*ckpt_, 99, std::move(*batches), *device_, options);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("layer 99"), std::string::npos) << r.status();
  EXPECT_EQ(EmbedSlice(*ckpt_, {{}}, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace quantd::calibration
