// The DeepSeek-V4 forward on the CUDA ops (MakeForwardContext / LoadLayer / RunLayer /
// HeadForward / RunMtp on cuda:0, server/model/v4_cuda_ops.h) against the same graph on the host
// ops, on the tiny fixture: every layer kind (0: hash routing + sliding window only, 1: CSA with
// the indexer, 2: HCA), both numerics, the same input streams on both sides; then the head and
// the MTP block.
// Compares the output streams and what the observer saw (module names, calls, rows, expert ids,
// routing weights, max |x| of every linear input and KV cache). Skips without a CUDA device;
// builds without CUDA have no device forward and skip as well.
//
// Tolerances. The device differs from the host in the order of the GEMMs' fp32 accumulations
// (cuBLAS against OpenBLAS; exact BF16 operands in official numerics) and in expf against the
// host's exp (Sinkhorn, SwiGLU, router scores, compressor pooling, attention softmax): a few
// ulps of float32 relative at each op (2^-24 units). Through the layer's ~20 dependent steps,
// each well-conditioned on this fixture (norm weights near 1, rms of the streams 0.5..50), that
// stays below 2^-16 relative; math numerics are checked at 2^-12 of max(|value|, rms of the
// tensor), 16x that margin. Official numerics round to BF16 after most ops: an fp32 difference
// can move a value across a BF16 rounding boundary, a change of one BF16 ulp (2^-8 relative),
// and such a flip propagates linearly through the following ops (each output mixing a few
// flipped inputs at most: hc_post's 1 + hc terms, the norm's scale, the residual); a flip at an
// FP8 boundary of the activation simulation (one E4M3 ulp, 2^-3 of that element) is diluted by
// the GEMM's k >= 128 terms below a BF16 ulp of the output. Official is checked at 2^-5 of
// max(|value|, rms): 8 BF16 ulps.
//
// Whole tokens may differ for two discrete reasons, both confined to the token (each layer starts
// from the same input on both sides): (1) a routed expert chosen at a near tie (scores within the
// fp32 difference): at most 1% of the tokens; (2) in the CSA layer, indexer scores that tie
// exactly at the top-k boundary (exact zeros where every indexer head's relu is 0; BF16-equal
// official scores), where the device picks the lower entry ids and the host libstdc++'s
// selection (v4_cuda_ops.h). Only a query with more visible entries than picks
// ((position + 1) / 4 > k) can meet (2); at most 30% of the tokens may (57 of the 280 tokens
// here tie at the boundary, in both numerics, counted on the host), and the modules after
// the attention (wo_a, wo_b, ffn.*) are then compared only where no such token differed. A bug
// in any block moves nearly every token, or a token that (2) cannot explain. The test prints the
// counts.
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/model/v4_forward_ops.h"
#include "server/model/v4_layer.h"
#include "server/model/v4_stored_experts.h"
#include "tests/unit/v4_tiny_checkpoint.h"

#if QUANTD_HAVE_CUDA_HEADERS
#include "server/model/v4_cuda_ops.h"
#include "tests/unit/v4_cuda_test_util.h"
#endif

namespace quantd::model {
namespace {

#if QUANTD_HAVE_CUDA_HEADERS

// What one layer showed the observer, per module.
struct ModuleRecord {
  int64_t calls = 0;
  int64_t rows = 0;
  int expert = -1;
  float amax = 0.0f;
};

class RecordingObserver final : public Observer {
 public:
  void OnLinearInput(const LinearInput& in) override {
    ModuleRecord& r = linear_[*in.module];
    ++r.calls;
    r.rows += in.rows;
    r.expert = in.expert;
    for (int64_t i = 0; i < in.rows; ++i) {
      for (int64_t c = 0; c < in.cols; ++c) {
        r.amax = std::max(r.amax, std::fabs(in.x[i * in.ld + c]));
      }
    }
    if (in.routing_weights != nullptr) {
      for (int64_t i = 0; i < in.rows; ++i) weight_sum_[in.tokens[i]] += in.routing_weights[i];
    }
  }
  void OnKvCache(const KvCacheInput& in) override {
    ModuleRecord& r = kv_[*in.module];
    ++r.calls;
    r.rows += in.rows;
    for (int64_t i = 0; i < in.rows * in.cols; ++i) r.amax = std::max(r.amax, std::fabs(in.kv[i]));
  }

