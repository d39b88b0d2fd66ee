#include "server/checkpoint/mapped_region_guard.h"

#include <signal.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace quantd::checkpoint {
namespace {

// One registered region. `end` == 0 marks a free slot; the handler reads the slots without a
// lock (only atomics are async-signal-safe), so a slot is published by storing `end` last and
// retired by clearing `end` first.
struct Region {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};

Region g_regions[kMaxGuardedRegions];
std::mutex g_register_mu;           // serializes Register/Unregister (not the handler)
bool g_in_use[kMaxGuardedRegions];  // guarded by g_register_mu: slot taken
std::once_flag g_install_once;      // the handler is installed once per process
uintptr_t g_page_size = 0;          // set before the handler is installed

void OnSigbus(int signo, siginfo_t* info, void* /*context*/) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Region& r : g_regions) {
    const uintptr_t end = r.end.load(std::memory_order_acquire);
    if (end == 0 || addr >= end || addr < r.begin.load(std::memory_order_relaxed)) continue;
    void* page = reinterpret_cast<void*>(addr & ~(g_page_size - 1));
    if (mmap(page, g_page_size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) !=
        MAP_FAILED) {
      r.faulted.store(true, std::memory_order_release);
      return;  // the faulting read is retried and now sees zeros
    }
    break;
  }
  // Not ours (or no memory for the zero page): the default action, as without the guard.
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  sigaction(signo, &dfl, nullptr);
}

void InstallHandler() {
  g_page_size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  struct sigaction sa = {};
  sa.sa_sigaction = OnSigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace

absl::StatusOr<int> RegisterMappedRegion(const void* begin, size_t size) {
  std::call_once(g_install_once, InstallHandler);
  std::lock_guard<std::mutex> lock(g_register_mu);
  for (int slot = 0; slot < kMaxGuardedRegions; ++slot) {
    if (g_in_use[slot]) continue;
    g_in_use[slot] = true;
    Region& r = g_regions[slot];
    r.faulted.store(false, std::memory_order_relaxed);
    r.begin.store(reinterpret_cast<uintptr_t>(begin), std::memory_order_relaxed);
    r.end.store(reinterpret_cast<uintptr_t>(begin) + size, std::memory_order_release);
    return slot;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("more than ", kMaxGuardedRegions, " files are mapped at once"));
}

void UnregisterMappedRegion(int slot) {
  std::lock_guard<std::mutex> lock(g_register_mu);
  g_regions[slot].end.store(0, std::memory_order_release);
  g_regions[slot].begin.store(0, std::memory_order_relaxed);
  g_in_use[slot] = false;
}

bool MappedRegionFaulted(int slot) {
  return g_regions[slot].faulted.load(std::memory_order_acquire);
}

}  // namespace quantd::checkpoint
