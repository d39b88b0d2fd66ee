// compute::Device for CUDA device N: memory from cudaMemGetInfo, kernels from the CUDA backend,
// matrix products from cuBLAS (loaded with dlopen: kernels/cuda/cublas_gemm.cc says why).
#include <cuda_runtime_api.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/backends.h"
#include "kernels/gemm.h"
#include "server/compute/device.h"

namespace quantd::compute {
namespace {

class CudaDevice final : public Device {
 public:
  CudaDevice(int index, std::unique_ptr<kernels::Backend> backend,
             std::unique_ptr<kernels::Gemm> gemm, int64_t total)
      : index_(index), name_(absl::StrCat("cuda:", index)), backend_(std::move(backend)),
        gemm_(std::move(gemm)), total_(total) {}
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  const std::string& name() const override { return name_; }
  int64_t total_memory_bytes() const override { return total_; }
  absl::StatusOr<int64_t> free_memory_bytes() const override {
    size_t free = 0, total = 0;
    cudaError_t err = cudaSetDevice(index_);
    if (err == cudaSuccess) err = cudaMemGetInfo(&free, &total);
    if (err != cudaSuccess) {
      return absl::UnavailableError(
          absl::StrCat(name_, ": cudaMemGetInfo: ", cudaGetErrorString(err)));
    }
    return static_cast<int64_t>(free);
  }
  bool host_visible() const override { return backend_->host_memory(); }
  kernels::Backend& backend() override { return *backend_; }
  kernels::Gemm* gemm() override { return gemm_.get(); }

 private:
  const int index_;                            // CUDA ordinal
  const std::string name_;                     // "cuda:<index_>"
  std::unique_ptr<kernels::Backend> backend_;  // owned; used by the owning worker only
  std::unique_ptr<kernels::Gemm> gemm_;        // cuBLAS; used by the owning worker only
  const int64_t total_;                        // bytes, from cudaMemGetInfo at open
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int index) {
  auto backend = kernels::MakeCudaBackend(index);
  if (!backend.ok()) return backend.status();
  size_t free = 0, total = 0;
  cudaError_t err = cudaSetDevice(index);
  if (err == cudaSuccess) err = cudaMemGetInfo(&free, &total);
  if (err != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("cuda:", index, ": cudaMemGetInfo: ", cudaGetErrorString(err)));
  }
  auto gemm = kernels::MakeCublasGemm(index);
  if (!gemm.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cuda:", index, ": no cuBLAS: ", gemm.status().message()));
  }
  return std::unique_ptr<Device>(new CudaDevice(index, std::move(*backend), std::move(*gemm),
                                                static_cast<int64_t>(total)));
}

}  // namespace quantd::compute
