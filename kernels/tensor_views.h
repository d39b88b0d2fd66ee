// Descriptions of the tensors kernels read and write: plain pointers plus shape, no ownership.
//
// All matrices are row-major [rows, cols]. Pointers live in the memory of the backend that runs
// the kernel (host memory for the CPU backend, device memory for CUDA), except where noted.
#ifndef QUANTD_KERNELS_TENSOR_VIEWS_H_
#define QUANTD_KERNELS_TENSOR_VIEWS_H_

#include <stdint.h>

#include <optional>

namespace quantd::kernels {

// Element type of a dense float tensor that a kernel reads or writes.
enum class FloatType : uint8_t { kBF16, kF32 };

// How an FP8 tensor's 128x128 block scales are stored.
enum class Fp8ScaleType : uint8_t {
  kE8M0,  // DeepSeek-V4: one E8M0 byte per block, value 2^(b-127)
  kF32,   // DeepSeek-V3 / V4-Base: float32 per block (`weight_scale_inv`)
};

inline constexpr int64_t kFp8BlockSize = 128;
inline constexpr int64_t kMxfp4BlockSize = 32;
inline constexpr int64_t kNvfp4BlockSize = 16;

// Dense BF16 or F32 input.
struct DenseTensor {
  const void* data = nullptr;
  FloatType type = FloatType::kBF16;
  int64_t rows = 0;
  int64_t cols = 0;
};

// Dense BF16 or F32 output, same shape as the operation's input.
struct DenseOut {
  void* data = nullptr;
  FloatType type = FloatType::kBF16;
};

// FP8 E4M3FN weight [rows, cols] with scales [ceil(rows/128), ceil(cols/128)]; partial edge
// blocks use their own (partial) block's scale.
struct Fp8BlockTensor {
  const uint8_t* data = nullptr;
  const void* scales = nullptr;  // uint8_t E8M0 or float, per scale_type
  Fp8ScaleType scale_type = Fp8ScaleType::kE8M0;
  int64_t rows = 0;
  int64_t cols = 0;
};

// MXFP4 weight: packed E2M1 [rows, cols/2] (even element in the low nibble), E8M0 scales
// [rows, cols/32]. cols % 32 == 0.
struct Mxfp4Tensor {
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

// NVFP4 weight as ModelOpt exports it: packed E2M1 [rows, cols/2] (even element low nibble),
// E4M3 block scales [rows, cols/16] (linear layout), float32 global scale. cols % 16 == 0.
struct Nvfp4Tensor {
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  float scale_2 = 0.0f;
  int64_t rows = 0;
  int64_t cols = 0;
};

// Where an NVFP4 quantization writes: packed values, block scales (both in the backend's
// memory), and the global scale (always host memory).
struct Nvfp4Out {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
  float* scale_2 = nullptr;
};

// Global (per-tensor) amax for NVFP4: either computed from the tensor, or supplied so that fused
// partners (w1/w3, wq_a/wkv) share one weight_scale_2.
using GlobalAmax = std::optional<float>;

}  // namespace quantd::kernels

#endif  // QUANTD_KERNELS_TENSOR_VIEWS_H_
