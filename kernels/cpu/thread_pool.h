// A fixed set of host threads, started once and reused, that run the ranges of parallel loops:
// ParallelFor's contract (parallel_for.h) without starting and joining threads on every call.
#ifndef QUANTD_KERNELS_CPU_THREAD_POOL_H_
#define QUANTD_KERNELS_CPU_THREAD_POOL_H_

#include <stdint.h>

#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace quantd::kernels::cpu {

class ThreadPool {
 public:
  using RangeFn = std::function<void(int worker, int64_t begin, int64_t end)>;

  // A pool of `threads` (>= 1) threads: the caller of Run and threads - 1 workers started here.
  // A worker the system cannot start is left out, so size() may be smaller.
  explicit ThreadPool(int threads);
  ~ThreadPool();  // stops and joins the workers; no Run may be in progress
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads a Run can use, the caller's included (>= 1).
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Splits [0, n) into k = min(workers, size(), n) (at least 1) contiguous ranges of nearly
  // equal size (range w is [n * w / k, n * (w + 1) / k)) and runs fn(w, begin, end) for each:
  // range 0 on the calling thread, range w on worker w. Returns when every range is done. Calls
  // from several threads run one after another.
  void Run(int workers, int64_t n, const RangeFn& fn) ABSL_LOCKS_EXCLUDED(run_mu_, mu_);

 private:
  void WorkerLoop(int worker) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex run_mu_;  // held by the one Run in progress
  absl::Mutex mu_;      // guards the current loop below
  absl::CondVar start_;  // signalled when generation_ advances or stop_ is set
  absl::CondVar done_;   // signalled when pending_ drops to 0
  const RangeFn* fn_ ABSL_GUARDED_BY(mu_) = nullptr;  // the current loop's body
  int64_t n_ ABSL_GUARDED_BY(mu_) = 0;                // the current loop's range [0, n_)
  int ranges_ ABSL_GUARDED_BY(mu_) = 0;               // the current loop's range count k
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;      // loops started so far
  int pending_ ABSL_GUARDED_BY(mu_) = 0;              // worker ranges of the loop not yet done
  bool stop_ ABSL_GUARDED_BY(mu_) = false;            // set by the destructor
  std::vector<std::thread> workers_;  // worker w + 1 at index w; fixed after the constructor
};

}  // namespace quantd::kernels::cpu

#endif  // QUANTD_KERNELS_CPU_THREAD_POOL_H_
