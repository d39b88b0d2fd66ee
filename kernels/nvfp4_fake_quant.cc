#include "kernels/nvfp4_fake_quant.h"

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"

namespace quantd::kernels {

absl::Status Nvfp4FakeQuantRows(float* x, int64_t rows, int64_t cols, int64_t ld,
                                float input_scale) {
  constexpr int64_t kBlock = formats::kNvfp4BlockSize;
  if (cols % kBlock != 0 || ld < cols || rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("NVFP4 activation of [", rows, ", ", cols,
                                                   "] (row stride ", ld,
                                                   "): columns must be a multiple of 16"));
  }
  if (!formats::IsFinite(input_scale) || !(input_scale > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 activation: input_scale ", input_scale, " is not finite and positive"));
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * ld;
    for (int64_t b = 0; b < cols; b += kBlock) {
      float amax = 0.0f;
      for (int64_t j = b; j < b + kBlock; ++j) {
        if (!formats::IsFinite(row[j])) {
          return absl::InvalidArgumentError(
              absl::StrCat("NVFP4 activation: non-finite value at [", r, ", ", j, "]"));
        }
        const float a = formats::AbsF(row[j]);
        amax = a > amax ? a : amax;
      }
      const uint8_t scale = formats::Nvfp4ActivationBlockScale(amax, input_scale);
      const float d = formats::E4m3ToFloat(scale) * input_scale;
      for (int64_t j = b; j < b + kBlock; ++j) {
        row[j] = scale == 0
                     ? 0.0f
                     : formats::E2m1ToFloat(formats::Nvfp4Encode(row[j], scale, input_scale)) * d;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace quantd::kernels
