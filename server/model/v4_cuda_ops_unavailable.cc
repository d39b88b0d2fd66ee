// MakeCudaOps in a build without nvcc: there are no CUDA devices to run on.
#include "server/model/v4_cuda_ops.h"

namespace quantd::model {

absl::StatusOr<std::shared_ptr<ForwardOps>> MakeCudaOps(compute::Device&) {
  return absl::UnavailableError("quantd was built without CUDA (QUANTD_CUDA=OFF or no nvcc)");
}

}  // namespace quantd::model
