// The state of the CUDA ops (v4_cuda_ops.h; CUDA builds only): the device, the launch
// configuration of the block kernels (kernels/cuda/v4_*_blocks.h), the products' operand scratch
// and the scalars the kernels hand back, with the status and copy helpers around them.
//
// Every kernel and every product runs on the legacy default stream, the stream cuBLAS's handle
// uses (kernels/cuda/cublas_gemm.cc), so the blocks and the GEMMs run in program order without
// events. Copies to and from the host are plain cudaMemcpy on that stream: they wait for the
// work before them. The context is used by one thread at a time (the worker owning the device).
#ifndef QUANTD_SERVER_MODEL_V4_DEVICE_CONTEXT_H_
#define QUANTD_SERVER_MODEL_V4_DEVICE_CONTEXT_H_

#include <stdint.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda/launch.h"
#include "server/compute/device.h"

namespace quantd::model {

// Device memory reused from one product to the next (grow-only), so that the operand steps of
// the CUDA ops' Linear (activation simulation, BF16 narrowing or F32 widening) do not allocate and
// free (cudaFree waits for the whole device) on every call. One slot per step of a product.
class DeviceScratch {
 public:
  enum Slot { kSimulated = 0, kOperand = 1 };
  // At least `bytes` of slot `slot` on `device`; a smaller one is freed and reallocated (its
  // previous contents are not kept). The memory is valid until the next Get of the same slot.
  absl::StatusOr<void*> Get(compute::Device& device, Slot slot, size_t bytes);

 private:
  kernels::Buffer slots_[2];  // indexed by Slot
};

struct DeviceForwardContext {
  compute::Device* device = nullptr;  // "cuda:N"; its backend allocates, its Gemm multiplies
  int cuda_index = 0;                 // N
  kernels::cuda::Launch launch;       // the default stream; grid-stride kernels: 8 blocks per SM
  std::unique_ptr<DeviceScratch> scratch;  // the products' operand memory
  // The scalars the kernels hand back, one launcher at a time: results_buffer's memory.
  kernels::Buffer results_buffer;
  kernels::cuda::DeviceResults* results() const {
    return results_buffer.as<kernels::cuda::DeviceResults>();
  }
};

// A context on `device`. FailedPrecondition unless it is a CUDA device with a Gemm; Unavailable
// or ResourceExhausted from the device.
absl::StatusOr<DeviceForwardContext> MakeDeviceForwardContext(compute::Device& device);

// Makes the context's device current for this thread (kernels launch on the current device).
absl::Status UseDevice(const DeviceForwardContext& ctx);

// Whether `p` points into device memory of ctx's device.
bool IsMemoryOf(const DeviceForwardContext& ctx, const void* p);

// Copies (synchronous, after all work queued before them). Errors name `what`.
absl::Status CopyToDevice(const void* host, size_t bytes, void* device, const std::string& what);
absl::Status CopyToHost(const void* device, size_t bytes, void* host, const std::string& what);

// The status of a launcher's return value: OK for cudaSuccess, else Internal (ResourceExhausted
// for out of memory) naming `what` and the CUDA error.
absl::Status LaunchStatus(cudaError_t error, const std::string& what);

// Waits until the work queued on ctx's stream is done (before another stream, such as the
// backend's, writes memory that work reads). Errors name `what`.
absl::Status WaitForWork(const DeviceForwardContext& ctx, const std::string& what);

// Waits for the queued work and returns the first bad index the last launcher reported in
// ctx.results() (kernels::cuda::kNoBad: none).
absl::StatusOr<uint64_t> FirstBad(const DeviceForwardContext& ctx, const std::string& what);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_DEVICE_CONTEXT_H_
