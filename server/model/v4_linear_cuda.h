// ApplyLinear (v4_linear.h) on a CUDA device (CUDA builds only): the same steps over device
// buffers. The observer sees host copies of the input (and of an expert w2's unweighted input)
// before any activation simulation, with the module name, expert id, token rows and routing
// weights the host forward passes: each observed call copies rows * in_features floats to the
// host (a synchronous copy over PCIe/NVLink-C2C; for calibration that is the price of an observer
// written for host memory).
//
// Products: an F32 weight multiplies the F32 input (cuBLAS sgemm, no TF32). A BF16 weight in
// official numerics multiplies the input narrowed to BF16 (cublasGemmEx, BF16 operands, fp32
// accumulation): official inputs are BF16-representable (model dtype, or FP8-simulated), so the
// narrowing is exact and only the accumulation order differs from the host. A BF16 weight in math
// numerics is widened to F32 into scratch for an sgemm, as the host's Gemm widens it per tile.
#ifndef QUANTD_SERVER_MODEL_V4_LINEAR_CUDA_H_
#define QUANTD_SERVER_MODEL_V4_LINEAR_CUDA_H_

#include <stdint.h>

#include "absl/status/status.h"
#include "server/model/v4_device_context.h"
#include "server/model/v4_device_weights.h"
#include "server/model/v4_linear.h"

namespace quantd::model {

// LinearRows for a device call: the host-side facts the observer gets, and the unweighted w2
// input in device memory (copied to the host only when observed).
struct DeviceLinearRows {
  const int64_t* tokens = nullptr;         // host; LinearInput::tokens
  int expert = -1;                         // LinearInput::expert
  const float* routing_weights = nullptr;  // host; LinearInput::routing_weights
  const float* unweighted = nullptr;       // device; LinearInput::unweighted_x
};

// out[rows, w.out_features()] = x[rows, w.in_features()] · w^T, x and out device buffers; x is
// not modified. Errors name w.module.
absl::Status ApplyLinearOnDevice(const DeviceForwardContext& ctx, const DeviceLinear& w,
                                 const float* x, int64_t rows, float* out,
                                 LinearOutput output = LinearOutput::kModelDtype,
                                 const DeviceLinearRows& facts = {});

// out[m, n] = x[m, k] · w[n, k]^T for a device F32 input and a device weight view of either
// dtype, with the operand policy above (the products without a LinearWeight: mHC mixes, wo_a's
// groups).
absl::Status DeviceMatMulNT(const DeviceForwardContext& ctx, const float* x, int64_t m,
                            const kernels::DenseTensor& w, float* out, const std::string& what);

// ToModelDtype on device values: BF16-rounded in official numerics, unchanged in math.
absl::Status ToModelDtypeOnDevice(const DeviceForwardContext& ctx, float* x, int64_t n);

// Shows the observer a host copy of x [rows, cols] (device) as `module`'s input.
absl::Status ObserveLinearInput(const DeviceForwardContext& ctx, const std::string& module,
                                const float* x, int64_t rows, int64_t cols,
                                const DeviceLinearRows& facts);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_LINEAR_CUDA_H_
