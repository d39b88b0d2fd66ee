// kernels::Gemm: OpenBLAS on the CPU and cuBLAS on CUDA (skipped without a GPU) against a
// double-precision reference. Integer-valued operands make every product and partial sum exact
// in float32 (all below 2^24), so any summation order must give the reference bit for bit;
// random operands are held to the float32 accumulation bound |err| <= gamma_k * sum|x||w| with
// gamma_k = k u / (1 - k u), u = 2^-24.
#include "kernels/gemm.h"

#include <pthread.h>
#include <string.h>

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backends.h"
#include "kernels/formats.h"
#if QUANTD_HAVE_CUDA_HEADERS
#include "kernels/cuda/cublas_library.h"
#endif

namespace quantd::kernels {
namespace {

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = formats::FloatToBf16(v[i]);
  return out;
}

// Reference x[m,k] · w[n,k]^T in double, plus sum |x||w| per element.
void Reference(const std::vector<float>& x, const std::vector<float>& w, int64_t m, int64_t n,
               int64_t k, std::vector<double>* out, std::vector<double>* abs_sum) {
  out->assign(static_cast<size_t>(m * n), 0.0);
  abs_sum->assign(out->size(), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0, a = 0.0;
      for (int64_t l = 0; l < k; ++l) {
        const double p = static_cast<double>(x[i * k + l]) * w[j * k + l];
        s += p;
        a += std::fabs(p);
      }
      (*out)[i * n + j] = s;
      (*abs_sum)[i * n + j] = a;
    }
  }
}

std::vector<float> Integers(size_t n, std::mt19937* rng) {
  std::uniform_int_distribution<int> dist(-8, 8);
  std::vector<float> v(n);
  for (float& f : v) f = static_cast<float>(dist(*rng));
  return v;
}

std::vector<float> Randoms(size_t n, std::mt19937* rng, bool bf16) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& f : v) {
    f = dist(*rng);
    if (bf16) f = formats::Bf16ToFloat(formats::FloatToBf16(f));
  }
  return v;
}

double Gamma(int64_t k) {
  const double u = std::ldexp(1.0, -24);
  return k * u / (1.0 - k * u);
}

TEST(OpenBlasGemmTest, MatMulNTIsExactOnIntegersForEveryOperandType) {
  std::mt19937 rng(1);
  const int64_t m = 7, n = 300, k = 257;  // n spans several BF16 widening tiles when k is large
  const std::vector<float> x = Integers(m * k, &rng), w = Integers(n * k, &rng);
  std::vector<double> ref, abs_sum;
  Reference(x, w, m, n, k, &ref, &abs_sum);
  const std::vector<uint16_t> xb = ToBf16(x), wb = ToBf16(w);
  auto gemm = MakeOpenBlasGemm(1);
  for (FloatType xt : {FloatType::kF32, FloatType::kBF16}) {
    for (FloatType wt : {FloatType::kF32, FloatType::kBF16}) {
      const DenseTensor xd{xt == FloatType::kF32 ? static_cast<const void*>(x.data()) : xb.data(),
                           xt, m, k};
      const DenseTensor wd{wt == FloatType::kF32 ? static_cast<const void*>(w.data()) : wb.data(),
                           wt, n, k};
      std::vector<float> out(static_cast<size_t>(m * n), 1.0f);
      ASSERT_TRUE(gemm->MatMulNT(xd, wd, out.data(), /*accumulate=*/true).ok());
      for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], ref[i] + 1.0) << i;
      ASSERT_TRUE(gemm->MatMulNT(xd, wd, out.data(), /*accumulate=*/false).ok());
      for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], ref[i]) << i;
    }
  }
}

