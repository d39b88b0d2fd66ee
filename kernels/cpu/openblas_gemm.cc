// Gemm on the CPU: OpenBLAS sgemm; BF16 operands are widened to float32 one block of rows at a
// time, so a BF16 weight never exists whole in float32.
//
// Results do not depend on the thread count. OpenBLAS's own threading does not have that
// property (its split of a product across threads moves where its edge kernels run, so a job
// with --threads 2 and one with --threads 1 calibrated input scales one BF16 ulp apart), so
// OpenBLAS runs single-threaded and the product is split here instead: n in blocks whose size
// depends on k only, one sgemm per block, the blocks spread over a ThreadPool.
//
// OpenBLAS is loaded on first use (dlopen), not linked: libopenblas carries 60 KiB of
// thread-local storage, and the TLS of every library linked at start sits on every thread's
// stack, which overflowed the 100 KiB stacks that civetweb (the metrics server) gives its threads
// and crashed quantd serve on the first scrape. A dlopened library's TLS is allocated on demand.
#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/thread_pool.h"
#include "kernels/formats.h"
#include "kernels/gemm.h"

namespace quantd::kernels {
namespace {

// Elements of a weight block widened per sgemm call (4 MiB of float32): large enough that sgemm
// works on full panels, small enough that a large weight never exists whole in float32.
constexpr int64_t kBlockElements = 1 << 20;
// Rows of B (columns of the product) per sgemm call: a function of k alone, so the blocks, and
// with them every result, are the same for any thread count.
constexpr int64_t kMinBlockRows = 16;
constexpr int64_t kMaxBlockRows = 256;

int64_t BlockRows(int64_t k) {
  return std::clamp<int64_t>(kBlockElements / std::max<int64_t>(k, 1), kMinBlockRows,
                             kMaxBlockRows);
}

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
  explicit OpenBlasGemm(int threads) : pool_(threads), scratch_(pool_.size()) {}

  std::string name() const override { return "openblas"; }

  absl::Status Sgemm(const SgemmArgs& g) override {
    if (absl::Status s = ValidateSgemm(g); !s.ok()) return s;
    if (g.m == 0 || g.n == 0) return absl::OkStatus();
    const OpenBlas& blas = LoadOpenBlas();
    if (!blas.error.empty()) return absl::UnavailableError(blas.error);
    // Columns [n0, n0 + nt) of C take columns [n0, n0 + nt) of op(B).
    const int64_t block = BlockRows(g.k);
    ForEachBlock(g.n, block, [&](int /*worker*/, int64_t n0, int64_t nt) {
      const float* b = g.trans_b ? g.b + n0 * g.ldb : g.b + n0;
      blas.sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                 g.trans_b ? CblasTrans : CblasNoTrans, g.m, nt, g.k, g.alpha, g.a, g.lda, b,
                 g.ldb, g.beta, g.c + n0, g.ldc);
    });
    return absl::OkStatus();
  }

  absl::Status MatMulNT(const DenseTensor& x, const DenseTensor& w, float* out,
                        bool accumulate) override {
    if (absl::Status s = ValidateMatMulNT(x, w, out); !s.ok()) return s;
    const int64_t m = x.rows, n = w.rows, k = x.cols;
    if (m == 0 || n == 0) return absl::OkStatus();
    const OpenBlas& blas = LoadOpenBlas();
    if (!blas.error.empty()) return absl::UnavailableError(blas.error);
    std::vector<float> x_scratch;
    const float* xf = RowsAsF32(x, 0, m, &x_scratch);
    ForEachBlock(n, BlockRows(k), [&](int worker, int64_t n0, int64_t nt) {
      const float* wf = RowsAsF32(w, n0, nt, &scratch_[worker]);
      blas.sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, nt, k, 1.0f, xf, k, wf, k,
                 accumulate ? 1.0f : 0.0f, out + n0, n);
    });
    return absl::OkStatus();
  }

 private:
  // Runs fn(worker, n0, nt) for the blocks [n0, n0 + nt) of [0, n) of `block` rows (the last one
  // shorter), the blocks spread over the pool.
  void ForEachBlock(int64_t n, int64_t block,
                    const std::function<void(int, int64_t, int64_t)>& fn) {
    const int64_t blocks = (n + block - 1) / block;
    pool_.Run(pool_.size(), blocks, [&](int worker, int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * block;
        fn(worker, n0, std::min(block, n - n0));
      }
    });
  }

  cpu::ThreadPool pool_;
  std::vector<std::vector<float>> scratch_;  // widened weight rows, one buffer per pool thread
};

}  // namespace

std::unique_ptr<Gemm> MakeOpenBlasGemm(int threads) {
  const OpenBlas& blas = LoadOpenBlas();
  if (blas.error.empty()) blas.set_num_threads(1);
  if (threads <= 0) threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return std::make_unique<OpenBlasGemm>(threads);
}

}  // namespace quantd::kernels
