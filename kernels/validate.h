// Argument checks shared by every backend, so that all of them reject the same inputs with the
// same messages, and the error for bad data names the element.
#ifndef QUANTD_KERNELS_VALIDATE_H_
#define QUANTD_KERNELS_VALIDATE_H_

#include <stdint.h>

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "kernels/tensor_views.h"

namespace quantd::kernels {

absl::Status ValidateDense(const DenseTensor& t, int64_t col_multiple);
absl::Status ValidateFp8Block(const Fp8BlockTensor& t);
absl::Status ValidateMxfp4(const Mxfp4Tensor& t);
absl::Status ValidateNvfp4(const Nvfp4Tensor& t);
absl::Status ValidateNvfp4Out(const Nvfp4Out& t);
absl::Status ValidateOut(const void* data, absl::string_view what);
absl::Status ValidateGlobalAmax(GlobalAmax amax);
// kmax must be a finite E8M0 exponent and at least the tensor's own largest exponent.
absl::Status ValidateKmax(int kmax, int tensor_max_exponent);

// The error for a bad element found by a kernel (flat index `index` in a tensor with `cols`
// columns): "<what> at [row, col]".
absl::Status BadElement(absl::string_view what, int64_t index, int64_t cols);

}  // namespace quantd::kernels

#endif  // QUANTD_KERNELS_VALIDATE_H_
