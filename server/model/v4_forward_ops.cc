#include "server/model/v4_forward_ops.h"

#include "absl/strings/str_cat.h"
#include "server/model/v4_cuda_ops.h"
#include "server/model/v4_host_ops.h"

namespace quantd::model {

absl::StatusOr<std::shared_ptr<ForwardOps>> MakeForwardOps(compute::Device& device) {
  if (device.host_visible()) return MakeHostOps();
  if (device.kind() == compute::DeviceKind::kCuda) return MakeCudaOps(device);
  return absl::FailedPreconditionError(absl::StrCat(
      "the DeepSeek-V4 forward has no operations for device ", device.name(),
      ": neither host-visible nor CUDA"));
}

}  // namespace quantd::model
