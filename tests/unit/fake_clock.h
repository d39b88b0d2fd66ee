// FakeClock: a scheduler::Clock whose time moves only when a test calls Advance, so scheduler tests
// exercise leases, back-off and grace periods with no sleeps.
#ifndef QUANTD_TESTS_UNIT_FAKE_CLOCK_H_
#define QUANTD_TESTS_UNIT_FAKE_CLOCK_H_

#include <stdint.h>

#include <atomic>
#include <functional>
#include <map>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "server/scheduler/clock.h"

namespace quantd::testing_util {

class FakeClock final : public scheduler::Clock {
 public:
  explicit FakeClock(int64_t start_ms = 1'700'000'000'000) : now_ms_(start_ms) {}

  int64_t NowMs() const override { return now_ms_.load(); }

  void CallAt(boost::asio::io_context& /*io*/, int64_t at_ms, std::function<void()> fn) override {
    absl::MutexLock lock(&mu_);
    timers_.emplace(at_ms, std::move(fn));
  }

  // Moves time forward by `ms` and calls, in time order on this thread, every callback that came
  // due. A scheduler's callbacks only post to its strand, so their work runs there a little later,
  // at the time the clock shows then.
  void Advance(int64_t ms) {
    const int64_t target = now_ms_.load() + ms;
    while (true) {
      std::function<void()> fn;
      {
        absl::MutexLock lock(&mu_);
        auto it = timers_.begin();
        if (it == timers_.end() || it->first > target) break;
        if (it->first > now_ms_.load()) now_ms_.store(it->first);
        fn = std::move(it->second);
        timers_.erase(it);
      }
      fn();
    }
    now_ms_.store(target);
  }

 private:
  std::atomic<int64_t> now_ms_;  // the fake time, Unix ms
  absl::Mutex mu_;               // guards timers_
  std::multimap<int64_t, std::function<void()>> timers_ ABSL_GUARDED_BY(mu_);  // due ms -> fn
};

}  // namespace quantd::testing_util

#endif  // QUANTD_TESTS_UNIT_FAKE_CLOCK_H_
