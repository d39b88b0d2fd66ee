// The CUDA blocks of the DeepSeek-V4 forward (kernels/cuda/v4_blocks.h) against their CPU blocks
// (server/model/) on the same random inputs: bit-exact where no transcendental function is
// involved (RMSNorm, RoPE plain and YaRN and inverse, FP8/FP4 activation simulation, hc_post),
// within a tolerance derived from expf's error otherwise (clamped SwiGLU, Sinkhorn). Skips
// without a CUDA device; builds without CUDA have no such blocks and skip as well.
#include <stdint.h>

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "server/model/v4_act_quant.h"
#include "server/model/v4_linear.h"
#include "server/model/v4_mhc.h"
#include "server/model/v4_moe.h"
#include "server/model/v4_rope.h"

#if QUANTD_HAVE_CUDA_HEADERS
#include <cuda_runtime_api.h>

#include "kernels/cuda/v4_blocks.h"
#include "tests/unit/v4_cuda_test_util.h"
#endif

namespace quantd::model {
namespace {

#if QUANTD_HAVE_CUDA_HEADERS

using kernels::cuda::kNoBad;
using kernels::cuda::Launch;

using testing_util::DeviceVector;
using testing_util::ExpectSameBits;
using testing_util::RandomFloats;

class V4CudaBlocksTest : public testing_util::CudaDeviceTest {
 protected:
  ForwardContext Context(Numerics numerics) {
    ForwardContext ctx;
    ctx.numerics = numerics;
    return ctx;
  }

