#include "kernels/cpu/row_kernels.h"

#include "kernels/backends.h"
#include "kernels/reference.h"

namespace quantd::kernels {
namespace cpu {
namespace {

// The portable level: the reference functions themselves.
const RowKernels kScalarRowKernels = {
    "scalar",
    reference::Fp8BlockDequantRows,
    reference::Mxfp4DequantRows,
    reference::AbsMaxRows,
    reference::BlockAbsMax16Rows,
    reference::Nvfp4QuantizeRows,
    reference::Nvfp4DequantRows,
    reference::Mxfp4MaxScaleRows,
    reference::Mxfp4ToNvfp4Rows,
};

}  // namespace

const RowKernels* RowKernelsFor(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return &kScalarRowKernels;
#if defined(QUANTD_CPU_X86)
    case SimdLevel::kAvx2:
      return &kAvx2RowKernels;
    case SimdLevel::kAvx512:
      return &kAvx512RowKernels;
#endif
    default:
      return nullptr;
  }
}

}  // namespace cpu

std::vector<SimdLevel> SupportedSimdLevels() {
  std::vector<SimdLevel> levels = {SimdLevel::kScalar};
#if defined(QUANTD_CPU_X86)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2) levels.push_back(SimdLevel::kAvx2);
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    levels.push_back(SimdLevel::kAvx512);
  }
#endif
  return levels;
}

}  // namespace quantd::kernels
