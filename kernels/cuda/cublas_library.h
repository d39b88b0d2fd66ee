// The cuBLAS entry points quantd calls, resolved from libcublas loaded with dlopen on first use
// (cublas_gemm.cc says why it is never linked).
#ifndef QUANTD_KERNELS_CUDA_CUBLAS_LIBRARY_H_
#define QUANTD_KERNELS_CUDA_CUBLAS_LIBRARY_H_

#include <cublas_v2.h>

#include <string>

namespace quantd::kernels {

// cublasGemmEx's C entry point (C++ code also sees an inline overload of the name).
using CublasGemmExFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t,
                                          int, int, int, const void*, const void*, cudaDataType,
                                          int, const void*, cudaDataType, int, const void*, void*,
                                          cudaDataType, int, cublasComputeType_t,
                                          cublasGemmAlgo_t);

struct CublasLibrary {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  CublasGemmExFn gemm_ex = nullptr;
  decltype(&cublasGetStatusName) get_status_name = nullptr;
  decltype(&cublasGetStatusString) get_status_string = nullptr;
  std::string error;  // why the library or an entry point could not be loaded; empty when all are
};

// Loads libcublas.so.<major of the headers> once per process (later calls return the same
// result). Needs no GPU: only the library files.
const CublasLibrary& LoadCublas();

}  // namespace quantd::kernels

#endif  // QUANTD_KERNELS_CUDA_CUBLAS_LIBRARY_H_
