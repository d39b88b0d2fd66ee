// Where the DeepSeek-V4 forward runs when it runs on a CUDA device (CUDA builds only; the host
// forward's context is ForwardContext in v4_linear.h): the device, its cuBLAS Gemm, the launch
// configuration of the block kernels (kernels/cuda/v4_*_blocks.h), the numerics and the observer,
// and typed device arrays for the activations and scratch.
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
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda/launch.h"
#include "kernels/gemm.h"
#include "server/compute/device.h"
#include "server/model/v4_numerics.h"
#include "server/model/v4_observer.h"

namespace quantd::model {

// A device array of `size` values of T (float, int32_t, int64_t, uint16_t), owned; empty when
// size is 0 (data() is then a valid 1-byte allocation or nullptr for a default one).
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(kernels::Buffer buffer, int64_t size) : buffer_(std::move(buffer)), size_(size) {}
  T* data() const { return buffer_.as<T>(); }
  int64_t size() const { return size_; }

 private:
  kernels::Buffer buffer_;  // the allocation, freed with the array
  int64_t size_ = 0;        // values of T in it
};

// Device memory reused from one product to the next (grow-only), so that the operand steps of
// ApplyLinearOnDevice (activation simulation, BF16 narrowing or F32 widening) do not allocate and
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
  kernels::Gemm* gemm = nullptr;      // device->gemm(), cuBLAS
  Numerics numerics = Numerics::kOfficial;
  Observer* observer = nullptr;  // may be nullptr; called with host copies (see v4_linear_cuda.h)
  bool observe_all_experts = false;        // ForwardContext::observe_all_experts
  std::unique_ptr<DeviceScratch> scratch;  // the products' operand memory
  // The scalars the kernels hand back, one launcher at a time: results_buffer's memory.
  kernels::Buffer results_buffer;
  kernels::cuda::DeviceResults* results() const {
    return results_buffer.as<kernels::cuda::DeviceResults>();
  }

  bool official() const { return numerics == Numerics::kOfficial; }
};

// A context on `device`. FailedPrecondition unless it is a CUDA device with a Gemm; Unavailable
// or ResourceExhausted from the device.
absl::StatusOr<DeviceForwardContext> MakeDeviceForwardContext(compute::Device& device,
                                                              Numerics numerics,
                                                              Observer* observer);

// Makes the context's device current for this thread (kernels launch on the current device).
absl::Status UseDevice(const DeviceForwardContext& ctx);

// `size` uninitialized values on the device. ResourceExhausted names `what`.
template <typename T>
absl::StatusOr<DeviceArray<T>> AllocateArray(const DeviceForwardContext& ctx, int64_t size) {
  absl::StatusOr<kernels::Buffer> b =
      ctx.device->backend().Allocate(static_cast<size_t>(size) * sizeof(T));
  if (!b.ok()) return b.status();
  return DeviceArray<T>(std::move(*b), size);
}

// Whether `p` points into device memory of ctx's device.
bool IsMemoryOf(const DeviceForwardContext& ctx, const void* p);

// Copies (synchronous, after all work queued before them). Errors name `what`.
absl::Status CopyToDevice(const void* host, size_t bytes, void* device, const std::string& what);
absl::Status CopyToHost(const void* device, size_t bytes, void* host, const std::string& what);

// A device copy of host values.
template <typename T>
absl::StatusOr<DeviceArray<T>> UploadArray(const DeviceForwardContext& ctx,
                                           const std::vector<T>& host, const std::string& what) {
  absl::StatusOr<DeviceArray<T>> a = AllocateArray<T>(ctx, static_cast<int64_t>(host.size()));
  if (!a.ok()) return a.status();
  absl::Status s = CopyToDevice(host.data(), host.size() * sizeof(T), a->data(), what);
  if (!s.ok()) return s;
  return a;
}

// A host copy of `n` values at device pointer `values`.
template <typename T>
absl::StatusOr<std::vector<T>> DownloadArray(const T* values, int64_t n, const std::string& what) {
  std::vector<T> host(static_cast<size_t>(n));
  absl::Status s = CopyToHost(values, host.size() * sizeof(T), host.data(), what);
  if (!s.ok()) return s;
  return host;
}

// The status of a launcher's return value: OK for cudaSuccess, else Internal (ResourceExhausted
// for out of memory) naming `what` and the CUDA error.
absl::Status LaunchStatus(cudaError_t error, const std::string& what);

// Waits for the queued work and returns the first bad index the last launcher reported in
// ctx.results() (kernels::cuda::kNoBad: none).
absl::StatusOr<uint64_t> FirstBad(const DeviceForwardContext& ctx, const std::string& what);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_DEVICE_CONTEXT_H_
