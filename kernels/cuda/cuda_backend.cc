// The CUDA backend: validates arguments on the host (kernels/validate.h) exactly as the CPU
// backend does, runs the kernels of kernels/cuda/launch.h on its own stream of its device, waits
// for them, and turns CUDA errors and the kernels' scalars (maxima, counts, the first bad element)
// into Status values with the CPU backend's messages.
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/backends.h"
#include "kernels/cuda/launch.h"
#include "kernels/formats.h"
#include "kernels/validate.h"

namespace quantd::kernels {
namespace {

using cuda::DeviceResults;

// `e` as a Status naming `what`: Unavailable when there is no usable device or driver,
// ResourceExhausted when device memory ran out, Internal for everything else (a failed launch or
// a fault in a kernel).
absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  const std::string message =
      absl::StrCat(what, ": CUDA error ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInitializationError:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

// Buffer deleter: frees device memory on the device that owns it, whichever device the calling
// thread has current. Errors cannot be reported from a destructor and are dropped.
void FreeDeviceMemory(void* p) {
  cudaPointerAttributes attributes;
  int previous = 0;
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess ||
      cudaGetDevice(&previous) != cudaSuccess) {
    cudaGetLastError();  // clear the error so that it does not surface in a later call
    cudaFree(p);
    return;
  }
  cudaSetDevice(attributes.device);
  cudaFree(p);
  cudaSetDevice(previous);
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, cudaStream_t stream, DeviceResults* results, int max_blocks)
      : device_(device), stream_(stream), results_(results), launch_{stream, max_blocks} {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaFree(results_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return absl::StrCat("cuda:", device_); }
  bool host_memory() const override { return false; }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override {
    absl::MutexLock lock(&mu_);
    if (auto s = UseDevice(); !s.ok()) return s;
    void* data = nullptr;
    // cudaMalloc(0) may hand back no pointer; a 0-byte Buffer still owns a real allocation.
    if (cudaError_t e = cudaMalloc(&data, bytes > 0 ? bytes : 1); e != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky: keep the device usable
      return CudaStatus(e, absl::StrCat("allocating ", bytes, " bytes on ", name()));
    }
    return Buffer(data, bytes, &FreeDeviceMemory);
  }

  absl::Status CopyToBackend(void* dst, const void* host_src, size_t bytes) override {
    return Copy(dst, host_src, bytes, cudaMemcpyHostToDevice);
  }

  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    return Copy(host_dst, src, bytes, cudaMemcpyDeviceToHost);
  }

  absl::Status Fp8BlockDequant(const Fp8BlockTensor& src, const DenseOut& dst) override {
    if (auto s = ValidateFp8Block(src); !s.ok()) return s;
    if (auto s = ValidateOut(dst.data, "FP8 block dequant"); !s.ok()) return s;
    absl::MutexLock lock(&mu_);
    absl::StatusOr<DeviceResults> r = Run("FP8 block dequant", [&] {
      return cuda::LaunchFp8BlockDequant(src, dst, results_, launch_);
    });
    if (!r.ok()) return r.status();
    if (r->first_bad == cuda::kNoBad) return absl::OkStatus();
    const int64_t bad = static_cast<int64_t>(r->first_bad);
    absl::StatusOr<std::string> problem = Fp8Problem(src, bad);
    if (!problem.ok()) return problem.status();
    return BadElement(*problem, bad, src.cols);
  }

  absl::Status Mxfp4Dequant(const Mxfp4Tensor& src, const DenseOut& dst) override {
    if (auto s = ValidateMxfp4(src); !s.ok()) return s;
    if (auto s = ValidateOut(dst.data, "MXFP4 dequant"); !s.ok()) return s;
    absl::MutexLock lock(&mu_);
    absl::StatusOr<DeviceResults> r = Run("MXFP4 dequant", [&] {
      return cuda::LaunchMxfp4Dequant(src, dst, results_, launch_);
    });
    if (!r.ok()) return r.status();
    return CheckBad(*r, "NaN E8M0 scale", src.cols);
  }

