#include "server/model/v4_linear.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/nvfp4_fake_quant.h"
#include "server/base/status_macros.h"
#include "server/model/v4_act_quant.h"
#include "server/model/v4_linear_input.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {

void ToModelDtype(const ForwardContext& ctx, float* x, int64_t n) {
  if (ctx.numerics != Numerics::kOfficial) return;
  ParallelRows(ctx.threads, n, 1,
               [x](int, int64_t begin, int64_t end) { RoundToBf16(x + begin, end - begin); });
}

LinearInput LinearInputOf(const LinearWeight& w, const float* x, int64_t rows,
                          const LinearRows& facts) {
  LinearInput input;
  input.module = &w.module;
  input.expert = facts.expert;
  input.x = x;
  input.rows = rows;
  input.cols = w.in_features();
  input.ld = w.in_features();
  input.tokens = facts.tokens;
  input.routing_weights = facts.routing_weights;
  input.unweighted_x = facts.unweighted;
  return input;
}

absl::Status ApplyLinear(const ForwardContext& ctx, const LinearWeight& w, const float* x,
                         int64_t rows, float* out, LinearOutput output, const LinearRows& facts) {
  const int64_t in = w.in_features();
  if (ctx.observer != nullptr && rows > 0) {
    ctx.observer->OnLinearInput(LinearInputOf(w, x, rows, facts));
  }
  kernels::DenseTensor xt{x, kernels::FloatType::kF32, rows, in};
  std::vector<float> simulated;
  if (ctx.numerics == Numerics::kOfficial && w.quantized_source) {
    simulated.assign(x, x + rows * in);
    if (absl::Status s =
            SimulateFp8Act(simulated.data(), rows, in, in, kActQuantBlock, ctx.threads);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(w.module, " input: ", s.message()));
    }
    xt.data = simulated.data();
  } else if (w.input_scale > 0.0f) {  // NVFP4 W4A4: the runtime's activation quantization
    simulated.assign(x, x + rows * in);
    if (absl::Status s = kernels::Nvfp4FakeQuantRows(simulated.data(), rows, in, in, w.input_scale);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(w.module, " input: ", s.message()));
    }
    xt.data = simulated.data();
  }
  RETURN_IF_ERROR(ctx.gemm->MatMulNT(xt, w.view, out, /*accumulate=*/false));
  if (output == LinearOutput::kModelDtype) ToModelDtype(ctx, out, rows * w.out_features());
  if (ctx.alive) ctx.alive();
  return absl::OkStatus();
}

}  // namespace quantd::model
