#include "kernels/validate.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace quantd::kernels {
namespace {

// Rows and columns must be positive and their product must not overflow a byte count.
absl::Status ValidateShape(absl::string_view what, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape [", rows, ", ", cols, "] must be positive"));
  }
  if (rows > (int64_t{1} << 40) / cols) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape [", rows, ", ", cols, "] is too large"));
  }
  return absl::OkStatus();
}

absl::Status ValidateColMultiple(absl::string_view what, int64_t cols, int64_t multiple) {
  if (cols % multiple != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", cols, " columns is not a multiple of ", multiple));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateDense(const DenseTensor& t, int64_t col_multiple) {
  if (t.data == nullptr) return absl::InvalidArgumentError("dense tensor: data is null");
  if (auto s = ValidateShape("dense tensor", t.rows, t.cols); !s.ok()) return s;
  return ValidateColMultiple("dense tensor", t.cols, col_multiple);
}

absl::Status ValidateFp8Block(const Fp8BlockTensor& t) {
  if (t.data == nullptr || t.scales == nullptr) {
    return absl::InvalidArgumentError("FP8 block tensor: data or scales is null");
  }
  return ValidateShape("FP8 block tensor", t.rows, t.cols);
}

absl::Status ValidateMxfp4(const Mxfp4Tensor& t) {
  if (t.data == nullptr || t.scales == nullptr) {
    return absl::InvalidArgumentError("MXFP4 tensor: data or scales is null");
  }
  if (auto s = ValidateShape("MXFP4 tensor", t.rows, t.cols); !s.ok()) return s;
  return ValidateColMultiple("MXFP4 tensor", t.cols, kMxfp4BlockSize);
}

absl::Status ValidateNvfp4(const Nvfp4Tensor& t) {
  if (t.data == nullptr || t.scales == nullptr) {
    return absl::InvalidArgumentError("NVFP4 tensor: data or scales is null");
  }
  if (!std::isfinite(t.scale_2) || !(t.scale_2 > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 tensor: weight_scale_2 ", t.scale_2, " is not finite and positive"));
  }
  if (auto s = ValidateShape("NVFP4 tensor", t.rows, t.cols); !s.ok()) return s;
  return ValidateColMultiple("NVFP4 tensor", t.cols, kNvfp4BlockSize);
}

absl::Status ValidateNvfp4Out(const Nvfp4Out& t) {
  if (t.data == nullptr || t.scales == nullptr || t.scale_2 == nullptr) {
    return absl::InvalidArgumentError("NVFP4 output: data, scales or scale_2 is null");
  }
  return absl::OkStatus();
}

absl::Status ValidateOut(const void* data, absl::string_view what) {
  if (data == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": output is null"));
  return absl::OkStatus();
}

absl::Status ValidateGlobalAmax(GlobalAmax amax) {
  if (amax.has_value() && !(std::isfinite(*amax) && *amax >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("global amax ", *amax, " must be finite and >= 0"));
  }
  return absl::OkStatus();
}

absl::Status ValidateKmax(int kmax, int tensor_max_exponent) {
  if (kmax < -127 || kmax > 127) {
    return absl::InvalidArgumentError(
        absl::StrCat("kmax ", kmax, " is outside E8M0's exponent range [-127, 127]"));
  }
  if (kmax < tensor_max_exponent) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kmax ", kmax, " is below the tensor's largest scale exponent ", tensor_max_exponent));
  }
  return absl::OkStatus();
}

absl::Status BadElement(absl::string_view what, int64_t index, int64_t cols) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, " at [", index / cols, ", ", index % cols, "]"));
}

}  // namespace quantd::kernels
