// How the DeepSeek-V4 forward rounds (v4_forward_crosscheck.md §1b, §1c).
#ifndef QUANTD_SERVER_MODEL_V4_NUMERICS_H_
#define QUANTD_SERVER_MODEL_V4_NUMERICS_H_

namespace quantd::model {

enum class Numerics {
  // DeepSeek's official inference code at its current revision: BF16 residual streams and GEMM
  // outputs, FP8 activation simulation (per row, per 128 columns, power-of-two scale) before
  // every FP8/FP4 weight, fp32 router/compressor/MoE accumulation, BF16 P before P·V, KV FP8
  // simulation that really rounds, shared expert clamped.
  kOfficial,
  // fp32 everywhere, no activation simulation: the cross-check against transformers in fp32.
  kMath,
};

// "official" / "math".
const char* NumericsName(Numerics numerics);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_NUMERICS_H_
