// NVFP4 activation fake-quantization: what a W4A4 runtime does to the input of an NVFP4 linear
// (quantize to E2M1 with per-16 E4M3 block scales and the global scale 1 / input_scale), undone
// at once so that a float32 product sees exactly the operand of the FP4 GEMM. Per block of 16
// consecutive elements of a row:
//
//   S = formats::Nvfp4ActivationBlockScale(max |x|, input_scale)   (E4M3 byte, saturated at 448)
//   d = float(S) * input_scale
//   x = e2m1(x / d) * d          (formats::Nvfp4Encode: ModelOpt's rounding, ties to even)
//
// This is ModelOpt's NVFP4 fake-quant (fp8_quantize_scale / fp4_round_magnitude in
// modelopt/torch/kernels/quantization/common/nvfp4_quant.py) with one difference: a block whose
// scale d is positive but below 1e-5 keeps it here, where ModelOpt substitutes 1.0 (and so
// zeroes the block); the runtimes' kernels keep it too. A block with S == 0 becomes zeros in
// both.
#ifndef QUANTD_KERNELS_NVFP4_FAKE_QUANT_H_
#define QUANTD_KERNELS_NVFP4_FAKE_QUANT_H_

#include <stdint.h>

#include "absl/status/status.h"

namespace quantd::kernels {

// Fake-quantizes x [rows, cols] in place, row stride `ld` (>= cols). InvalidArgument when cols
// is not a multiple of 16, input_scale is not finite and positive, or a value is not finite
// (naming [row, col]).
absl::Status Nvfp4FakeQuantRows(float* x, int64_t rows, int64_t cols, int64_t ld,
                                float input_scale);

}  // namespace quantd::kernels

#endif  // QUANTD_KERNELS_NVFP4_FAKE_QUANT_H_
