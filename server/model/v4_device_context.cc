#include "server/model/v4_device_context.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "server/compute/device_name.h"

namespace quantd::model {

absl::Status LaunchStatus(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // a launch-configuration error is not sticky: keep the device usable
  const std::string message =
      absl::StrCat(what, ": CUDA error ", cudaGetErrorName(error), ": ", cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::StatusOr<DeviceForwardContext> MakeDeviceForwardContext(compute::Device& device) {
  DeviceForwardContext ctx;
  if (device.kind() != compute::DeviceKind::kCuda || device.gemm() == nullptr ||
      !compute::ParseDeviceName(device.name(), &ctx.cuda_index) || ctx.cuda_index < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the device forward of DeepSeek-V4 needs a CUDA device with cuBLAS, not ", device.name()));
  }
  ctx.device = &device;
  int sms = 0;
  cudaError_t e = cudaSetDevice(ctx.cuda_index);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx.cuda_index);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat(device.name(), ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
  }
  ctx.launch = {nullptr, sms * 8};
  absl::StatusOr<kernels::Buffer> results =
      device.backend().Allocate(sizeof(kernels::cuda::DeviceResults));
  if (!results.ok()) return results.status();
  ctx.results_buffer = std::move(*results);
  ctx.scratch = std::make_unique<DeviceScratch>();
  return ctx;
}

absl::StatusOr<void*> DeviceScratch::Get(compute::Device& device, Slot slot, size_t bytes) {
  kernels::Buffer& b = slots_[slot];
  if (b.data() == nullptr || b.size() < bytes) {
    b = kernels::Buffer();  // free first: the old and the new need not fit together
    absl::StatusOr<kernels::Buffer> fresh = device.backend().Allocate(bytes);
    if (!fresh.ok()) return fresh.status();
    b = std::move(*fresh);
  }
  return b.data();
}

absl::Status UseDevice(const DeviceForwardContext& ctx) {
  return LaunchStatus(cudaSetDevice(ctx.cuda_index), ctx.device->name());
}

bool IsMemoryOf(const DeviceForwardContext& ctx, const void* p) {
  cudaPointerAttributes attributes;
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    cudaGetLastError();  // host memory unknown to CUDA: not an error to keep
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice && attributes.device == ctx.cuda_index;
}

absl::Status CopyToDevice(const void* host, size_t bytes, void* device, const std::string& what) {
  if (bytes == 0) return absl::OkStatus();
  return LaunchStatus(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice),
                      absl::StrCat("copying ", what, " to the device"));
}

absl::Status CopyToHost(const void* device, size_t bytes, void* host, const std::string& what) {
  if (bytes == 0) return absl::OkStatus();
  return LaunchStatus(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost),
                      absl::StrCat("copying ", what, " to the host"));
}

absl::Status WaitForWork(const DeviceForwardContext& ctx, const std::string& what) {
  return LaunchStatus(cudaStreamSynchronize(ctx.launch.stream), what);
}

absl::StatusOr<uint64_t> FirstBad(const DeviceForwardContext& ctx, const std::string& what) {
  kernels::cuda::DeviceResults r{};
  absl::Status s = CopyToHost(ctx.results(), sizeof(r), &r, what);
  if (!s.ok()) return s;
  return static_cast<uint64_t>(r.first_bad);
}

}  // namespace quantd::model
