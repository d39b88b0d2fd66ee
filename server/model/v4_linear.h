// One linear layer of the DeepSeek-V4 forward, as the official `linear()` runs it: the input is
// shown to the observer, then (official numerics, FP8/MXFP4 weight) FP8-simulated per 128
// columns, or (an NVFP4 weight with an input_scale, either numerics) NVFP4 fake-quantized as a
// W4A4 runtime quantizes it; then multiplied by the decoded weight through the device's Gemm in
// float32, and the output rounded to BF16 (official numerics) unless the caller keeps it in
// float32.
#ifndef QUANTD_SERVER_MODEL_V4_LINEAR_H_
#define QUANTD_SERVER_MODEL_V4_LINEAR_H_

#include <stdint.h>

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "kernels/gemm.h"
#include "server/model/v4_numerics.h"
#include "server/model/v4_observer.h"
#include "server/model/v4_parallel.h"
#include "server/model/v4_weights.h"

namespace quantd::model {

class ForwardOps;  // v4_forward_ops.h

// Where and how one forward runs: the ops (host or device), the Gemm, the numerics, the
// observer. ApplyLinear and ToModelDtype below are the host ops' (host memory).
struct ForwardContext {
  kernels::Gemm* gemm = nullptr;  // the device's matrix products
  Numerics numerics = Numerics::kOfficial;
  Observer* observer = nullptr;  // may be nullptr
  // How the non-GEMM loops split over host threads; results do not depend on it.
  HostThreads threads;
  // Calibration only (calibrate_all_experts): the observer also sees every routed expert's
  // w1/w3/w2 inputs for the tokens not routed to it (w2: unweighted only); outputs unchanged.
  bool observe_all_experts = false;
  // The operations the forward runs on (MakeForwardContext: the device's); nullptr: the host ops.
  std::shared_ptr<ForwardOps> ops;
  // Called after every product (each expert's, each projection's): the running task's sign of
  // life, so a long batch keeps its lease. May be empty.
  std::function<void()> alive;
  // When set, MoeForward adds the seconds it spends decoding routed experts (the caller's
  // timing; one forward at a time per counter).
  double* decode_seconds = nullptr;
};

// Optional facts about the rows of one linear call, passed on to the observer.
struct LinearRows {
  const int64_t* tokens = nullptr;         // LinearInput::tokens
  int expert = -1;                         // LinearInput::expert
  const float* routing_weights = nullptr;  // LinearInput::routing_weights
  const float* unweighted = nullptr;       // LinearInput::unweighted_x
};

enum class LinearOutput {
  kModelDtype,  // official: rounded to BF16 (the GEMM's output dtype); math: float32
  kFloat32,     // float32 in both modes (router, compressor: fp32 in the official code)
};

// out[rows, w.out_features()] = x[rows, w.in_features()] · w^T. x is not modified.
absl::Status ApplyLinear(const ForwardContext& ctx, const LinearWeight& w, const float* x,
                         int64_t rows, float* out, LinearOutput output = LinearOutput::kModelDtype,
                         const LinearRows& facts = {});

// x[n] as the official code's model dtype: BF16-rounded in official numerics, unchanged in math
// numerics.
void ToModelDtype(const ForwardContext& ctx, float* x, int64_t n);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_LINEAR_H_
