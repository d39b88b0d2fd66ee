// BlockingQueue: a thread-safe FIFO from the scheduler's strand to one worker thread.
#ifndef QUANTD_SERVER_SCHEDULER_BLOCKING_QUEUE_H_
#define QUANTD_SERVER_SCHEDULER_BLOCKING_QUEUE_H_

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>

namespace quantd::scheduler {

template <typename T>
class BlockingQueue {
 public:
  // Adds an item; false (and the item is dropped) once the queue is closed.
  bool Push(T item) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return false;
      items_.push_back(std::move(item));
    }
    cv_.notify_one();
    return true;
  }
  // Waits for an item; nullopt once the queue is closed and empty.
  std::optional<T> Pop() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return closed_ || !items_.empty(); });
    return TakeLocked();
  }
  // Refuses further items; waiting items can still be popped.
  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::optional<T> TakeLocked() {
    if (items_.empty()) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }

  std::mutex mu_;               // guards items_ and closed_
  std::condition_variable cv_;  // signalled on Push and Close
  std::deque<T> items_;         // waiting items, oldest first
  bool closed_ = false;         // no more items are accepted
};

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_BLOCKING_QUEUE_H_
