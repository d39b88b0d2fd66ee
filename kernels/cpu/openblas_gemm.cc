// Gemm on the CPU: OpenBLAS sgemm; BF16 operands are widened to float32 one tile of rows at a
// time, so a BF16 weight never exists whole in float32.
//
// OpenBLAS is loaded on first use (dlopen), not linked: libopenblas carries 60 KiB of
// thread-local storage, and the TLS of every library linked at start sits on every thread's
// stack, which overflowed the 100 KiB stacks that civetweb (the metrics server) gives its threads
// and crashed quantd serve on the first scrape. A dlopened library's TLS is allocated on demand.
#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/formats.h"
#include "kernels/gemm.h"

namespace quantd::kernels {
namespace {

// Elements of a BF16 weight widened per sgemm call (4 MiB of float32): large enough that sgemm
// works on full panels, small enough that a large weight never exists whole in float32.
constexpr int64_t kTileElements = 1 << 20;

void Widen(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = formats::Bf16ToFloat(src[i]);
}

// Rows [begin, begin + count) of a dense operand as float32: in place for F32, else widened
// into *scratch.
const float* RowsAsF32(const DenseTensor& t, int64_t begin, int64_t count,
                       std::vector<float>* scratch) {
  if (t.type == FloatType::kF32) return static_cast<const float*>(t.data) + begin * t.cols;
  scratch->resize(static_cast<size_t>(count * t.cols));
  Widen(static_cast<const uint16_t*>(t.data) + begin * t.cols, count * t.cols, scratch->data());
  return scratch->data();
}

// The two OpenBLAS entry points quantd calls, resolved once; `error` is set when they are not.
struct OpenBlas {
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&openblas_set_num_threads) set_num_threads = nullptr;
  std::string error;
};

const OpenBlas& LoadOpenBlas() {
  static const OpenBlas* const blas = [] {
    auto* b = new OpenBlas;
    void* lib = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      b->error = std::string("cannot load libopenblas.so.0: ") + (why != nullptr ? why : "");
      return b;
    }
    b->sgemm = reinterpret_cast<decltype(&cblas_sgemm)>(dlsym(lib, "cblas_sgemm"));
    b->set_num_threads = reinterpret_cast<decltype(&openblas_set_num_threads)>(
        dlsym(lib, "openblas_set_num_threads"));
    if (b->sgemm == nullptr || b->set_num_threads == nullptr) {
      b->error = "libopenblas.so.0 lacks cblas_sgemm or openblas_set_num_threads";
    }
    return b;
  }();
  return *blas;
}

class OpenBlasGemm final : public Gemm {
 public:
  std::string name() const override { return "openblas"; }

  absl::Status Sgemm(const SgemmArgs& g) override {
    if (absl::Status s = ValidateSgemm(g); !s.ok()) return s;
    if (g.m == 0 || g.n == 0) return absl::OkStatus();
    const OpenBlas& blas = LoadOpenBlas();
    if (!blas.error.empty()) return absl::UnavailableError(blas.error);
    blas.sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                g.trans_b ? CblasTrans : CblasNoTrans, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.b,
                g.ldb, g.beta, g.c, g.ldc);
    return absl::OkStatus();
  }

  absl::Status MatMulNT(const DenseTensor& x, const DenseTensor& w, float* out,
                        bool accumulate) override {
    if (absl::Status s = ValidateMatMulNT(x, w, out); !s.ok()) return s;
    const int64_t m = x.rows, n = w.rows, k = x.cols;
    if (m == 0 || n == 0) return absl::OkStatus();
    const OpenBlas& blas = LoadOpenBlas();
    if (!blas.error.empty()) return absl::UnavailableError(blas.error);
    std::vector<float> x_scratch, w_scratch;
    const float* xf = RowsAsF32(x, 0, m, &x_scratch);
    const int64_t tile = std::max<int64_t>(1, std::min(n, kTileElements / std::max<int64_t>(k, 1)));
    for (int64_t n0 = 0; n0 < n; n0 += tile) {
      const int64_t nt = std::min(tile, n - n0);
      const float* wf = RowsAsF32(w, n0, nt, &w_scratch);
      blas.sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, nt, k, 1.0f, xf, k, wf, k,
                  accumulate ? 1.0f : 0.0f, out + n0, n);
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Gemm> MakeOpenBlasGemm(int threads) {
  const OpenBlas& blas = LoadOpenBlas();
  if (threads > 0 && blas.error.empty()) blas.set_num_threads(threads);
  return std::make_unique<OpenBlasGemm>();
}

}  // namespace quantd::kernels
