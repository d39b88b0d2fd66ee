#include "kernels/backend.h"

#include <utility>

#include "kernels/formats.h"
#include "kernels/validate.h"

namespace quantd::kernels {

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    if (deleter_ != nullptr && data_ != nullptr) deleter_(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    deleter_ = std::exchange(other.deleter_, nullptr);
  }
  return *this;
}

absl::Status Backend::Nvfp4Quantize(const DenseTensor& src, GlobalAmax global_amax,
                                    const Nvfp4Out& dst) {
  if (auto s = ValidateDense(src, kNvfp4BlockSize); !s.ok()) return s;
  if (auto s = ValidateNvfp4Out(dst); !s.ok()) return s;
  if (auto s = ValidateGlobalAmax(global_amax); !s.ok()) return s;
  float amax;
  if (global_amax.has_value()) {
    amax = *global_amax;
  } else {
    absl::StatusOr<float> own = AbsMax(src);
    if (!own.ok()) return own.status();
    amax = *own;
  }
  const float scale_2 = formats::Nvfp4GlobalScale(amax);
  if (auto s = Nvfp4QuantizeWithScale(src, scale_2, dst); !s.ok()) return s;
  *dst.scale_2 = scale_2;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Backend::Mxfp4ToNvfp4(const Mxfp4Tensor& src, int kmax,
                                              const Nvfp4Out& dst) {
  if (auto s = ValidateNvfp4Out(dst); !s.ok()) return s;
  absl::StatusOr<int> own_max = Mxfp4MaxExponent(src);  // validates src, rejects NaN scales
  if (!own_max.ok()) return own_max.status();
  if (auto s = ValidateKmax(kmax, *own_max); !s.ok()) return s;
  absl::StatusOr<int64_t> requantized = Mxfp4ToNvfp4WithKmax(src, kmax, dst);
  if (!requantized.ok()) return requantized.status();
  *dst.scale_2 = formats::Exp2Int(kmax - 8);
  return requantized;
}

Buffer::~Buffer() {
  if (deleter_ != nullptr && data_ != nullptr) deleter_(data_);
}

}  // namespace quantd::kernels
