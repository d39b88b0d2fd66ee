#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <system_error>

namespace quantd::kernels::cpu {
namespace {

int64_t RangeBegin(int64_t n, int ranges, int w) { return n * w / ranges; }

}  // namespace

ThreadPool::ThreadPool(int threads) {
  workers_.reserve(static_cast<size_t>(std::max(threads - 1, 0)));
  for (int w = 1; w < threads; ++w) {
    // std::thread reports a thread the system cannot start only by throwing; the pool then has
    // the workers started so far.
    try {
      workers_.emplace_back(&ThreadPool::WorkerLoop, this, w);
    } catch (const std::system_error&) {
      break;
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    start_.SignalAll();
  }
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::WorkerLoop(int worker) {
  uint64_t seen = 0;
  absl::MutexLock lock(&mu_);
  while (true) {
    while (!stop_ && generation_ == seen) start_.Wait(&mu_);
    if (stop_) return;
    seen = generation_;
    if (worker >= ranges_) continue;
    const RangeFn* fn = fn_;
    const int64_t n = n_;
    const int ranges = ranges_;
    mu_.Unlock();
    (*fn)(worker, RangeBegin(n, ranges, worker), RangeBegin(n, ranges, worker + 1));
    mu_.Lock();
    if (--pending_ == 0) done_.Signal();
  }
}

void ThreadPool::Run(int workers, int64_t n, const RangeFn& fn) {
  if (n <= 0) return;
  const int ranges = static_cast<int>(std::clamp<int64_t>(std::min(workers, size()), 1, n));
  if (ranges == 1) {
    fn(0, 0, n);
    return;
  }
  absl::MutexLock run_lock(&run_mu_);
  {
    absl::MutexLock lock(&mu_);
    fn_ = &fn;
    n_ = n;
    ranges_ = ranges;
    pending_ = ranges - 1;
    ++generation_;
    start_.SignalAll();
  }
  fn(0, 0, RangeBegin(n, ranges, 1));
  absl::MutexLock lock(&mu_);
  while (pending_ > 0) done_.Wait(&mu_);
  fn_ = nullptr;
}

}  // namespace quantd::kernels::cpu
