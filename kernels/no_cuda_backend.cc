// The CUDA factory of a build without nvcc: there are no devices to offer.
#include "kernels/backends.h"
#include "kernels/gemm.h"

namespace quantd::kernels {

int CudaDeviceCount() { return 0; }

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  (void)device;
  return absl::UnavailableError("quantd was built without CUDA (QUANTD_CUDA=OFF or no nvcc)");
}

absl::StatusOr<std::unique_ptr<Gemm>> MakeCublasGemm(int device) {
  (void)device;
  return absl::UnavailableError("quantd was built without CUDA (QUANTD_CUDA=OFF or no nvcc)");
}

}  // namespace quantd::kernels
