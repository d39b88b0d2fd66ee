// Gemm on CUDA: cuBLAS sgemm for float32 operands, cublasGemmEx with BF16 inputs and float32
// accumulation and output for BF16 operands. Row-major products are computed as the
// column-major transposed product (C^T = op(B)^T op(A)^T), so no data is moved.
//
// cuBLAS is loaded on first use (dlopen), not linked, for the reason OpenBLAS is
// (cpu/openblas_gemm.cc): libcublasLt.so.13, which libcublas needs, has a 92 KiB TLS segment
// (readelf -l: PT_TLS memsz 0x17020). glibc places the TLS of every library loaded at start in
// the static TLS block, carved out of each new thread's stack, and civetweb (the metrics
// server, Debian's libcivetweb 1.15) creates its threads with a fixed 100 KiB stack
// (USE_STACK_SIZE 102400, set at its build; prometheus-cpp offers no way to change it): with
// cuBLAS linked, pthread_create fails with EINVAL and the exposer reports "null context when
// constructing CivetServer". A dlopened library's TLS is allocated per thread on first use
// instead, outside the stack, so civetweb's threads stay within theirs.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <memory>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cublas_library.h"
#include "kernels/gemm.h"

namespace quantd::kernels {
namespace {

absl::Status CublasError(const CublasLibrary& lib, const char* what, cublasStatus_t status) {
  return absl::InternalError(absl::StrCat(what, ": ", lib.get_status_name(status), " (",
                                          lib.get_status_string(status), ")"));
}

class CublasGemm final : public Gemm {
 public:
  CublasGemm(const CublasLibrary& lib, int device, cublasHandle_t handle)
      : lib_(lib), device_(device), handle_(handle) {}
  ~CublasGemm() override { lib_.destroy(handle_); }

  std::string name() const override { return absl::StrCat("cublas:", device_); }

  absl::Status Sgemm(const SgemmArgs& g) override {
    if (absl::Status s = ValidateSgemm(g); !s.ok()) return s;
    if (g.m == 0 || g.n == 0) return absl::OkStatus();
    if (cudaSetDevice(device_) != cudaSuccess) return absl::UnavailableError(name());
    // Column-major view: C^T[n, m] = op(B)^T[n, k] * op(A)^T[k, m].
    const cublasStatus_t st = lib_.sgemm(
        handle_, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
        static_cast<int>(g.n), static_cast<int>(g.m), static_cast<int>(g.k), &g.alpha, g.b,
        static_cast<int>(g.ldb), g.a, static_cast<int>(g.lda), &g.beta, g.c,
        static_cast<int>(g.ldc));
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError(lib_, "cublasSgemm", st);
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
        lib_.gemm_ex(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                     static_cast<int>(k), &alpha, w.data, in_type, static_cast<int>(k), x.data,
                     in_type, static_cast<int>(k), &beta, out, CUDA_R_32F, static_cast<int>(n),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError(lib_, "cublasGemmEx", st);
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

  const CublasLibrary& lib_;     // the loaded library; lives as long as the process
  const int device_;             // CUDA ordinal
  const cublasHandle_t handle_;  // owned; bound to device_
};

}  // namespace

absl::StatusOr<std::unique_ptr<Gemm>> MakeCublasGemm(int device) {
  if (cudaSetDevice(device) != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cuda:", device, ": no such device"));
  }
  const CublasLibrary& lib = LoadCublas();
  if (!lib.error.empty()) return absl::UnavailableError(lib.error);
  cublasHandle_t handle = nullptr;
  const cublasStatus_t st = lib.create(&handle);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError(lib, "cublasCreate", st);
  // Keep float32 products in float32: no TF32 down-conversion.
  lib.set_math_mode(handle, CUBLAS_PEDANTIC_MATH);
  return std::unique_ptr<Gemm>(new CublasGemm(lib, device, handle));
}

const CublasLibrary& LoadCublas() {
  static const CublasLibrary* const loaded = [] {
    auto* lib = new CublasLibrary;
    const std::string soname = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
    // The dynamic loader's search path first, then the toolkit this build was compiled against.
    void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      handle = dlopen(absl::StrCat(QUANTD_CUDA_LIBRARY_DIR, "/", soname).c_str(),
                      RTLD_NOW | RTLD_LOCAL);
    }
    if (handle == nullptr) {
      const char* why = dlerror();
      lib->error = absl::StrCat("cannot load ", soname, ": ", why != nullptr ? why : "");
      return lib;
    }
    auto resolve = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_reference_t<decltype(*fn)>>(dlsym(handle, name));
      if (*fn == nullptr && lib->error.empty()) {
        lib->error = absl::StrCat(soname, " lacks ", name);
      }
    };
    resolve(&lib->create, "cublasCreate_v2");
    resolve(&lib->destroy, "cublasDestroy_v2");
    resolve(&lib->set_math_mode, "cublasSetMathMode");
    resolve(&lib->sgemm, "cublasSgemm_v2");
    resolve(&lib->gemm_ex, "cublasGemmEx");
    resolve(&lib->get_status_name, "cublasGetStatusName");
    resolve(&lib->get_status_string, "cublasGetStatusString");
    return lib;
  }();
  return *loaded;
}

}  // namespace quantd::kernels