TEST(OpenBlasGemmTest, MatMulNTWithinFloat32AccumulationBound) {
  std::mt19937 rng(2);
  const int64_t m = 33, n = 5000, k = 384;  // n*k > one widening tile
  const std::vector<float> x = Randoms(m * k, &rng, false), w = Randoms(n * k, &rng, true);
  std::vector<double> ref, abs_sum;
  Reference(x, w, m, n, k, &ref, &abs_sum);
  const std::vector<uint16_t> wb = ToBf16(w);
  auto gemm = MakeOpenBlasGemm(0);
  std::vector<float> out(static_cast<size_t>(m * n));
  ASSERT_TRUE(gemm->MatMulNT({x.data(), FloatType::kF32, m, k}, {wb.data(), FloatType::kBF16, n, k},
                             out.data(), false)
                  .ok());
  for (size_t i = 0; i < out.size(); ++i) {
    // + one rounding of the result itself.
    ASSERT_LE(std::fabs(out[i] - ref[i]), Gamma(k + 1) * abs_sum[i]) << i;
  }
}

// A job's figures must not depend on --threads: random operands (whose float32 sums do depend on
// the summation order) give the same bits on 1, 2, 3 and 8 threads, through MatMulNT and Sgemm.
TEST(OpenBlasGemmTest, ResultsAreTheSameBitsForEveryThreadCount) {
  std::mt19937 rng(4);
  const int64_t m = 37, n = 1000, k = 4100;  // blocks of 255 rows of w: three full, one short
  const std::vector<float> x = Randoms(m * k, &rng, false), w = Randoms(n * k, &rng, true);
  const std::vector<uint16_t> wb = ToBf16(w);
  std::vector<float> first_mm, first_sg;
  for (int threads : {1, 2, 3, 8}) {
    auto gemm = MakeOpenBlasGemm(threads);
    std::vector<float> mm(static_cast<size_t>(m * n)), sg(static_cast<size_t>(m * n));
    ASSERT_TRUE(gemm->MatMulNT({x.data(), FloatType::kF32, m, k},
                               {wb.data(), FloatType::kBF16, n, k}, mm.data(), false)
                    .ok());
    SgemmArgs g;
    g.trans_b = true;
    g.m = m;
    g.n = n;
    g.k = k;
    g.a = x.data();
    g.lda = k;
    g.b = w.data();
    g.ldb = k;
    g.c = sg.data();
    g.ldc = n;
    ASSERT_TRUE(gemm->Sgemm(g).ok());
    if (first_mm.empty()) {
      first_mm = mm;
      first_sg = sg;
      continue;
    }
    ASSERT_EQ(memcmp(mm.data(), first_mm.data(), mm.size() * sizeof(float)), 0) << threads;
    ASSERT_EQ(memcmp(sg.data(), first_sg.data(), sg.size() * sizeof(float)), 0) << threads;
  }
}

