#include "server/model/v4_act_quant.h"

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

constexpr float kFp8MinAmax = 1e-4f;             // kernel.py act_quant_kernel
constexpr float kFp4MinAmax = 6.0f * 0x1p-126f;  // kernel.py fp4_quant_kernel

absl::Status CheckShape(int64_t rows, int64_t cols, int64_t ld, int64_t block) {
  if (rows < 0 || cols < 0 || ld < cols || block <= 0 || cols % block != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("activation quantization of [", rows, ", ", cols, "] (row stride ", ld,
                     "): the width must be a multiple of the block ", block));
  }
  return absl::OkStatus();
}

// Quantizes each block of each row with `encode`/`decode` of a format whose largest magnitude
// is `max_code`.
// Rows [begin, end) of Simulate.
template <typename Encode, typename Decode>
absl::Status SimulateRows(float* x, int64_t begin, int64_t end, int64_t cols, int64_t ld,
                          int64_t block, float max_code, float min_amax, Encode encode,
                          Decode decode) {
  for (int64_t r = begin; r < end; ++r) {
    float* row = x + r * ld;
    for (int64_t b = 0; b < cols; b += block) {
      float amax = 0.0f;
      for (int64_t c = b; c < b + block; ++c) {
        if (!formats::IsFinite(row[c])) {
          return absl::InvalidArgumentError(
              absl::StrCat("activation quantization: non-finite value at [", r, ", ", c, "]"));
        }
        const float a = formats::AbsF(row[c]);
        amax = a > amax ? a : amax;
      }
      const float s = PowerOfTwoScale(amax > min_amax ? amax : min_amax, max_code);
      for (int64_t c = b; c < b + block; ++c) {
        float q = row[c] / s;
        q = q > max_code ? max_code : (q < -max_code ? -max_code : q);
        row[c] = decode(encode(q)) * s;
      }
    }
  }
  return absl::OkStatus();
}

template <typename Encode, typename Decode>
absl::Status Simulate(float* x, int64_t rows, int64_t cols, int64_t ld, int64_t block,
                      float max_code, float min_amax, Encode encode, Decode decode,
                      const HostThreads& threads) {
  if (absl::Status s = CheckShape(rows, cols, ld, block); !s.ok()) return s;
  return ParallelRowsOrError(threads, rows, 8 * cols, [&](int64_t begin, int64_t end) {
    return SimulateRows(x, begin, end, cols, ld, block, max_code, min_amax, encode, decode);
  });
}

}  // namespace

float PowerOfTwoScale(float amax, float max_code) {
  const float inv = 1.0f / max_code;  // the kernels' fp32 constant fp8_max_inv / fp4_max_inv
  return formats::Exp2Int(formats::CeilLog2(amax * inv));
}

absl::Status SimulateFp8Act(float* x, int64_t rows, int64_t cols, int64_t ld, int64_t block,
                            const HostThreads& threads) {
  return Simulate(x, rows, cols, ld, block, formats::kE4m3Max, kFp8MinAmax, formats::FloatToE4m3,
                  formats::E4m3ToFloat, threads);
}

absl::Status SimulateFp4Act(float* x, int64_t rows, int64_t cols, int64_t ld,
                            const HostThreads& threads) {
  return Simulate(x, rows, cols, ld, kFp4QuantBlock, formats::kE2m1Max, kFp4MinAmax,
                  formats::FloatToE2m1, formats::E2m1ToFloat, threads);
}

void RoundToBf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = formats::RoundToBf16(x[i]);
}

}  // namespace quantd::model