  absl::StatusOr<float> AbsMax(const DenseTensor& src) override {
    if (auto s = ValidateDense(src, 1); !s.ok()) return s;
    absl::MutexLock lock(&mu_);
    absl::StatusOr<DeviceResults> r =
        Run("abs-max", [&] { return cuda::LaunchAbsMax(src, results_, launch_); });
    if (!r.ok()) return r.status();
    if (auto s = CheckBad(*r, "non-finite value", src.cols); !s.ok()) return s;
    return formats::BitsToFloat(r->max_bits);
  }

  absl::Status BlockAbsMax16(const DenseTensor& src, float* out) override {
    if (auto s = ValidateDense(src, kNvfp4BlockSize); !s.ok()) return s;
    if (auto s = ValidateOut(out, "block abs-max"); !s.ok()) return s;
    absl::MutexLock lock(&mu_);
    absl::StatusOr<DeviceResults> r = Run("block abs-max", [&] {
      return cuda::LaunchBlockAbsMax16(src, out, results_, launch_);
    });
    if (!r.ok()) return r.status();
    return CheckBad(*r, "non-finite value", src.cols);
  }

  absl::Status Nvfp4QuantizeWithScale(const DenseTensor& src, float scale_2,
                                      const Nvfp4Out& dst) override {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<DeviceResults> r = Run("NVFP4 quantize", [&] {
      return cuda::LaunchNvfp4Quantize(src, scale_2, dst.data, dst.scales, results_, launch_);
    });
    if (!r.ok()) return r.status();
    return CheckBad(*r, "non-finite value", src.cols);
  }

  absl::Status Nvfp4Dequant(const Nvfp4Tensor& src, const DenseOut& dst) override {
    if (auto s = ValidateNvfp4(src); !s.ok()) return s;
    if (auto s = ValidateOut(dst.data, "NVFP4 dequant"); !s.ok()) return s;
    absl::MutexLock lock(&mu_);
    absl::StatusOr<DeviceResults> r = Run("NVFP4 dequant", [&] {
      return cuda::LaunchNvfp4Dequant(src, dst, results_, launch_);
    });
    if (!r.ok()) return r.status();
    return CheckBad(*r, "NaN E4M3 scale", src.cols);
  }

  absl::StatusOr<int> Mxfp4MaxExponent(const Mxfp4Tensor& src) override {
    if (auto s = ValidateMxfp4(src); !s.ok()) return s;
    absl::MutexLock lock(&mu_);
    absl::StatusOr<DeviceResults> r = Run("MXFP4 max exponent", [&] {
      return cuda::LaunchMxfp4MaxScale(src, results_, launch_);
    });
    if (!r.ok()) return r.status();
    if (auto s = CheckBad(*r, "NaN E8M0 scale", src.cols); !s.ok()) return s;
    return static_cast<int>(r->max_bits) - 127;
  }

  absl::StatusOr<int64_t> Mxfp4ToNvfp4WithKmax(const Mxfp4Tensor& src, int kmax,
                                               const Nvfp4Out& dst) override {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<DeviceResults> r = Run("MXFP4 -> NVFP4", [&] {
      return cuda::LaunchMxfp4ToNvfp4(src, kmax, dst.data, dst.scales, results_, launch_);
    });
    if (!r.ok()) return r.status();
    return static_cast<int64_t>(r->count);
  }

 private:
  // Makes device_ current for the calling thread (CUDA's current device is per thread).
  absl::Status UseDevice() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return CudaStatus(e, name());
    return absl::OkStatus();
  }

