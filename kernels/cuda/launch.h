// Launchers for the CUDA kernels: plain functions compiled by nvcc and called by cuda_backend.cc
// (compiled by the host compiler, with absl). Every tensor pointer is a device pointer on the
// current device. Launchers only enqueue work on launch.stream and return the launch error; the
// caller waits on the stream and reads the kernels' scalars from DeviceResults.
#ifndef QUANTD_KERNELS_CUDA_LAUNCH_H_
#define QUANTD_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/tensor_views.h"

namespace quantd::kernels::cuda {

// DeviceResults::first_bad when no element was bad.
inline constexpr unsigned long long kNoBad = ~0ull;

// Scalars that kernels hand back to the host, in device memory. Every launcher that takes one
// resets it first.
struct DeviceResults {
  unsigned long long first_bad;  // smallest bad flat index (row * cols + col), or kNoBad
  unsigned long long count;      // Mxfp4ToNvfp4: requantized 16-blocks
  unsigned int max_bits;         // AbsMax: bits of the largest |x|; Mxfp4MaxScale: largest byte
};

// Where kernels run and how wide their grids may be.
struct Launch {
  cudaStream_t stream = nullptr;  // the backend's stream on its device
  int max_blocks = 1;             // grid-stride kernels launch at most this many blocks
};

// first_bad: a NaN E4M3 code or a NaN/non-positive scale (per reference::Fp8BlockDequantRows).
cudaError_t LaunchFp8BlockDequant(const Fp8BlockTensor& src, const DenseOut& dst,
                                  DeviceResults* results, const Launch& launch);
// first_bad: the first element of a block with a NaN (0xFF) scale.
cudaError_t LaunchMxfp4Dequant(const Mxfp4Tensor& src, const DenseOut& dst,
                               DeviceResults* results, const Launch& launch);
// first_bad: the first element of a block with a NaN E4M3 scale.
cudaError_t LaunchNvfp4Dequant(const Nvfp4Tensor& src, const DenseOut& dst,
                               DeviceResults* results, const Launch& launch);
// max_bits: bits of max |x|. first_bad: a non-finite element.
cudaError_t LaunchAbsMax(const DenseTensor& src, DeviceResults* results, const Launch& launch);
// out[b] = max |x| over flat 16-block b. first_bad: a non-finite element.
cudaError_t LaunchBlockAbsMax16(const DenseTensor& src, float* out, DeviceResults* results,
                                const Launch& launch);
// NVFP4 codes and block scales given weight_scale_2. first_bad: a non-finite element.
cudaError_t LaunchNvfp4Quantize(const DenseTensor& src, float scale_2, uint8_t* data,
                                uint8_t* scales, DeviceResults* results, const Launch& launch);
// max_bits: the largest scale byte. first_bad: the first element of a block with a 0xFF scale.
cudaError_t LaunchMxfp4MaxScale(const Mxfp4Tensor& src, DeviceResults* results,
                                const Launch& launch);
// Lossless cast with weight_scale_2 = 2^(kmax-8); scales must hold no 0xFF (checked by
// LaunchMxfp4MaxScale first). count: requantized 16-blocks.
cudaError_t LaunchMxfp4ToNvfp4(const Mxfp4Tensor& src, int kmax, uint8_t* data, uint8_t* scales,
                               DeviceResults* results, const Launch& launch);

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_LAUNCH_H_
