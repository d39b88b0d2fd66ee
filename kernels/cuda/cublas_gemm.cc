// Gemm on CUDA: cuBLAS sgemm for float32 operands, cublasGemmEx with BF16 inputs and float32
// accumulation and output for BF16 operands. Row-major products are computed as the
// column-major transposed product (C^T = op(B)^T op(A)^T), so no data is moved.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "kernels/gemm.h"

namespace quantd::kernels {
namespace {

absl::Status CublasError(const char* what, cublasStatus_t status) {
  return absl::InternalError(absl::StrCat(what, ": ", cublasGetStatusName(status), " (",
                                          cublasGetStatusString(status), ")"));
}

class CublasGemm final : public Gemm {
 public:
  CublasGemm(int device, cublasHandle_t handle) : device_(device), handle_(handle) {}
  ~CublasGemm() override { cublasDestroy(handle_); }

  std::string name() const override { return absl::StrCat("cublas:", device_); }

  absl::Status Sgemm(const SgemmArgs& g) override {
    if (absl::Status s = ValidateSgemm(g); !s.ok()) return s;
    if (g.m == 0 || g.n == 0) return absl::OkStatus();
    if (cudaSetDevice(device_) != cudaSuccess) return absl::UnavailableError(name());
    // Column-major view: C^T[n, m] = op(B)^T[n, k] * op(A)^T[k, m].
    const cublasStatus_t st = cublasSgemm(
        handle_, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
        static_cast<int>(g.n), static_cast<int>(g.m), static_cast<int>(g.k), &g.alpha, g.b,
        static_cast<int>(g.ldb), g.a, static_cast<int>(g.lda), &g.beta, g.c,
        static_cast<int>(g.ldc));
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasSgemm", st);
    return Synchronize();
  }

  absl::Status MatMulNT(const DenseTensor& x, const DenseTensor& w, float* out,
                        bool accumulate) override {
    if (absl::Status s = ValidateMatMulNT(x, w, out); !s.ok()) return s;
    if (x.type != w.type) {
      return absl::InvalidArgumentError(
          "MatMulNT on cuBLAS: x and w must both be BF16 or both F32");
    }
    const int64_t m = x.rows, n = w.rows, k = x.cols;
    if (m == 0 || n == 0) return absl::OkStatus();
    if (cudaSetDevice(device_) != cudaSuccess) return absl::UnavailableError(name());
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    const cudaDataType_t in_type = x.type == FloatType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
    // out^T[n, m] = w[n, k] (column-major: w^T is k x n, transposed) * x^T[k, m].
    const cublasStatus_t st =
        cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                     static_cast<int>(k), &alpha, w.data, in_type, static_cast<int>(k), x.data,
                     in_type, static_cast<int>(k), &beta, out, CUDA_R_32F, static_cast<int>(n),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasGemmEx", st);
    return Synchronize();
  }

 private:
  absl::Status Synchronize() {
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      return absl::InternalError(absl::StrCat(name(), ": ", cudaGetErrorString(err)));
    }
    return absl::OkStatus();
  }

  const int device_;             // CUDA ordinal
  const cublasHandle_t handle_;  // owned; bound to device_
};

}  // namespace

absl::StatusOr<std::unique_ptr<Gemm>> MakeCublasGemm(int device) {
  if (cudaSetDevice(device) != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cuda:", device, ": no such device"));
  }
  cublasHandle_t handle = nullptr;
  const cublasStatus_t st = cublasCreate(&handle);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasCreate", st);
  // Keep float32 products in float32: no TF32 down-conversion.
  cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH);
  return std::unique_ptr<Gemm>(new CublasGemm(device, handle));
}

}  // namespace quantd::kernels
