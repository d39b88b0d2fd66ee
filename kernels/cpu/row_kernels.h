// The row-range kernels of one CPU SIMD level. Every level implements the signatures of
// kernels/reference.h and writes the same bytes and returns the same first bad index as the
// reference; the scalar level is the reference itself.
#ifndef QUANTD_KERNELS_CPU_ROW_KERNELS_H_
#define QUANTD_KERNELS_CPU_ROW_KERNELS_H_

#include <stdint.h>

#include "kernels/tensor_views.h"

namespace quantd::kernels {
// kernels/backends.h; not included here, so that the SIMD files stay free of code with static
// initializers (absl/status pulls in <iostream>).
enum class SimdLevel;
}  // namespace quantd::kernels

namespace quantd::kernels::cpu {

struct RowKernels {
  const char* name;  // "scalar", "avx2" or "avx512"
  int64_t (*fp8_block_dequant)(const Fp8BlockTensor& src, const DenseOut& dst, int64_t row_begin,
                               int64_t row_end);
  int64_t (*mxfp4_dequant)(const Mxfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                           int64_t row_end);
  int64_t (*abs_max)(const DenseTensor& src, int64_t row_begin, int64_t row_end, float* amax);
  int64_t (*block_abs_max16)(const DenseTensor& src, float* out, int64_t row_begin,
                             int64_t row_end);
  int64_t (*nvfp4_quantize)(const DenseTensor& src, float scale_2, const Nvfp4Out& dst,
                            int64_t row_begin, int64_t row_end);
  void (*nvfp4_dequant)(const Nvfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                        int64_t row_end);
  int64_t (*mxfp4_max_scale)(const Mxfp4Tensor& src, int64_t row_begin, int64_t row_end,
                             uint8_t* max_byte);
  int64_t (*mxfp4_to_nvfp4)(const Mxfp4Tensor& src, int kmax, const Nvfp4Out& dst,
                            int64_t row_begin, int64_t row_end, int64_t* requantized);
};

// The kernels of `level` (kScalar, kAvx2 or kAvx512), or nullptr when this build has none for it.
const RowKernels* RowKernelsFor(SimdLevel level);

// Defined in row_kernels_avx2.cc / row_kernels_avx512.cc (x86-64 builds only). Run them only
// where SupportedSimdLevels() lists their level.
extern const RowKernels kAvx2RowKernels;
extern const RowKernels kAvx512RowKernels;

}  // namespace quantd::kernels::cpu

#endif  // QUANTD_KERNELS_CPU_ROW_KERNELS_H_
