// OpenCudaDevice of a build without nvcc: there are no CUDA devices.
#include "server/compute/device.h"

namespace quantd::compute {

absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int index) {
  (void)index;
  return absl::UnavailableError("quantd was built without CUDA (QUANTD_CUDA=OFF or no nvcc)");
}

}  // namespace quantd::compute