TEST(OpenBlasGemmTest, SgemmHonoursTransposesAndLeadingDimensions) {
  std::mt19937 rng(3);
  const int64_t m = 5, n = 6, k = 7, pad = 3;
  const std::vector<float> x = Integers(m * k, &rng), w = Integers(n * k, &rng);
  std::vector<double> ref, abs_sum;
  Reference(x, w, m, n, k, &ref, &abs_sum);
  // A stored transposed [k, m] with padding, B stored [n, k] (trans_b), C with padding.
  std::vector<float> at(static_cast<size_t>(k * (m + pad)), 99.0f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t l = 0; l < k; ++l) at[l * (m + pad) + i] = x[i * k + l];
  std::vector<float> c(static_cast<size_t>(m * (n + pad)), 2.0f);
  SgemmArgs g;
  g.trans_a = true;
  g.trans_b = true;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = 2.0f;
  g.a = at.data();
  g.lda = m + pad;
  g.b = w.data();
  g.ldb = k;
  g.beta = 0.5f;
  g.c = c.data();
  g.ldc = n + pad;
  auto gemm = MakeOpenBlasGemm(1);
  ASSERT_TRUE(gemm->Sgemm(g).ok());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(c[i * (n + pad) + j], 2.0 * ref[i * n + j] + 1.0);
    for (int64_t j = n; j < n + pad; ++j) EXPECT_EQ(c[i * (n + pad) + j], 2.0f);  // untouched
  }
  g.lda = m - 1;
  EXPECT_EQ(gemm->Sgemm(g).code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpenBlasGemmTest, RejectsMismatchedInnerDimensions) {
  std::vector<float> x(6), w(6), out(4);
  auto gemm = MakeOpenBlasGemm(1);
  const absl::Status s = gemm->MatMulNT({x.data(), FloatType::kF32, 2, 3},
                                        {w.data(), FloatType::kF32, 3, 2}, out.data(), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[2, 3]"), std::string::npos);
}

// cuBLAS against the CPU on the same operands: BF16 x BF16 and F32 x F32.
TEST(CublasGemmTest, MatchesOpenBlasOnDevice) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto gemm = MakeCublasGemm(0);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  auto backend = MakeCudaBackend(0);
  ASSERT_TRUE(backend.ok());
  std::mt19937 rng(4);
  const int64_t m = 64, n = 1024, k = 512;
  const std::vector<float> x = Randoms(m * k, &rng, true), w = Randoms(n * k, &rng, true);
  std::vector<double> ref, abs_sum;
  Reference(x, w, m, n, k, &ref, &abs_sum);
  for (FloatType type : {FloatType::kF32, FloatType::kBF16}) {
    const bool bf16 = type == FloatType::kBF16;
    const std::vector<uint16_t> xb = ToBf16(x), wb = ToBf16(w);
    const size_t es = bf16 ? 2 : 4;
    auto dx = (*backend)->Allocate(x.size() * es);
    auto dw = (*backend)->Allocate(w.size() * es);
    auto dout = (*backend)->Allocate(static_cast<size_t>(m * n) * 4);
    ASSERT_TRUE(dx.ok() && dw.ok() && dout.ok());
    ASSERT_TRUE(
        (*backend)
            ->CopyToBackend(dx->data(), bf16 ? (const void*)xb.data() : x.data(), x.size() * es)
            .ok());
    ASSERT_TRUE(
        (*backend)
            ->CopyToBackend(dw->data(), bf16 ? (const void*)wb.data() : w.data(), w.size() * es)
            .ok());
    ASSERT_TRUE(
        (*gemm)
            ->MatMulNT({dx->data(), type, m, k}, {dw->data(), type, n, k}, dout->as<float>(), false)
            .ok());
    std::vector<float> out(static_cast<size_t>(m * n));
    ASSERT_TRUE((*backend)->CopyToHost(out.data(), dout->data(), out.size() * 4).ok());
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_LE(std::fabs(out[i] - ref[i]), Gamma(k + 1) * abs_sum[i]) << i;
    }
  }
}

#if QUANTD_HAVE_CUDA_HEADERS
// cuBLAS is loaded with dlopen (cublas_gemm.cc says why), which needs no GPU. Once it is loaded,
// a thread with the 100 KiB stack civetweb gives its threads (USE_STACK_SIZE 102400 in Debian's
// libcivetweb) still starts: libcublasLt's 92 KiB of TLS is not carved out of it. Had this test
// linked cuBLAS, pthread_create would fail with EINVAL.
TEST(CublasLibraryTest, LoadsWithoutAGpuAndLeavesSmallThreadStacksUsable) {
  const CublasLibrary& lib = LoadCublas();
  ASSERT_EQ(lib.error, "");
  EXPECT_STREQ(lib.get_status_name(CUBLAS_STATUS_NOT_INITIALIZED),
               "CUBLAS_STATUS_NOT_INITIALIZED");
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 102400), 0);
  pthread_t thread;
  const int rc = pthread_create(
      &thread, &attr, [](void*) -> void* { return nullptr; }, nullptr);
  pthread_attr_destroy(&attr);
  ASSERT_EQ(rc, 0) << strerror(rc);
  pthread_join(thread, nullptr);
}
#endif  // QUANTD_HAVE_CUDA_HEADERS

}  // namespace
}  // namespace quantd::kernels
