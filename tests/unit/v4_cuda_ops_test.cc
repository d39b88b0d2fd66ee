// The CUDA ops of the DeepSeek-V4 forward (server/model/v4_cuda_ops.h) against the host ops
// (v4_host_ops.h) as oracle, op by op through the ForwardOps interface the forward is written
// over: memory, Place and Linear (with the observer's host copies, the FP8 and NVFP4 activation
// simulations), the MTP stream input, RMSNorm and hc_head, routing and grouping, and the MoE's
// gather / routing weights / scatter-add / routed sum. The launchers underneath are tested
// against the host blocks in v4_cuda_{blocks,moe,attention,cast}_test; here the ops' own steps
// (uploads of host parameters, scratch, the products' operand policy, host results) are.
// Skips without a CUDA device; builds without CUDA have no CUDA ops and skip as well.
//
// Tolerances: bit-exact where the op has no product and no expf; products differ from the host's
// in the order of the fp32 accumulation only (exact BF16 operands in official numerics): within
// k * 2^-24 relative of sum |x| |w| for k terms, checked at 2^-14 of the row's max |value| for the
// small k here; RMSNorm and hc_head within the expf / reduction-order bounds of their launchers
// (v4_blocks.h, v4_mhc_blocks.h), checked at 2^-16 relative.
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/compute/device.h"
#include "server/model/v4_forward_ops.h"
#include "server/model/v4_layer.h"

#if QUANTD_HAVE_CUDA_HEADERS
#include "kernels/formats.h"
#include "tests/unit/v4_cuda_test_util.h"
#endif

namespace quantd::model {
namespace {

#if QUANTD_HAVE_CUDA_HEADERS

using testing_util::ExpectSameBits;
using testing_util::RandomFloats;

// Every input the observer saw, in call order.
class CopyingObserver final : public Observer {
 public:
  void OnLinearInput(const LinearInput& in) override {
    modules.push_back(*in.module);
    std::vector<float> x;
    for (int64_t r = 0; r < in.rows; ++r) {
      x.insert(x.end(), in.x + r * in.ld, in.x + r * in.ld + in.cols);
    }
    inputs.push_back(std::move(x));
  }
  void OnKvCache(const KvCacheInput&) override {}

  std::vector<std::string> modules;
  std::vector<std::vector<float>> inputs;
};

// |got - want| <= tol * max |want| over the whole tensor.
void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  double amax = 0.0;
  for (float v : want) amax = std::max(amax, std::fabs(static_cast<double>(v)));
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(static_cast<double>(got[i]) - want[i]), tol * amax)
        << "index " << i << ": got " << got[i] << ", want " << want[i];
  }
}

// BF16 values (as float) of `n` random normals: the products' weights and official inputs.
std::vector<float> Bf16Values(size_t n, float scale, uint32_t seed) {
  std::vector<float> v = RandomFloats(n, scale, seed);
  for (float& x : v) x = formats::RoundToBf16(x);
  return v;
}