  // Enqueues `launch` on the device, waits for it and returns the kernels' scalars.
  absl::StatusOr<DeviceResults> Run(absl::string_view op, absl::FunctionRef<cudaError_t()> launch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto s = UseDevice(); !s.ok()) return s;
    cudaError_t e = launch();
    DeviceResults host;
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(&host, results_, sizeof(host), cudaMemcpyDeviceToHost, stream_);
    }
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) return CudaStatus(e, absl::StrCat(op, " on ", name()));
    return host;
  }

  // InvalidArgument naming the first bad element, if the kernels found one.
  static absl::Status CheckBad(const DeviceResults& r, absl::string_view what, int64_t cols) {
    if (r.first_bad == cuda::kNoBad) return absl::OkStatus();
    return BadElement(what, static_cast<int64_t>(r.first_bad), cols);
  }

  // Why FP8 element `i` was rejected, in the order the kernels check (scale first), with the CPU
  // backend's words; reads the element's scale back from the device.
  absl::StatusOr<std::string> Fp8Problem(const Fp8BlockTensor& src, int64_t i)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t scale_cols = (src.cols + kFp8BlockSize - 1) / kFp8BlockSize;
    const int64_t si =
        (i / src.cols / kFp8BlockSize) * scale_cols + (i % src.cols) / kFp8BlockSize;
    const bool e8m0 = src.scale_type == Fp8ScaleType::kE8M0;
    const size_t size = e8m0 ? sizeof(uint8_t) : sizeof(float);
    uint32_t bits = 0;  // the scale's byte or float bits (little-endian)
    const void* at = static_cast<const uint8_t*>(src.scales) + si * static_cast<int64_t>(size);
    if (auto s = CopyLocked(&bits, at, size, cudaMemcpyDeviceToHost); !s.ok()) return s;
    if (e8m0) {
      if (formats::E8m0IsNan(static_cast<uint8_t>(bits))) return std::string("NaN E8M0 scale");
    } else {
      const float scale = formats::BitsToFloat(bits);
      if (!formats::IsFinite(scale) || !(scale > 0.0f)) {
        return std::string("non-finite or non-positive F32 scale");
      }
    }
    return std::string("NaN E4M3 code");
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) {
      return absl::InvalidArgumentError("CUDA copy: source or destination is null");
    }
    absl::MutexLock lock(&mu_);
    return CopyLocked(dst, src, bytes, kind);
  }

  absl::Status CopyLocked(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto s = UseDevice(); !s.ok()) return s;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) return CudaStatus(e, absl::StrCat("copying ", bytes, " bytes on ", name()));
    return absl::OkStatus();
  }

  // Serializes operations, which share the stream and the results buffer.
  absl::Mutex mu_;
  const int device_;             // CUDA device ordinal
  cudaStream_t const stream_;    // every operation's work, in order
  DeviceResults* const results_ ABSL_PT_GUARDED_BY(mu_);  // device memory for kernel scalars
  const cuda::Launch launch_;    // stream_ and the grid cap for device_
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the error, report none
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, " is not available (", count, " devices found)"));
  }
  const std::string what = absl::StrCat("starting CUDA device ", device);
  int major = 0, sms = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return CudaStatus(e, what);
  if (major < 9) {
    return absl::UnavailableError(absl::StrCat(
        "CUDA device ", device, " has compute capability ", major,
        ".x; quantd's kernels are built for sm_90 and sm_100 (and newer, through PTX)"));
  }
  if (e = cudaSetDevice(device); e != cudaSuccess) return CudaStatus(e, what);
  cudaStream_t stream = nullptr;
  if (e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return CudaStatus(e, what);
  }
  void* results = nullptr;
  if (e = cudaMalloc(&results, sizeof(DeviceResults)); e != cudaSuccess) {
    cudaStreamDestroy(stream);
    return CudaStatus(e, what);
  }
  // 2048 resident threads per SM on sm_90/sm_100: 8 blocks of 256 fill every SM once.
  const int max_blocks = sms * 8;
  return std::make_unique<CudaBackend>(device, stream, static_cast<DeviceResults*>(results),
                                       max_blocks);
}

}  // namespace quantd::kernels
