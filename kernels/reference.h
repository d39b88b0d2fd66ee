// Scalar reference implementations of every Backend operation, one element at a time, built only
// from formats.h. They work on a range of rows so that the CPU backend can run them on several
// threads as its portable (no-SIMD) level; every other backend is tested against them.
//
// Functions that can meet bad input return the flat index (row * cols + col) of the first bad
// element in their row range, or -1 when there is none. Arguments are assumed validated.
#ifndef QUANTD_KERNELS_REFERENCE_H_
#define QUANTD_KERNELS_REFERENCE_H_

#include <stdint.h>

#include "kernels/tensor_views.h"

namespace quantd::kernels::reference {

// Reads element i of a dense BF16/F32 tensor as float.
float LoadDense(const DenseTensor& t, int64_t i);
// Writes element i of a dense output, rounding to BF16 with RNE where needed.
void StoreDense(const DenseOut& t, int64_t i, float v);

// Bad: a NaN E4M3 code or a NaN/non-positive scale (the first element it covers).
int64_t Fp8BlockDequantRows(const Fp8BlockTensor& src, const DenseOut& dst, int64_t row_begin,
                            int64_t row_end);
// Bad: a NaN (0xFF) scale byte (the first element it covers).
int64_t Mxfp4DequantRows(const Mxfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                         int64_t row_end);
// max |x| over the rows into *amax. Bad: a non-finite element.
int64_t AbsMaxRows(const DenseTensor& src, int64_t row_begin, int64_t row_end, float* amax);
// out[r * cols/16 + b] = max |x| over block b of row r. Bad: a non-finite element.
int64_t BlockAbsMax16Rows(const DenseTensor& src, float* out, int64_t row_begin, int64_t row_end);
// NVFP4 values and block scales for the rows, given weight_scale_2. Bad: a non-finite element.
int64_t Nvfp4QuantizeRows(const DenseTensor& src, float scale_2, const Nvfp4Out& dst,
                          int64_t row_begin, int64_t row_end);
void Nvfp4DequantRows(const Nvfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                      int64_t row_end);
// Largest scale byte in the rows into *max_byte. Bad: a 0xFF (NaN) scale.
int64_t Mxfp4MaxScaleRows(const Mxfp4Tensor& src, int64_t row_begin, int64_t row_end,
                          uint8_t* max_byte);
// Lossless cast of the rows with scale_2 = 2^(kmax-8); adds the number of requantized 16-blocks
// to *requantized. Bad: a 0xFF (NaN) scale.
int64_t Mxfp4ToNvfp4Rows(const Mxfp4Tensor& src, int kmax, const Nvfp4Out& dst,
                         int64_t row_begin, int64_t row_end, int64_t* requantized);

}  // namespace quantd::kernels::reference

#endif  // QUANTD_KERNELS_REFERENCE_H_