class V4CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing_util::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    auto cpu = compute::OpenDevice("cpu", {});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = std::move(*cpu);
    auto cuda = compute::OpenDevice("cuda:0", {});
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = std::move(*cuda);
  }

  // Contexts on the CPU and on cuda:0 with `numerics` and the observers below.
  void MakeContexts(Numerics numerics) {
    auto host = MakeForwardContext(*cpu_, numerics, &host_seen_);
    auto device = MakeForwardContext(*cuda_, numerics, &device_seen_);
    ASSERT_TRUE(host.ok() && device.ok());
    host_ = *host;
    device_ = *device;
  }

  // Runs `op` (given the ops, a context and the ops copies of `inputs`) on both op sets and
  // returns the ops' output [n] downloaded, host first.
  template <typename Op>
  std::pair<std::vector<float>, std::vector<float>> RunBoth(
      const std::vector<std::vector<float>>& inputs, int64_t n, const Op& op) {
    std::pair<std::vector<float>, std::vector<float>> out;
    for (int side = 0; side < 2; ++side) {
      const ForwardContext& ctx = side == 0 ? host_ : device_;
      const ForwardOps& ops = OpsOf(ctx);
      std::vector<OpArray<float>> in;
      for (const std::vector<float>& v : inputs) {
        auto a = UploadArray(ops, v, "input");
        EXPECT_TRUE(a.ok()) << a.status();
        in.push_back(std::move(*a));
      }
      auto result = AllocateArray<float>(ops, n, "output");
      EXPECT_TRUE(result.ok()) << result.status();
      const absl::Status s = op(ops, ctx, in, result->data());
      EXPECT_TRUE(s.ok()) << s;
      auto host = DownloadArray(ops, result->data(), n, "output");
      EXPECT_TRUE(host.ok()) << host.status();
      (side == 0 ? out.first : out.second) = std::move(*host);
    }
    return out;
  }

  std::unique_ptr<compute::Device> cpu_, cuda_;
  CopyingObserver host_seen_, device_seen_;
  ForwardContext host_, device_;
};

TEST_F(V4CudaOpsTest, MemoryIsZeroedAndCopiesRoundTrip) {
  MakeContexts(Numerics::kOfficial);
  const ForwardOps& ops = OpsOf(device_);
  auto zeros = AllocateArray<float>(ops, 1000, "zeros");
  ASSERT_TRUE(zeros.ok()) << zeros.status();
  auto read = DownloadArray(ops, zeros->data(), 1000, "zeros");
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, std::vector<float>(1000, 0.0f));
  const std::vector<float> values = RandomFloats(1000, 3.0f, 1);
  auto in = UploadArray(ops, values, "values");
  ASSERT_TRUE(in.ok());
  ASSERT_TRUE(ops.Copy(in->data(), 1000, zeros->data()).ok());
  read = DownloadArray(ops, zeros->data(), 1000, "copy");
  ASSERT_TRUE(read.ok());
  ExpectSameBits(*read, values);
  EXPECT_EQ(ops.placement(), "cuda:0");
  EXPECT_EQ(OpsOf(host_).placement(), "host");
}

// Linear: BF16 weights placed on the device from a host view; the observer gets the same host
// rows; official FP8-simulated input (an FP8 source), NVFP4 W4A4 input, and math numerics.
TEST_F(V4CudaOpsTest, LinearMatchesTheHostInEveryActivationMode) {
  constexpr int64_t kRows = 37, kIn = 256, kOut = 96;
  std::vector<uint16_t> bf16(kOut * kIn);
  const std::vector<float> w = Bf16Values(bf16.size(), 0.05f, 2);
  for (size_t i = 0; i < w.size(); ++i) bf16[i] = formats::FloatToBf16(w[i]);
  struct Mode {
    Numerics numerics;
    bool quantized_source;
    float input_scale;
  };
  for (const Mode mode : {Mode{Numerics::kOfficial, true, 0.0f},
                          Mode{Numerics::kOfficial, false, 0.01f},
                          Mode{Numerics::kMath, false, 0.0f}}) {
    SCOPED_TRACE(std::string(NumericsName(mode.numerics)) + (mode.quantized_source ? " fp8" : "") +
                 (mode.input_scale > 0.0f ? " w4a4" : ""));
    MakeContexts(mode.numerics);
    host_seen_ = {};
    device_seen_ = {};
    LinearWeight host_w, device_w;
    for (LinearWeight* lw : {&host_w, &device_w}) {
      lw->module = "layers.0.attn.wq_a";
      lw->quantized_source = mode.quantized_source;
      lw->input_scale = mode.input_scale;
      lw->view = {bf16.data(), kernels::FloatType::kBF16, kOut, kIn};
    }
    ASSERT_TRUE(OpsOf(device_).Place(device_w).ok());
    EXPECT_NE(device_w.view.data, bf16.data());
    const std::vector<float> x = Bf16Values(kRows * kIn, 2.0f, 3);
    auto [want, got] = RunBoth({x}, kRows * kOut, [&](const ForwardOps& ops,
                                                      const ForwardContext& ctx,
                                                      std::vector<OpArray<float>>& in, float* out) {
      return ops.Linear(ctx, &ctx == &host_ ? host_w : device_w, in[0].data(), kRows, out,
                        LinearOutput::kModelDtype, {});
    });
    // Official outputs are BF16: an accumulation-order difference may move one BF16 ulp.
    ExpectNear(got, want, mode.numerics == Numerics::kOfficial ? std::ldexp(1.0, -7)
                                                               : std::ldexp(1.0, -14));
    ASSERT_EQ(device_seen_.modules, host_seen_.modules);
    ASSERT_EQ(device_seen_.inputs.size(), 1u);
    ExpectSameBits(device_seen_.inputs[0], host_seen_.inputs[0]);
  }
}

