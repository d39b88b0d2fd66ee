#include "server/model/v4_linear_cuda.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/v4_blocks.h"
#include "kernels/cuda/v4_cast_blocks.h"
#include "kernels/nvfp4_fake_quant.h"
#include "server/base/status_macros.h"
#include "server/model/v4_act_quant.h"

namespace quantd::model {

absl::Status ToModelDtypeOnDevice(const DeviceForwardContext& ctx, float* x, int64_t n) {
  if (!ctx.official()) return absl::OkStatus();
  return LaunchStatus(kernels::cuda::LaunchRoundToBf16(x, n, ctx.launch), "BF16 rounding");
}

absl::Status ObserveLinearInput(const DeviceForwardContext& ctx, const std::string& module,
                                const float* x, int64_t rows, int64_t cols,
                                const DeviceLinearRows& facts) {
  if (ctx.observer == nullptr || rows <= 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<float> host, DownloadArray(x, rows * cols, module + " input"));
  std::vector<float> unweighted;
  if (facts.unweighted != nullptr) {
    ASSIGN_OR_RETURN(unweighted,
                     DownloadArray(facts.unweighted, rows * cols, module + " unweighted input"));
  }
  LinearInput input;
  input.module = &module;
  input.expert = facts.expert;
  input.x = host.data();
  input.rows = rows;
  input.cols = cols;
  input.ld = cols;
  input.tokens = facts.tokens;
  input.routing_weights = facts.routing_weights;
  input.unweighted_x = facts.unweighted != nullptr ? unweighted.data() : nullptr;
  ctx.observer->OnLinearInput(input);
  return absl::OkStatus();
}

absl::Status DeviceMatMulNT(const DeviceForwardContext& ctx, const float* x, int64_t m,
                            const kernels::DenseTensor& w, float* out, const std::string& what) {
  const int64_t n = w.rows, k = w.cols;
  kernels::DenseTensor xt{x, kernels::FloatType::kF32, m, k};
  if (w.type == kernels::FloatType::kF32) return ctx.gemm->MatMulNT(xt, w, out, false);
  if (ctx.official()) {
    ASSIGN_OR_RETURN(void* narrow, ctx.scratch->Get(*ctx.device, DeviceScratch::kOperand,
                                                    static_cast<size_t>(m * k) * 2));
    RETURN_IF_ERROR(LaunchStatus(
        kernels::cuda::LaunchNarrowToBf16(x, m * k, static_cast<uint16_t*>(narrow), ctx.launch),
        what + " input to BF16"));
    xt.data = narrow;
    xt.type = kernels::FloatType::kBF16;
    return ctx.gemm->MatMulNT(xt, w, out, false);
  }
  ASSIGN_OR_RETURN(void* wide, ctx.scratch->Get(*ctx.device, DeviceScratch::kOperand,
                                                static_cast<size_t>(n * k) * 4));
  RETURN_IF_ERROR(
      LaunchStatus(kernels::cuda::LaunchWidenBf16(static_cast<const uint16_t*>(w.data), n * k,
                                                  static_cast<float*>(wide), ctx.launch),
                   what + " weight to F32"));
  kernels::DenseTensor wt = w;
  wt.data = wide;
  wt.type = kernels::FloatType::kF32;
  return ctx.gemm->MatMulNT(xt, wt, out, false);
}

absl::Status ApplyLinearOnDevice(const DeviceForwardContext& ctx, const DeviceLinear& w,
                                 const float* x, int64_t rows, float* out, LinearOutput output,
                                 const DeviceLinearRows& facts) {
  const int64_t in = w.in_features();
  RETURN_IF_ERROR(ObserveLinearInput(ctx, w.module, x, rows, in, facts));
  if (rows <= 0) return absl::OkStatus();
  float* simulated = nullptr;  // the simulated copy of x, when there is a simulation
  if ((ctx.official() && w.quantized_source) || w.input_scale > 0.0f) {
    const size_t bytes = static_cast<size_t>(rows * in) * sizeof(float);
    ASSIGN_OR_RETURN(void* scratch,
                     ctx.scratch->Get(*ctx.device, DeviceScratch::kSimulated, bytes));
    simulated = static_cast<float*>(scratch);
    RETURN_IF_ERROR(LaunchStatus(
        cudaMemcpyAsync(simulated, x, bytes, cudaMemcpyDeviceToDevice, ctx.launch.stream),
        w.module + " input"));
  }
  if (ctx.official() && w.quantized_source) {
    if (in % kActQuantBlock != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(w.module, " input: activation quantization of [", rows, ", ", in,
                       "] needs whole blocks of ", kActQuantBlock));
    }
    RETURN_IF_ERROR(
        LaunchStatus(kernels::cuda::LaunchSimulateFp8Act(simulated, rows, in, in, kActQuantBlock,
                                                         ctx.results(), ctx.launch),
                     w.module + " input"));
    ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(ctx, w.module + " input"));
    if (bad != kernels::cuda::kNoBad) {
      return absl::InvalidArgumentError(
          absl::StrCat(w.module, " input: activation quantization: non-finite value at [", bad / in,
                       ", ", bad % in, "]"));
    }
  } else if (w.input_scale > 0.0f) {
    // NVFP4 W4A4: the runtime's activation quantization runs on a host copy
    // (kernels/nvfp4_fake_quant.h has no device kernel), bit-identical to the host forward's.
    ASSIGN_OR_RETURN(std::vector<float> host,
                     DownloadArray<float>(simulated, rows * in, w.module + " input"));
    if (absl::Status s = kernels::Nvfp4FakeQuantRows(host.data(), rows, in, in, w.input_scale);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(w.module, " input: ", s.message()));
    }
    RETURN_IF_ERROR(CopyToDevice(host.data(), host.size() * sizeof(float), simulated, w.module));
  }
  RETURN_IF_ERROR(
      DeviceMatMulNT(ctx, simulated != nullptr ? simulated : x, rows, w.view, out, w.module));
  if (output == LinearOutput::kModelDtype) {
    RETURN_IF_ERROR(ToModelDtypeOnDevice(ctx, out, rows * w.out_features()));
  }
  return absl::OkStatus();
}

}  // namespace quantd::model
