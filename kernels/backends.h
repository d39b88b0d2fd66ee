// Factories for the concrete backends.
#ifndef QUANTD_KERNELS_BACKENDS_H_
#define QUANTD_KERNELS_BACKENDS_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace quantd::kernels {

// Instruction-set level of the CPU backend. kAuto picks the best the running CPU supports.
enum class SimdLevel { kAuto, kScalar, kAvx2, kAvx512 };

struct CpuOptions {
  int threads = 0;                    // worker threads; 0 = std::thread::hardware_concurrency()
  SimdLevel simd = SimdLevel::kAuto;  // forced level; unsupported levels are an error
};

// Levels the running CPU can execute, best last (always starts with kScalar).
std::vector<SimdLevel> SupportedSimdLevels();

absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(const CpuOptions& options);

// Number of CUDA devices usable now (0 when built without CUDA or when no driver/device exists).
int CudaDeviceCount();

// A backend on CUDA device `device`. Unavailable when built without CUDA or no such device exists.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

}  // namespace quantd::kernels

#endif  // QUANTD_KERNELS_BACKENDS_H_
