// Clock: the scheduler's only source of time, so that its tests run on a fake one with no sleeps.
//
// NowMs() is Unix milliseconds (the store's timestamps, lease expiries, retry back-off). CallAt
// arranges a wake-up: the system clock arms a boost::asio::steady_timer on the scheduler's
// io_context; a fake clock (tests/unit/fake_clock.h) calls back when a test advances it. A callback
// must only post work to the scheduler's strand; it is dropped unfired when the io_context stops.
#ifndef QUANTD_SERVER_SCHEDULER_CLOCK_H_
#define QUANTD_SERVER_SCHEDULER_CLOCK_H_

#include <stdint.h>

#include <boost/asio/io_context.hpp>
#include <functional>

namespace quantd::scheduler {

class Clock {
 public:
  virtual ~Clock() = default;

  // Unix milliseconds. Thread-safe.
  virtual int64_t NowMs() const = 0;
  // Calls `fn` once NowMs() >= at_ms: on a thread running `io` (system clock) or on the thread
  // that advances a fake clock. Thread-safe.
  virtual void CallAt(boost::asio::io_context& io, int64_t at_ms, std::function<void()> fn) = 0;
};

// The real time: system_clock for NowMs, steady_timer for CallAt. One shared instance.
Clock& SystemClock();

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_CLOCK_H_
