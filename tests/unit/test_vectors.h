// Host-side test tensors for the kernel tests and benchmarks: random tensors with the structure
// of real weights, plus edge cases (values on E2M1 rounding thresholds, all-zero blocks, tiny and
// subnormal values, every E4M3 code, extreme E8M0 scales). Deterministic for a given seed.
#ifndef QUANTD_TESTS_UNIT_TEST_VECTORS_H_
#define QUANTD_TESTS_UNIT_TEST_VECTORS_H_

#include <stdint.h>

#include <vector>

#include "kernels/tensor_views.h"

namespace quantd::test_vectors {

// A dense BF16 or F32 tensor in host memory.
struct Dense {
  kernels::FloatType type = kernels::FloatType::kBF16;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> bytes;  // row-major elements

  Dense(kernels::FloatType type, int64_t rows, int64_t cols);  // all zero
  size_t element_size() const { return type == kernels::FloatType::kF32 ? 4 : 2; }
  // Writes element [r, c] (rounded to BF16 with RNE where needed) / reads it back as float.
  void Set(int64_t r, int64_t c, float v);
  float Get(int64_t r, int64_t c) const;
  kernels::DenseTensor View(const void* data) const { return {data, type, rows, cols}; }
};

// FP8 E4M3 codes with 128x128 block scales, E8M0 bytes or F32 values (stored as bytes).
struct Fp8 {
  kernels::Fp8ScaleType scale_type = kernels::Fp8ScaleType::kE8M0;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> data;    // [rows, cols] E4M3 codes
  std::vector<uint8_t> scales;  // [scale_rows, scale_cols] bytes or floats

  int64_t scale_rows() const {
    return (rows + kernels::kFp8BlockSize - 1) / kernels::kFp8BlockSize;
  }
  int64_t scale_cols() const {
    return (cols + kernels::kFp8BlockSize - 1) / kernels::kFp8BlockSize;
  }
  void SetF32Scale(int64_t i, float v);
  kernels::Fp8BlockTensor View(const uint8_t* d, const void* s) const {
    return {d, s, scale_type, rows, cols};
  }
};

// MXFP4: packed E2M1 [rows, cols/2] and E8M0 scales [rows, cols/32].
struct Mxfp4 {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> data;
  std::vector<uint8_t> scales;
  kernels::Mxfp4Tensor View(const uint8_t* d, const uint8_t* s) const { return {d, s, rows, cols}; }
};

// NVFP4: packed E2M1 [rows, cols/2], E4M3 scales [rows, cols/16] and weight_scale_2.
struct Nvfp4 {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> data;
  std::vector<uint8_t> scales;
  float scale_2 = 0.0f;
  kernels::Nvfp4Tensor View(const uint8_t* d, const uint8_t* s) const {
    return {d, s, scale_2, rows, cols};
  }
};

// Weight-like values: normal with a per-row spread, ~1% outlier columns (x30..x100), and per
// 16-element block (flat): ~2% all zero, ~1% subnormal-tiny, ~2% one large value among tiny
// negatives (which NVFP4 encodes as -0), and some exact +-0.
Dense RandomWeights(kernels::FloatType type, int64_t rows, int64_t cols, uint64_t seed);

// cols % 16 == 0. Element [0, 0] is 2688, so the tensor's own NVFP4 weight_scale_2 is exactly 1.
// Every other 16-block b has the E4M3-exact block scale s = ThresholdBlockScale(b) and holds
// {6, t1..t7, -t1..-t7, -6} * s with t = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (the E2M1 rounding
// thresholds), so each element divides to exactly a threshold or to +-6. For F32, blocks with
// b % 3 == 1 (2) have the threshold values moved one ulp up (down).
Dense ThresholdWeights(kernels::FloatType type, int64_t rows, int64_t cols);
float ThresholdBlockScale(int64_t block);

// Every non-NaN E4M3 code (the first 254 elements run through all of them, the rest are random);
// E8M0 scales random in [100, 140] with bytes 0 (2^-127: subnormal products), 1 and 254 (products
// overflow to inf) at the first blocks; F32 scales random in [2^-20, 2^4] with a subnormal,
// 1e30 and 2^-126 at the first blocks.
Fp8 RandomFp8(kernels::Fp8ScaleType scale_type, int64_t rows, int64_t cols, uint64_t seed);

// cols % 32 == 0. Random nibbles; scale bytes uniform in [min_scale, max_scale], and the first
// two blocks (if there are so many) use min_scale and max_scale.
Mxfp4 RandomMxfp4(int64_t rows, int64_t cols, uint64_t seed, uint8_t min_scale, uint8_t max_scale);

// cols % 16 == 0. Random nibbles, random non-NaN E4M3 scale bytes (0x00, 0x01, 0x7E and 0x80 at
// the first blocks), weight_scale_2 = 0.0137.
Nvfp4 RandomNvfp4(int64_t rows, int64_t cols, uint64_t seed);

}  // namespace quantd::test_vectors

#endif  // QUANTD_TESTS_UNIT_TEST_VECTORS_H_