  // A small grid (4 blocks) so that grid-stride loops take several turns.
  const Launch launch_{nullptr, 4};
};

TEST_F(V4CudaBlocksTest, RmsNormIsBitExactInBothNumerics) {
  const int64_t rows = 37, n = 1000;
  const std::vector<float> x = RandomFloats(rows * n, 3.0f, 1);
  std::vector<float> weight = RandomFloats(n, 0.1f, 2);
  for (float& w : weight) w += 1.0f;
  for (Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
    std::vector<float> want(x.size());
    RmsNorm(Context(numerics), x.data(), rows, n, weight, 1e-6f, want.data());
    DeviceVector<float> dx(x), dw(weight);
    ASSERT_EQ(kernels::cuda::LaunchRmsNorm(dx.get(), rows, n, dw.get(), 1e-6f,
                                           numerics == Numerics::kOfficial, dx.get(), launch_),
              cudaSuccess);
    Sync();
    ExpectSameBits(dx.ToHost(), want);
  }
}

TEST_F(V4CudaBlocksTest, RopePlainYarnAndInverseAreBitExact) {
  const int64_t rows = 29, heads = 3, head_dim = 96, rope_dim = 64, positions_n = 300;
  std::vector<int64_t> positions(rows);
  for (int64_t r = 0; r < rows; ++r) positions[r] = (r * 37) % positions_n;
  const std::vector<float> plain =
      RopeInvFreq(rope_dim, 10000.0, /*yarn=*/false, 1.0, 0, 0.0, 0.0);
  const std::vector<float> yarn = RopeInvFreq(rope_dim, 160000.0, /*yarn=*/true, 16.0, 65536,
                                              32.0, 1.0);
  for (const std::vector<float>* freqs : {&plain, &yarn}) {
    const RopeTable table(*freqs, positions_n);
    std::vector<float> cos(positions_n * table.pairs()), sin(cos.size());
    for (int64_t p = 0; p < positions_n; ++p) {
      for (int64_t i = 0; i < table.pairs(); ++i) {
        cos[p * table.pairs() + i] = table.cos(p, i);
        sin[p * table.pairs() + i] = table.sin(p, i);
      }
    }
    DeviceVector<float> dcos(cos), dsin(sin);
    DeviceVector<int64_t> dpos(positions);
    for (bool inverse : {false, true}) {
      std::vector<float> want = RandomFloats(rows * heads * head_dim, 1.0f, 3);
      DeviceVector<float> dx(want);
      ApplyRope(table, positions.data(), inverse, want.data(), rows, heads, head_dim);
      ASSERT_EQ(kernels::cuda::LaunchRope(dcos.get(), dsin.get(), table.pairs(), dpos.get(),
                                          inverse, dx.get(), rows, heads, head_dim, launch_),
                cudaSuccess);
      Sync();
      ExpectSameBits(dx.ToHost(), want);
    }
  }
}

TEST_F(V4CudaBlocksTest, ActivationSimulationIsBitExactAndReportsTheFirstNonFinite) {
  const int64_t rows = 19, cols = 384, ld = 400;
  std::vector<float> x = RandomFloats(rows * ld, 2.0f, 4);
  for (int64_t c = 0; c < 128; ++c) x[3 * ld + c] *= 1e-6f;  // a block below the amax floor
  for (int64_t block : {int64_t{128}, int64_t{64}}) {
    std::vector<float> want = x;
    ASSERT_TRUE(SimulateFp8Act(want.data(), rows, cols, ld, block).ok());
    DeviceVector<float> dx(x);
    ASSERT_EQ(kernels::cuda::LaunchSimulateFp8Act(dx.get(), rows, cols, ld, block, results_,
                                                  launch_),
              cudaSuccess);
    Sync();
    EXPECT_EQ(FirstBad(), kNoBad);
    ExpectSameBits(dx.ToHost(), want);
  }
  std::vector<float> want = x;
  ASSERT_TRUE(SimulateFp4Act(want.data(), rows, cols, ld).ok());
  DeviceVector<float> dx(x);
  ASSERT_EQ(kernels::cuda::LaunchSimulateFp4Act(dx.get(), rows, cols, ld, results_, launch_),
            cudaSuccess);
  Sync();
  ExpectSameBits(dx.ToHost(), want);

  // Two non-finite values: the first in row-major order is reported, as the CPU names it.
  x[5 * ld + 200] = NAN;
  x[11 * ld + 7] = INFINITY;
  DeviceVector<float> bad(x);
  ASSERT_EQ(kernels::cuda::LaunchSimulateFp8Act(bad.get(), rows, cols, ld, 128, results_,
                                                launch_),
            cudaSuccess);
  Sync();
  EXPECT_EQ(FirstBad(), static_cast<unsigned long long>(5 * cols + 200));
}

// g / (1 + exp(-g)) * u: CUDA's expf is within 2 ulp, the host's within 1; 1 + e (e > 0) keeps
// that relative error, and the division and product add half an ulp each on both sides, so
// the two results differ by at most 2 + 1 + 2 = 5 ulp of the result: 8 * 2^-24 relative.
TEST_F(V4CudaBlocksTest, ClampedSwigluIsWithinExpfError) {
  const int64_t n = 5000;
  const std::vector<float> g = RandomFloats(n, 8.0f, 5), u = RandomFloats(n, 8.0f, 6);
  for (float limit : {10.0f, 0.0f}) {
    DeviceVector<float> dg(g), du(u);
    ASSERT_EQ(kernels::cuda::LaunchClampedSwiglu(dg.get(), du.get(), n, limit, launch_),
              cudaSuccess);
    Sync();
    const std::vector<float> got = dg.ToHost();
    for (int64_t i = 0; i < n; ++i) {
      const float want = ClampedSwiglu(g[i], u[i], limit);
      ASSERT_NEAR(got[i], want, 8.0 * 0x1p-24 * std::fabs(want) + 1e-37) << i;
    }
  }
}

// pre and post are sigmoids (see ClampedSwiglu: a few ulp, 1e-6 relative). comb goes through a
// softmax and 2 * iters - 1 normalizations of positive sums of 4: the CPU is within 1e-5
// relative of a double reference (v4_blocks_test), so are the device's, so they are within
// 2e-5 of each other.
TEST_F(V4CudaBlocksTest, SinkhornIsWithinTheCpuBlocksTolerance) {
  const int64_t tokens = 50, hc = 4, iters = 20, width = (2 + hc) * hc;
  const float eps = 1e-6f;
  const std::vector<float> mixes = RandomFloats(tokens * width, 2.0f, 7);
  const std::vector<float> base = RandomFloats(width, 1.0f, 8);
  const std::vector<float> scale = {0.7f, 1.3f, 2.1f};
  std::vector<float> pre(tokens * hc), post(pre.size()), comb(tokens * hc * hc);
  for (int64_t t = 0; t < tokens; ++t) {
    SplitSinkhorn(mixes.data() + t * width, scale.data(), base.data(), hc, iters, eps,
                  pre.data() + t * hc, post.data() + t * hc, comb.data() + t * hc * hc);
  }
  DeviceVector<float> dm(mixes), ds(scale), db(base), dpre(pre), dpost(post), dcomb(comb);
  ASSERT_EQ(kernels::cuda::LaunchSplitSinkhorn(dm.get(), ds.get(), db.get(), tokens, hc, iters,
                                               eps, dpre.get(), dpost.get(), dcomb.get(),
                                               launch_),
            cudaSuccess);
  Sync();
  const std::vector<float> gpre = dpre.ToHost(), gpost = dpost.ToHost(), gcomb = dcomb.ToHost();
  for (size_t i = 0; i < pre.size(); ++i) {
    EXPECT_NEAR(gpre[i], pre[i], 1e-6 * pre[i]) << i;
    EXPECT_NEAR(gpost[i], post[i], 1e-6 * post[i]) << i;
  }
  for (size_t i = 0; i < comb.size(); ++i) EXPECT_NEAR(gcomb[i], comb[i], 2e-5 * comb[i]) << i;
}

TEST_F(V4CudaBlocksTest, HcPostIsBitExactInBothNumerics) {
  V4Config config;
  config.hc_mult = 4;
  config.hidden_size = 320;
  const int64_t tokens = 23, hc = config.hc_mult, d = config.hidden_size;
  HcMix mix;
  mix.pre = RandomFloats(tokens * hc, 1.0f, 9);
  mix.post = RandomFloats(tokens * hc, 1.0f, 10);
  mix.comb = RandomFloats(tokens * hc * hc, 0.5f, 11);
  const std::vector<float> f = RandomFloats(tokens * d, 1.0f, 12);
  const std::vector<float> streams = RandomFloats(tokens * hc * d, 1.0f, 13);
  for (Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
    std::vector<float> want(streams.size());
    HcPost(Context(numerics), config, mix, f.data(), streams.data(), tokens, want.data());
    DeviceVector<float> dpost(mix.post), dcomb(mix.comb), df(f), ds(streams), dout(want);
    ASSERT_EQ(kernels::cuda::LaunchHcPost(dpost.get(), dcomb.get(), df.get(), ds.get(), tokens,
                                          hc, d, numerics == Numerics::kOfficial, dout.get(),
                                          launch_),
              cudaSuccess);
    Sync();
    ExpectSameBits(dout.ToHost(), want);
  }
}

#else  // no CUDA in this build

TEST(V4CudaBlocksTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif  // QUANTD_HAVE_CUDA_HEADERS

}  // namespace
}  // namespace quantd::model
