// The device forward's own kernels against their CPU counterparts on the same random inputs:
// the per-head q norm (kernels/cuda/v4_head_norm_blocks.h against NormalizeHeads) in both
// numerics, and the dtype steps (kernels/cuda/v4_cast_blocks.h against RoundToBf16 and formats.h's
// conversions), all bit-exact (no transcendental function; IEEE division and square root, no
// fused multiply-add). Skips without a CUDA device; builds without CUDA skip as well.
#include <stdint.h>
#include <string.h>

#include <vector>

#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "server/model/v4_act_quant.h"
#include "server/model/v4_attention.h"

#if QUANTD_HAVE_CUDA_HEADERS
#include <cuda_runtime_api.h>

#include "kernels/cuda/v4_cast_blocks.h"
#include "kernels/cuda/v4_head_norm_blocks.h"
#include "tests/unit/v4_cuda_test_util.h"
#endif

namespace quantd::model {
namespace {

#if QUANTD_HAVE_CUDA_HEADERS

using testing_util::DeviceVector;
using testing_util::ExpectSameBits;
using testing_util::RandomFloats;

class V4CudaCastTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing_util::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
  void Sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

  // A small grid (4 blocks) so that grid-stride loops take several turns.
  const kernels::cuda::Launch launch_{nullptr, 4};
};

TEST_F(V4CudaCastTest, NormalizeHeadsIsBitExactInBothNumerics) {
  // V4 Pro's heads are 512 wide; 128 is the tiny fixture's; 1000 rows span several grid turns.
  for (const int64_t dim : {int64_t{128}, int64_t{512}}) {
    const int64_t rows = 1000;
    std::vector<float> q = RandomFloats(rows * dim, 2.0f, 11);
    RoundToBf16(q.data(), static_cast<int64_t>(q.size()));  // official inputs are BF16
    for (Numerics numerics : {Numerics::kOfficial, Numerics::kMath}) {
      ForwardContext ctx;
      ctx.numerics = numerics;
      std::vector<float> want = q;
      NormalizeHeads(ctx, 1e-6f, want.data(), rows, dim);
      DeviceVector<float> dq(q);
      ASSERT_EQ(kernels::cuda::LaunchNormalizeHeads(numerics == Numerics::kOfficial, 1e-6f,
                                                    dq.get(), rows, dim, launch_),
                cudaSuccess);
      Sync();
      ExpectSameBits(dq.ToHost(), want);
    }
  }
}

TEST_F(V4CudaCastTest, Bf16StepsAreBitExact) {
  // Random values, plus the rounding's edge cases: ties to even, the largest finite value
  // rounding to infinity, subnormals, signed zeros, infinities.
  std::vector<float> x = RandomFloats(100003, 5.0f, 12);
  for (uint32_t bits : {0x3F808000u, 0x3F818000u, 0x7F7FFFFFu, 0x00000001u, 0x80400000u,
                        0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u}) {
    float f;
    memcpy(&f, &bits, 4);
    x.push_back(f);
  }
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> rounded = x;
  RoundToBf16(rounded.data(), n);
  DeviceVector<float> dx(x);
  ASSERT_EQ(kernels::cuda::LaunchRoundToBf16(dx.get(), n, launch_), cudaSuccess);
  Sync();
  ExpectSameBits(dx.ToHost(), rounded);

  DeviceVector<float> source(x);
  DeviceVector<uint16_t> narrow(std::vector<uint16_t>(x.size()));
  ASSERT_EQ(kernels::cuda::LaunchNarrowToBf16(source.get(), n, narrow.get(), launch_),
            cudaSuccess);
  Sync();
  const std::vector<uint16_t> bits = narrow.ToHost();
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(bits[i], formats::FloatToBf16(x[i])) << "index " << i;
  }
  DeviceVector<float> wide(std::vector<float>(x.size()));
  ASSERT_EQ(kernels::cuda::LaunchWidenBf16(narrow.get(), n, wide.get(), launch_), cudaSuccess);
  Sync();
  ExpectSameBits(wide.ToHost(), rounded);  // widening the narrowed values gives the rounding
}

#endif  // QUANTD_HAVE_CUDA_HEADERS

}  // namespace
}  // namespace quantd::model