  std::map<std::string, ModuleRecord> linear_;  // linear module -> what it saw
  std::map<std::string, ModuleRecord> kv_;      // KV cache module -> what it saw
  std::map<int64_t, double> weight_sum_;        // token -> sum of its routing weights
};

double Rms(const std::vector<float>& v) {
  double sq = 0.0;
  for (float f : v) sq += static_cast<double>(f) * f;
  return std::sqrt(sq / static_cast<double>(v.size()));
}

// The relative bound of the comment at the top, per numerics.
double Tolerance(Numerics numerics) {
  return numerics == Numerics::kOfficial ? std::ldexp(1.0, -5) : std::ldexp(1.0, -12);
}

// Tokens (rows of `row` values) of `got` with an element beyond tol * max(|want|, rms(want)),
// ascending; *worst is the largest relative difference.
std::vector<int64_t> TokensBeyond(const std::vector<float>& got, const std::vector<float>& want,
                                  int64_t row, double tol, double* worst) {
  const double rms = Rms(want);
  std::vector<int64_t> bad;
  *worst = 0.0;
  for (size_t t = 0; t * row < want.size(); ++t) {
    bool token_bad = false;
    for (int64_t c = 0; c < row; ++c) {
      const size_t i = t * row + c;
      const double err = std::fabs(static_cast<double>(got[i]) - want[i]) /
                         std::max<double>(std::fabs(want[i]), rms);
      *worst = std::max(*worst, err);
      if (!(err <= tol)) token_bad = true;  // a NaN is bad too
    }
    if (token_bad) bad.push_back(static_cast<int64_t>(t));
  }
  return bad;
}

// Whether `module` runs after the attention's key choice (its inputs carry the picks' effect).
bool AfterPicks(const std::string& module) {
  return module.find(".wo_a") != std::string::npos || module.find(".wo_b") != std::string::npos ||
         module.find(".ffn.") != std::string::npos;
}

// `after_picks`: compare max |x| of the modules after the attention's key choice too.
void ExpectSameRecords(const std::map<std::string, ModuleRecord>& got,
                       const std::map<std::string, ModuleRecord>& want, double tol,
                       bool after_picks, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [module, w] : want) {
    const auto it = got.find(module);
    ASSERT_NE(it, got.end()) << what << ": " << module << " not observed on the device";
    const ModuleRecord& g = it->second;
    EXPECT_EQ(g.calls, w.calls) << module;
    EXPECT_EQ(g.expert, w.expert) << module;
    // A routed expert's rows move with a routing choice made at a near tie (see the top).
    if (module.find(".experts.") == std::string::npos || g.rows == w.rows) {
      EXPECT_EQ(g.rows, w.rows) << module;
      if (!after_picks && AfterPicks(module)) continue;
      EXPECT_LE(std::fabs(g.amax - w.amax), tol * w.amax)
          << module << ": " << g.amax << " vs " << w.amax;
    }
  }
}

class V4CudaLayerTest : public testing_util::V4TinyCheckpointTest {
 protected:
  void SetUp() override {
    if (testing_util::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    V4TinyCheckpointTest::SetUp();
    if (HasFatalFailure()) return;
    auto cuda = compute::OpenDevice("cuda:0", {});
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = std::move(*cuda);
    for (int64_t i = 0; i < kSequences * kSeqLen; ++i) {
      ids_.push_back(static_cast<int32_t>((i * 7919 + 13) % ckpt_->config.vocab_size));
    }
  }

  static constexpr int64_t kSequences = 2;
  static constexpr int64_t kSeqLen = 140;  // > 128: HCA gets an entry, the window slides
  std::unique_ptr<compute::Device> cuda_;
  std::vector<int32_t> ids_;
};

TEST_F(V4CudaLayerTest, EveryLayerKindMatchesTheHostInBothNumerics) {
  const V4Config& c = ckpt_->config;
  ASSERT_EQ(c.compress_ratios, (std::vector<int64_t>{0, 4, 128, 0}));
  ASSERT_TRUE(c.IsHashLayer(0));
  const int64_t row = c.hc_mult * c.hidden_size;
  const int64_t picks = std::min(c.index_topk, kSeqLen / 4);  // the CSA layer's k
  for (Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
    SCOPED_TRACE(NumericsName(numerics));
    const double tol = Tolerance(numerics);
    RecordingObserver host_seen, device_seen;
    auto host_ctx = MakeForwardContext(*device_, numerics, &host_seen);
    ASSERT_TRUE(host_ctx.ok()) << host_ctx.status();
    auto device_ctx = MakeForwardContext(*cuda_, numerics, &device_seen);
    ASSERT_TRUE(device_ctx.ok()) << device_ctx.status();
    auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
    ASSERT_TRUE(acts.ok()) << acts.status();
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      host_seen = {};
      device_seen = {};
      auto host_weights = LoadLayer(*ckpt_, l, *device_);
      ASSERT_TRUE(host_weights.ok()) << host_weights.status();
      auto want = RunLayer(*host_ctx, c, *host_weights, *acts);
      ASSERT_TRUE(want.ok()) << want.status();

      // Decoded by the CUDA backend and resident on the device (the routed experts decoded per
      // expert by the forward).
      auto device_weights = LoadLayer(*ckpt_, l, *cuda_);
      ASSERT_TRUE(device_weights.ok()) << device_weights.status();
      EXPECT_EQ(device_weights->placed, "cuda:0");
      auto got = RunLayer(*device_ctx, c, *device_weights, *acts);
      ASSERT_TRUE(got.ok()) << got.status();

      ASSERT_EQ(got->streams.size(), want->streams.size());
      EXPECT_EQ(got->token_ids, want->token_ids);
      double worst = 0.0;
      int64_t tied_picks = 0, other = 0;  // tokens beyond the bound, by reason (see the top)
      for (const int64_t t : TokensBeyond(got->streams, want->streams, row, tol, &worst)) {
        const bool can_tie = c.CompressRatio(l) == 4 && (t % kSeqLen + 1) / 4 > picks;
        (can_tie ? tied_picks : other) += 1;
      }
      printf(
          "[ %s layer %ld ] worst |device - host| / max(|host|, rms) = %.3g (bound %.3g); "
          "tokens beyond it: %ld that may have tied indexer picks, %ld others, of %ld\n",
          NumericsName(numerics), l, worst, tol, tied_picks, other, acts->tokens());
      EXPECT_LE(other * 100, acts->tokens()) << "more than 1% of the tokens differ";
      EXPECT_LE(tied_picks * 100, 30 * acts->tokens()) << "more than 30% of the tokens differ";

      ExpectSameRecords(device_seen.linear_, host_seen.linear_, tol, tied_picks == 0,
                        "linear inputs");
      ExpectSameRecords(device_seen.kv_, host_seen.kv_, tol, true, "KV cache");
      // Routing weights: the router's float32 scores within (2^-19 + (topk + 2) * 2^-23)
      // relative (v4_moe_blocks.h), summed over topk: 2^-16 relative of route_scale.
      ASSERT_EQ(device_seen.weight_sum_.size(), host_seen.weight_sum_.size());
      for (const auto& [token, sum] : host_seen.weight_sum_) {
        EXPECT_NEAR(device_seen.weight_sum_[token], sum, std::ldexp(sum, -16)) << token;
      }
      acts = std::move(want);  // the next layer starts from the host's output on both sides
    }
  }
}

// The head and the MTP block run on the device too: the final hidden state and the logits
// within the layer's bound of the host's (the head's hc mix goes through expf as hc_pre's
// does, v4_mhc_blocks.h).
TEST_F(V4CudaLayerTest, HeadAndMtpMatchTheHost) {
  const V4Config& c = ckpt_->config;
  for (Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
    SCOPED_TRACE(NumericsName(numerics));
    const double tol = Tolerance(numerics);
    auto host_ctx = MakeForwardContext(*device_, numerics, nullptr);
    auto cuda_ctx = MakeForwardContext(*cuda_, numerics, nullptr);
    ASSERT_TRUE(host_ctx.ok() && cuda_ctx.ok());
    auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
    ASSERT_TRUE(acts.ok()) << acts.status();
    auto host_head = LoadHead(*ckpt_, *device_);
    auto cuda_head = LoadHead(*ckpt_, *cuda_);
    ASSERT_TRUE(host_head.ok() && cuda_head.ok());
    std::vector<float> want_hidden, want_logits, got_hidden, got_logits;
    ASSERT_TRUE(
        HeadForward(*host_ctx, c, *host_head, *acts, &want_hidden, &want_logits).ok());
    auto head = HeadForward(*cuda_ctx, c, *cuda_head, *acts, &got_hidden, &got_logits);
    ASSERT_TRUE(head.ok()) << head;
    double worst = 0.0;
    EXPECT_TRUE(TokensBeyond(got_hidden, want_hidden, c.hidden_size, tol, &worst).empty())
        << worst;
    EXPECT_TRUE(TokensBeyond(got_logits, want_logits, c.vocab_size, tol, &worst).empty())
        << worst;

    auto host_mtp = LoadMtp(*ckpt_, *device_);
    auto cuda_mtp = LoadMtp(*ckpt_, *cuda_);
    ASSERT_TRUE(host_mtp.ok() && cuda_mtp.ok());
    std::vector<int32_t> next(ids_.begin() + 1, ids_.end());
    next.push_back(ids_.front());
    auto want = RunMtp(*host_ctx, *ckpt_, *host_mtp, *acts, next);
    auto got = RunMtp(*cuda_ctx, *ckpt_, *cuda_mtp, *acts, next);
    ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
    // The MTP block is a hash-free score-routed layer: near-tie routing may move 1% of tokens.
    EXPECT_LE(TokensBeyond(got->streams, want->streams, c.hc_mult * c.hidden_size, tol, &worst)
                      .size() *
                  100,
              static_cast<size_t>(acts->tokens()));
  }
}

// A layer's routed experts go to the device once (one upload of their stored bytes, then each
// expert decoded from device memory) and its small parameters once (the ops' parameter cache):
// repeated forwards of a layer upload nothing more and stay within the host's bound; the experts
// of the two layers used last stay uploaded (evaluation alternates a source and a quantized
// layer), a third layer evicts the least recently used.
TEST_F(V4CudaLayerTest, ExpertsAndParametersAreUploadedOncePerLayer) {
  const V4Config& c = ckpt_->config;
  const int64_t row = c.hc_mult * c.hidden_size;
  auto host_ctx = MakeForwardContext(*device_, Numerics::kMath, nullptr);
  auto cuda_ctx = MakeForwardContext(*cuda_, Numerics::kMath, nullptr);
  ASSERT_TRUE(host_ctx.ok() && cuda_ctx.ok());
  const ForwardOps& ops = OpsOf(*cuda_ctx);
  auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
  ASSERT_TRUE(acts.ok()) << acts.status();
  std::vector<V4LayerWeights> on_device;
  for (int64_t l = 0; l < 3; ++l) {
    auto w = LoadLayer(*ckpt_, l, *cuda_);
    ASSERT_TRUE(w.ok()) << w.status();
    on_device.push_back(std::move(*w));
  }
  auto on_host = LoadLayer(*ckpt_, 2, *device_);
  ASSERT_TRUE(on_host.ok()) << on_host.status();
  // The stored bytes of layer 2's experts, as StoredExperts lays them out on any backend.
  auto stored = StoredExperts::Upload(on_host->moe.experts, device_->backend());
  ASSERT_TRUE(stored.ok()) << stored.status();
  auto want = RunLayer(*host_ctx, c, *on_host, *acts);
  ASSERT_TRUE(want.ok()) << want.status();

  OpsUploads first;
  for (int i = 0; i < 3; ++i) {
    auto got = RunLayer(*cuda_ctx, c, on_device[2], *acts);
    ASSERT_TRUE(got.ok()) << got.status();
    double worst = 0.0;
    // Near-tie routing may move 1% of the tokens (see the top).
    EXPECT_LE(TokensBeyond(got->streams, want->streams, row, Tolerance(Numerics::kMath), &worst)
                      .size() *
                  100,
              static_cast<size_t>(acts->tokens()))
        << worst;
    const OpsUploads u = ops.uploads();
    EXPECT_EQ(u.expert_layers, 1);
    EXPECT_EQ(u.expert_bytes, static_cast<int64_t>(stored->bytes()));
    if (i == 0) {
      first = u;
      EXPECT_GT(u.parameters, 0);
      EXPECT_GT(u.experts_decoded, 0);
      continue;
    }
    EXPECT_EQ(u.parameters, first.parameters);
    EXPECT_EQ(u.parameter_bytes, first.parameter_bytes);
    EXPECT_EQ(u.parameter_hits, first.parameter_hits + i * (first.parameters + first.parameter_hits));
    EXPECT_EQ(u.experts_decoded, (i + 1) * first.experts_decoded);
  }
  // Layers 1 and 2 stay; layer 0 then evicts layer 1 (used least recently), not layer 2.
  const auto run = [&](int64_t l) { ASSERT_TRUE(RunLayer(*cuda_ctx, c, on_device[l], *acts).ok()); };
  run(1);
  EXPECT_EQ(ops.uploads().expert_layers, 2);
  run(2);
  EXPECT_EQ(ops.uploads().expert_layers, 2);
  run(0);
  EXPECT_EQ(ops.uploads().expert_layers, 3);
  run(2);
  EXPECT_EQ(ops.uploads().expert_layers, 3);
  run(1);
  EXPECT_EQ(ops.uploads().expert_layers, 4);
}

// Host ops do not open a host device as a CUDA one; weights placed for one device are refused by
// a context on another, and bad inputs are refused on the device.
TEST_F(V4CudaLayerTest, RefusesMixedPlacementAndBadInput) {
  EXPECT_EQ(MakeCudaOps(*device_).status().code(), absl::StatusCode::kFailedPrecondition);
  auto host_ctx = MakeForwardContext(*device_, Numerics::kOfficial, nullptr);
  auto cuda_ctx = MakeForwardContext(*cuda_, Numerics::kOfficial, nullptr);
  ASSERT_TRUE(host_ctx.ok() && cuda_ctx.ok());
  auto on_device = LoadLayer(*ckpt_, 0, *cuda_);
  auto on_host = LoadLayer(*ckpt_, 0, *device_);
  ASSERT_TRUE(on_device.ok() && on_host.ok());
  auto acts = Embed(*ckpt_, ids_, kSequences, kSeqLen);
  ASSERT_TRUE(acts.ok()) << acts.status();
  EXPECT_EQ(RunLayer(*host_ctx, ckpt_->config, *on_device, *acts).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(RunLayer(*cuda_ctx, ckpt_->config, *on_host, *acts).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto head = LoadHead(*ckpt_, *device_);
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<float> hidden;
  EXPECT_EQ(HeadForward(*cuda_ctx, ckpt_->config, *head, *acts, &hidden, nullptr).code(),
            absl::StatusCode::kFailedPrecondition);

  acts->streams.pop_back();
  EXPECT_EQ(RunLayer(*cuda_ctx, ckpt_->config, *on_device, *acts).status().code(),
            absl::StatusCode::kInvalidArgument);
  acts->streams.push_back(0.0f);
  acts->token_ids[5] = static_cast<int32_t>(ckpt_->config.vocab_size);  // layer 0 routes by hash
  auto bad_id = RunLayer(*cuda_ctx, ckpt_->config, *on_device, *acts);
  EXPECT_EQ(bad_id.status().code(), absl::StatusCode::kInvalidArgument) << bad_id.status();
  EXPECT_NE(bad_id.status().message().find("token 5"), std::string::npos) << bad_id.status();
}

#endif  // QUANTD_HAVE_CUDA_HEADERS

}  // namespace
}  // namespace quantd::model
