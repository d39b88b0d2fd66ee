#include "kernels/gemm.h"

#include "absl/strings/str_cat.h"

namespace quantd::kernels {

absl::Status ValidateMatMulNT(const DenseTensor& x, const DenseTensor& w, const float* out) {
  if (x.data == nullptr || w.data == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("MatMulNT: null operand");
  }
  if (x.rows < 0 || x.cols < 0 || w.rows < 0 || x.cols != w.cols) {
    return absl::InvalidArgumentError(absl::StrCat("MatMulNT: x is [", x.rows, ", ", x.cols,
                                                   "], w is [", w.rows, ", ", w.cols,
                                                   "]: their column counts must match"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSgemm(const SgemmArgs& g) {
  const int64_t a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_cols = g.trans_b ? g.k : g.n;
  if (g.m < 0 || g.n < 0 || g.k < 0 || g.lda < a_cols || g.ldb < b_cols || g.ldc < g.n ||
      g.lda < 1 || g.ldb < 1 || g.ldc < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Sgemm: m=", g.m, " n=", g.n, " k=", g.k, " lda=", g.lda, " ldb=", g.ldb, " ldc=", g.ldc,
        ": sizes must be >= 0 and leading dimensions at least the stored row widths"));
  }
  if ((g.m > 0 && g.n > 0 && g.c == nullptr) ||
      (g.m > 0 && g.n > 0 && g.k > 0 && (g.a == nullptr || g.b == nullptr))) {
    return absl::InvalidArgumentError("Sgemm: null operand");
  }
  return absl::OkStatus();
}

}  // namespace quantd::kernels