TEST_F(V4CudaOpsTest, MtpStreamInputIsBitExact) {
  MakeContexts(Numerics::kOfficial);
  constexpr int64_t kTokens = 9, kHc = 4, kD = 64;
  auto [want, got] =
      RunBoth({RandomFloats(kTokens * kD, 1.0f, 4), RandomFloats(kTokens * kHc * kD, 1.0f, 5)},
              kTokens * kHc * kD,
              [&](const ForwardOps& ops, const ForwardContext&, std::vector<OpArray<float>>& in,
                  float* out) {
                absl::Status s = ops.Copy(in[1].data(), kTokens * kHc * kD, out);
                if (!s.ok()) return s;
                return ops.AddToStreams(in[0].data(), kTokens, kHc, kD, out);
              });
  ExpectSameBits(got, want);
}

TEST_F(V4CudaOpsTest, RmsNormAndHcHeadFollowTheHost) {
  V4Config c;
  c.hc_mult = 4;
  c.hidden_size = 64;
  c.rms_norm_eps = 1e-6f;
  c.hc_eps = 1e-6f;
  constexpr int64_t kTokens = 11;
  const std::vector<float> weight = RandomFloats(c.hidden_size, 0.1f, 6);
  HyperConnectionWeights hc;
  hc.fn = RandomFloats(c.hc_mult * c.hc_mult * c.hidden_size, 0.05f, 7);
  hc.base = RandomFloats(c.hc_mult, 0.5f, 8);
  hc.scale = {0.7f};
  for (Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
    SCOPED_TRACE(NumericsName(numerics));
    MakeContexts(numerics);
    const std::vector<float> x = RandomFloats(kTokens * c.hidden_size, 3.0f, 9);
    auto [want, got] = RunBoth({x}, kTokens * c.hidden_size,
                               [&](const ForwardOps& ops, const ForwardContext& ctx,
                                   std::vector<OpArray<float>>& in, float* out) {
                                 return ops.RmsNorm(ctx, in[0].data(), kTokens, c.hidden_size,
                                                    weight, c.rms_norm_eps, out);
                               });
    ExpectSameBits(got, want);  // v4_blocks.h: the CPU's order, IEEE sqrt
    const std::vector<float> streams = RandomFloats(kTokens * c.hc_mult * c.hidden_size, 1.0f, 10);
    auto [want_head, got_head] = RunBoth({streams}, kTokens * c.hidden_size,
                                         [&](const ForwardOps& ops, const ForwardContext& ctx,
                                             std::vector<OpArray<float>>& in, float* out) {
                                           return ops.HcHead(ctx, c, hc, in[0].data(), kTokens,
                                                             out);
                                         });
    ExpectNear(got_head, want_head,
               numerics == Numerics::kOfficial ? std::ldexp(1.0, -7) : std::ldexp(1.0, -16));
  }
}

