// Backend: one place where kernels run (the CPU at some SIMD level, or one CUDA device).
//
// Every backend implements the same operations with the same parameters and must write the same
// bytes as kernels/reference.h. Operations validate their arguments (kernels/validate.h) and
// reject non-finite input, NaN-coded FP8/E8M0 bytes and inconsistent shapes with InvalidArgument
// naming the first offending element as [row, col]. They return when the result is complete.
#ifndef QUANTD_KERNELS_BACKEND_H_
#define QUANTD_KERNELS_BACKEND_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/tensor_views.h"

namespace quantd::kernels {

// Memory owned by a backend (host memory for CPU, device memory for CUDA). Move-only.
class Buffer {
 public:
  using Deleter = void (*)(void*);
  Buffer() = default;
  Buffer(void* data, size_t size, Deleter deleter) : data_(data), size_(size), deleter_(deleter) {}
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void* data_ = nullptr;         // start of the allocation, nullptr when empty
  size_t size_ = 0;              // bytes allocated
  Deleter deleter_ = nullptr;    // releases data_ in the owning backend
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Short name for logs and test names: "cpu-scalar", "cpu-avx2", "cpu-avx512", "cuda:0".
  virtual std::string name() const = 0;
  // True when this backend's buffers are host memory (host code may read and write them, and its
  // kernels take host pointers); the one answer, which compute::Device::host_visible() gives.
  virtual bool host_memory() const = 0;

  // Memory that this backend's kernels read and write, and copies to and from host memory.
  virtual absl::StatusOr<Buffer> Allocate(size_t bytes) = 0;
  virtual absl::Status CopyToBackend(void* dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;

  // FP8 E4M3 with 128x128 block scales -> dense BF16/F32 [rows, cols]:
  // out = round(e4m3(W) * scale) with the product in float32 and RNE to BF16.
  virtual absl::Status Fp8BlockDequant(const Fp8BlockTensor& src, const DenseOut& dst) = 0;

  // MXFP4 -> dense BF16/F32: out = e2m1(code) * 2^(scale-127).
  virtual absl::Status Mxfp4Dequant(const Mxfp4Tensor& src, const DenseOut& dst) = 0;

  // max |x| over the whole tensor, as float32.
  virtual absl::StatusOr<float> AbsMax(const DenseTensor& src) = 0;

  // max |x| over each 16-element block along a row: out is float32 [rows, cols/16].
  virtual absl::Status BlockAbsMax16(const DenseTensor& src, float* out) = 0;

  // NVFP4 quantization with ModelOpt >= 0.45 semantics (formats.h Nvfp4GlobalScale /
  // Nvfp4BlockScale / Nvfp4Encode). `global_amax` (finite, >= 0) replaces the tensor's own amax
  // so fused partners share one weight_scale_2. Writes dst.data, dst.scales and *dst.scale_2.
  // Validation and the choice of weight_scale_2 are shared by every backend (backend.cc); the
  // backend's Nvfp4QuantizeWithScale does the rest.
  absl::Status Nvfp4Quantize(const DenseTensor& src, GlobalAmax global_amax,
                             const Nvfp4Out& dst);

  // NVFP4 -> dense BF16/F32: e2m1(code) * float(scale) * scale_2.
  virtual absl::Status Nvfp4Dequant(const Nvfp4Tensor& src, const DenseOut& dst) = 0;

  // The largest E8M0 exponent (byte - 127) among the tensor's scales.
  virtual absl::StatusOr<int> Mxfp4MaxExponent(const Mxfp4Tensor& src) = 0;

  // Lossless MXFP4 -> NVFP4 with weight_scale_2 = 2^(kmax-8). kmax must be >= the tensor's own
  // largest exponent (an expert's w1/w3 pass the max of both). Each 16-block whose scale
  // 2^(k-kmax+8) is representable in E4M3 (exponent >= -9) keeps its nibbles bit-exactly; the
  // others are requantized from their exact values with formats.h's NVFP4 rules. Returns how
  // many 16-blocks were requantized.
  // Validation (shared, backend.cc) then the backend's Mxfp4ToNvfp4WithKmax.
  absl::StatusOr<int64_t> Mxfp4ToNvfp4(const Mxfp4Tensor& src, int kmax, const Nvfp4Out& dst);

 protected:
  // Nvfp4Quantize once its arguments are validated and weight_scale_2 is chosen: writes dst.data
  // and dst.scales (not dst.scale_2).
  virtual absl::Status Nvfp4QuantizeWithScale(const DenseTensor& src, float scale_2,
                                              const Nvfp4Out& dst) = 0;
  // Mxfp4ToNvfp4 once src, dst and kmax are validated: writes dst.data and dst.scales (not
  // dst.scale_2) and returns the number of requantized 16-blocks.
  virtual absl::StatusOr<int64_t> Mxfp4ToNvfp4WithKmax(const Mxfp4Tensor& src, int kmax,
                                                       const Nvfp4Out& dst) = 0;
};

}  // namespace quantd::kernels

#endif  // QUANTD_KERNELS_BACKEND_H_
