#include "server/compute/device.h"

#include <unistd.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/backends.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/gemm.h"
#include "server/compute/device_name.h"
#include "server/compute/requirement.h"

namespace quantd::compute {
namespace {

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? int64_t{pages} * page_size : 0;
}

// Resident bytes of this process (statm's second field).
int64_t ResidentBytes() {
  FILE* f = fopen("/proc/self/statm", "re");
  if (f == nullptr) return 0;
  long size = 0, resident = 0;
  const int n = fscanf(f, "%ld %ld", &size, &resident);
  fclose(f);
  return n == 2 ? int64_t{resident} * sysconf(_SC_PAGESIZE) : 0;
}

class CpuDevice final : public Device {
 public:
  CpuDevice(std::unique_ptr<kernels::Backend> backend, std::unique_ptr<kernels::Gemm> gemm,
            int64_t budget, int threads)
      : backend_(std::move(backend)), gemm_(std::move(gemm)), budget_(budget), threads_(threads),
        pool_(threads > 1 ? std::make_unique<kernels::cpu::ThreadPool>(threads) : nullptr) {}
  DeviceKind kind() const override { return DeviceKind::kCpu; }
  const std::string& name() const override { return name_; }
  int64_t total_memory_bytes() const override { return budget_; }
  absl::StatusOr<int64_t> free_memory_bytes() const override {
    const int64_t free = budget_ - ResidentBytes();
    return free > 0 ? free : 0;
  }
  bool host_visible() const override { return backend_->host_memory(); }
  kernels::Backend& backend() override { return *backend_; }
  kernels::Gemm* gemm() override { return gemm_.get(); }
  int host_threads() const override { return threads_; }
  kernels::cpu::ThreadPool* host_pool() override { return pool_.get(); }

 private:
  const std::string name_ = "cpu";
  std::unique_ptr<kernels::Backend> backend_;  // owned; used by the owning worker only
  std::unique_ptr<kernels::Gemm> gemm_;        // OpenBLAS; used by the owning worker only
  const int64_t budget_;                       // bytes; fixed at open
  const int threads_;                          // host threads, >= 1; fixed at open
  // threads_ host threads (nullptr for one); its Run serializes callers.
  const std::unique_ptr<kernels::cpu::ThreadPool> pool_;
};

}  // namespace

const char* DeviceKindName(DeviceKind kind) {
  return kind == DeviceKind::kCuda ? "cuda" : "cpu";
}

absl::StatusOr<std::unique_ptr<Device>> OpenDevice(const std::string& name,
                                                   const DeviceOptions& options) {
  int cuda_index = -1;
  if (!ParseDeviceName(name, &cuda_index)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device \"", name, "\": expected \"cpu\" or \"cuda:N\""));
  }
  if (cuda_index >= 0) return OpenCudaDevice(cuda_index);
  auto backend = kernels::MakeCpuBackend({options.cpu_threads, kernels::SimdLevel::kAuto});
  if (!backend.ok()) return backend.status();
  const int64_t budget =
      options.host_memory_bytes > 0 ? options.host_memory_bytes : PhysicalMemoryBytes();
  const int threads = options.cpu_threads > 0
                          ? options.cpu_threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return std::unique_ptr<Device>(new CpuDevice(
      std::move(*backend), kernels::MakeOpenBlasGemm(options.cpu_threads), budget, threads));
}

bool Fits(const Device& device, const DeviceRequirement& req, int64_t reserved_bytes) {
  if (req.gpu && device.kind() != DeviceKind::kCuda) return false;
  return reserved_bytes + req.memory_bytes <= device.total_memory_bytes();
}

}  // namespace quantd::compute
