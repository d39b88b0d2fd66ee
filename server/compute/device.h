// compute::Device: one place work runs ("cpu", "cuda:N"), with its memory and its compute
// libraries. The scheduler owns one per worker; a task runs on exactly one and is placed there only
// when its DeviceRequirement fits (requirement.h).
//
// What a device offers:
//   - backend(): the conversion kernels (dequantize, NVFP4 quantize, lossless cast);
//   - gemm(): matrix products for the model forward (kernels/gemm.h): OpenBLAS on CPU, cuBLAS
//     on CUDA (both loaded with dlopen, so that their thread-local storage stays off the stacks
//     of every thread; kernels/cuda/cublas_gemm.cc);
//   - memory: total and free bytes (CUDA: cudaMemGetInfo; CPU: the host budget it was given) and
//     whether its buffers are host-visible (a stage may then hand it host pointers directly).
// A Device is used by one worker thread at a time; memory queries are thread-safe.
#ifndef QUANTD_SERVER_COMPUTE_DEVICE_H_
#define QUANTD_SERVER_COMPUTE_DEVICE_H_

#include <stdint.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace quantd::kernels {
class Gemm;  // kernels/gemm.h
namespace cpu {
class ThreadPool;  // kernels/cpu/thread_pool.h
}  // namespace cpu
}  // namespace quantd::kernels

namespace quantd::compute {

enum class DeviceKind { kCpu, kCuda };
const char* DeviceKindName(DeviceKind kind);  // "cpu", "cuda"

class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceKind kind() const = 0;
  // As specs spell it: "cpu" or "cuda:N" (device_name.h).
  virtual const std::string& name() const = 0;
  // Bytes this device may hold in all. CPU: the host budget it was opened with.
  virtual int64_t total_memory_bytes() const = 0;
  // Bytes free right now (CUDA: cudaMemGetInfo; CPU: the budget less what the process holds).
  virtual absl::StatusOr<int64_t> free_memory_bytes() const = 0;
  // True when host code may read and write this device's buffers directly.
  virtual bool host_visible() const = 0;
  // The conversion kernels of this device.
  virtual kernels::Backend& backend() = 0;
  // Matrix products for the model forward (never nullptr for "cpu" and "cuda:N").
  virtual kernels::Gemm* gemm() = 0;
  // Threads the host-side loops of work on this device may use (the model forward's non-GEMM
  // blocks): the CPU's cpu_threads (all cores when 0); 1 where the device does not say.
  virtual int host_threads() const { return 1; }
  // The host_threads() threads those loops run on, started with the device and reused by every
  // loop; nullptr where the device has a single host thread.
  virtual kernels::cpu::ThreadPool* host_pool() { return nullptr; }
};

struct DeviceOptions {
  int cpu_threads = 0;               // CPU: threads per kernel call; 0 = all cores
  int64_t host_memory_bytes = 0;     // CPU: the budget reported as total memory; 0 = physical RAM
};

// Opens "cpu" or "cuda:N". InvalidArgument for another name; Unavailable when the CUDA device
// does not exist or this build has no CUDA.
absl::StatusOr<std::unique_ptr<Device>> OpenDevice(const std::string& name,
                                                   const DeviceOptions& options);

// CUDA device `index` (cuda_device.cc; no_cuda_device.cc in a build without CUDA).
absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int index);

}  // namespace quantd::compute

#endif  // QUANTD_SERVER_COMPUTE_DEVICE_H_
