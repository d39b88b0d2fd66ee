// Gemm: matrix products for the model forward, behind one interface per device (OpenBLAS on the
// CPU, cuBLAS on CUDA). Never a hand-written GEMM: this seam only adapts layouts and types.
//
// All matrices are row-major. Pointers live in the memory of the device the Gemm belongs to
// (host memory for the CPU, device memory for CUDA). Accumulation is always float32.
#ifndef QUANTD_KERNELS_GEMM_H_
#define QUANTD_KERNELS_GEMM_H_

#include <stdint.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/tensor_views.h"

namespace quantd::kernels {

// C = alpha * op(A) * op(B) + beta * C, float32, row-major with leading dimensions (BLAS sgemm).
// op(A) is [m, k], op(B) is [k, n], C is [m, n].
struct SgemmArgs {
  bool trans_a = false;  // A is stored [k, m]
  bool trans_b = false;  // B is stored [n, k]
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  const float* a = nullptr;
  int64_t lda = 0;
  const float* b = nullptr;
  int64_t ldb = 0;
  float beta = 0.0f;
  float* c = nullptr;
  int64_t ldc = 0;
};

class Gemm {
 public:
  virtual ~Gemm() = default;

  // "openblas", "cublas:0".
  virtual std::string name() const = 0;

  // Plain float32 sgemm. InvalidArgument for negative sizes or leading dimensions too small.
  virtual absl::Status Sgemm(const SgemmArgs& args) = 0;

  // The product of a linear layer: out[m, n] = x[m, k] · w[n, k]^T (+ out when `accumulate`),
  // out float32 row-major with row stride n. x and w are BF16 or F32 (DenseTensor: x is
  // [m, k], w is [n, k]); BF16 operands are widened to float32 exactly. The CPU widens BF16 per
  // tile of rows and calls sgemm; cuBLAS takes two BF16 operands natively (fp32 accumulate) and
  // two F32 operands as sgemm, and rejects a mix with InvalidArgument.
  virtual absl::Status MatMulNT(const DenseTensor& x, const DenseTensor& w, float* out,
                                bool accumulate) = 0;
};

// OpenBLAS sgemm (single-threaded inside) on `threads` threads of the Gemm's own pool (0: one
// per core); each product is split into blocks that depend on its shape alone, so results are
// the same for any thread count.
std::unique_ptr<Gemm> MakeOpenBlasGemm(int threads);

// cuBLAS on CUDA device `device`. Unavailable when built without CUDA or the device is missing.
absl::StatusOr<std::unique_ptr<Gemm>> MakeCublasGemm(int device);

// Shared argument check of MatMulNT: both operands 2-D with equal k, non-null.
absl::Status ValidateMatMulNT(const DenseTensor& x, const DenseTensor& w, const float* out);
// Shared argument check of Sgemm.
absl::Status ValidateSgemm(const SgemmArgs& args);

}  // namespace quantd::kernels

#endif  // QUANTD_KERNELS_GEMM_H_
