#include "server/scheduler/clock.h"

#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <memory>
#include <utility>

namespace quantd::scheduler {
namespace {

class RealClock final : public Clock {
 public:
  int64_t NowMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  void CallAt(boost::asio::io_context& io, int64_t at_ms, std::function<void()> fn) override {
    // The timer lives in its own handler until it fires or the io_context drops it.
    auto timer = std::make_shared<boost::asio::steady_timer>(
        io, std::chrono::milliseconds(std::max<int64_t>(0, at_ms - NowMs())));
    timer->async_wait([timer, fn = std::move(fn)](const boost::system::error_code& ec) {
      if (!ec) fn();
    });
  }
};

}  // namespace

Clock& SystemClock() {
  static RealClock* clock = new RealClock();
  return *clock;
}

}  // namespace quantd::scheduler