// Routing by score and the grouping by expert: the same offsets and rows (logits apart by more
// than the router's error), the weights within the router's 2^-16; then the MoE's steps between
// the products, bit-exact.
TEST_F(V4CudaOpsTest, RoutingAndTheMoeStepsFollowTheHost) {
  V4Config c;
  c.n_routed_experts = 16;
  c.num_experts_per_tok = 4;
  c.routed_scaling_factor = 1.5f;
  c.hidden_size = 32;
  constexpr int64_t kTokens = 24;
  MoeWeights w;
  w.gate.module = "layers.3.ffn.gate";
  w.bias = RandomFloats(c.n_routed_experts, 0.1f, 11);
  std::vector<float> logits(kTokens * c.n_routed_experts);
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t e = 0; e < c.n_routed_experts; ++e) {
      logits[t * c.n_routed_experts + e] = static_cast<float>((t * 7 + e * 5) % 16) * 0.25f - 2.0f;
    }
  }
  const std::vector<int32_t> ids(kTokens, 0);
  MakeContexts(Numerics::kOfficial);
  std::vector<OpExpertRows> routed;
  for (const ForwardContext* ctx : {&host_, &device_}) {
    const ForwardOps& ops = OpsOf(*ctx);
    auto l = UploadArray(ops, logits, "logits");
    auto i = UploadArray(ops, ids, "ids");
    ASSERT_TRUE(l.ok() && i.ok());
    auto r = ops.RouteAndGroup(*ctx, c, w, l->data(), kTokens, i->data());
    ASSERT_TRUE(r.ok()) << r.status();
    routed.push_back(std::move(*r));
  }
  EXPECT_EQ(routed[1].offsets, routed[0].offsets);
  EXPECT_EQ(routed[1].host_rows, routed[0].host_rows);
  ASSERT_EQ(routed[1].host_weights.size(), routed[0].host_weights.size());
  for (size_t i = 0; i < routed[0].host_weights.size(); ++i) {
    EXPECT_NEAR(routed[1].host_weights[i], routed[0].host_weights[i],
                std::ldexp(routed[0].host_weights[i], -16));
  }

  // Expert 0's rows: gather, routing weights (then BF16), scatter-add, the routed sum.
  const int64_t d = c.hidden_size, n = routed[0].offsets[1];
  ASSERT_GT(n, 0);
  const std::vector<float> x = RandomFloats(kTokens * d, 1.0f, 12);
  const std::vector<float> y = RandomFloats(kTokens * d, 1.0f, 13);
  const std::vector<float> weights(routed[0].host_weights.begin(),
                                   routed[0].host_weights.begin() + n);
  auto [want, got] = RunBoth(
      {x, y, weights}, kTokens * d,
      [&](const ForwardOps& ops, const ForwardContext& ctx, std::vector<OpArray<float>>& in,
          float* out) -> absl::Status {
        auto r = UploadArray(ops, routed[0].host_rows, "rows");
        auto xe = AllocateArray<float>(ops, n * d, "xe");
        auto sum = AllocateArray<float>(ops, kTokens * d, "sum");
        if (!r.ok() || !xe.ok() || !sum.ok()) return absl::InternalError("allocation");
        absl::Status s = ops.GatherRows(ctx, in[0].data(), d, r->data(), n, xe->data());
        if (s.ok()) s = ops.ScaleRows(ctx, in[2].data(), n, d, xe->data());
        if (s.ok()) s = ops.AddRows(ctx, xe->data(), r->data(), n, d, sum->data());
        if (s.ok()) s = ops.Copy(in[1].data(), kTokens * d, out);
        if (s.ok()) s = ops.AddRoutedSum(ctx, sum->data(), kTokens * d, out);
        return s;
      });
  ExpectSameBits(got, want);
}

#endif  // QUANTD_HAVE_CUDA_HEADERS

}  // namespace
}  // namespace quantd::model
