// ThreadBudget: bounds the work one thread does for an input it does not trust (planning a job:
// reading a hostile config.json, tokenizer or data set), whatever code that work runs through.
//
// While a ScopedThreadBudget is in force on a thread, this process's operator new (defined in
// thread_budget.cc, so every C++ allocation of the thread passes through it) counts the bytes the
// thread holds (allocated minus freed, by malloc_usable_size), and throws ThreadBudgetExceeded,
// a std::bad_alloc, at every allocation that would hold more than `memory_bytes`: to the code it
// is running out of memory, which every allocation may do. It never throws while an exception
// unwinds the stack (a destructor that allocates then cannot terminate the process). Once
// tripped (by memory, deadline or cancel) the budget stays tripped until the scope ends.
// Its deadline and `*cancelled` are not delivered by operator new (an allocation in a destructor
// would then end the process): the work polls them where stopping is safe, by ThreadBudgetCheck
// (throws) or ThreadBudgetPoll (returns what tripped). Other threads are not counted: work the
// thread hands to another thread escapes the budget.
//
// ScopedInput names the input a thread is reading (a file path) while it is in force, so that
// whatever exception ends the work (the budget's, a parser's) can be reported with the file: the
// innermost input that an exception unwound is kept (failed_input) until the budget's scope ends.
#ifndef QUANTD_SERVER_BASE_THREAD_BUDGET_H_
#define QUANTD_SERVER_BASE_THREAD_BUDGET_H_

#include <stdint.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <new>
#include <string>
#include <string_view>

namespace quantd::base {

struct ThreadBudgetLimits {
  int64_t memory_bytes = 0;  // bytes held at most; 0 = no limit
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  const std::atomic<bool>* cancelled = nullptr;  // not owned; nullptr = never
};

// What tripped a budget.
enum class BudgetLimit { kNone, kMemory, kDeadline, kCancelled };

class ThreadBudgetExceeded : public std::bad_alloc {
 public:
  explicit ThreadBudgetExceeded(BudgetLimit limit) : limit_(limit) {}
  BudgetLimit limit() const { return limit_; }
  const char* what() const noexcept override;

 private:
  BudgetLimit limit_;
};

// How a budget went (ScopedThreadBudget::End).
struct ThreadBudgetResult {
  BudgetLimit tripped = BudgetLimit::kNone;  // what tripped it; kNone if it held
  int64_t peak_bytes = 0;                    // the most bytes the thread held at once
  // The innermost ScopedInput an exception unwound on the thread while it was in force; "" if
  // none.
  std::string failed_input;
};

class ScopedThreadBudget {
 public:
  // At most one scope per thread at a time.
  explicit ScopedThreadBudget(const ThreadBudgetLimits& limits);
  ~ScopedThreadBudget();  // End() unless it ran
  ScopedThreadBudget(const ScopedThreadBudget&) = delete;
  ScopedThreadBudget& operator=(const ScopedThreadBudget&) = delete;

  // Ends the budget first (operator new neither counts nor throws on this thread any more), then
  // says how it went. Once.
  ThreadBudgetResult End();

 private:
  bool ended_ = false;
};

// While in force (on a thread with a ScopedThreadBudget), `input` is what the thread reads.
// `input` must outlive it. Nests.
class ScopedInput {
 public:
  explicit ScopedInput(std::string_view input);
  ~ScopedInput();
  ScopedInput(const ScopedInput&) = delete;
  ScopedInput& operator=(const ScopedInput&) = delete;

 private:
  std::string_view input_;  // the caller's
  int uncaught_;            // std::uncaught_exceptions() when it began
};

// How work run under a budget stopped, examined once the budget's scope ended (the examination
// allocates): `tripped` is the limit that stopped it (`ended.tripped`, or the limit of a
// ThreadBudgetExceeded that `error` holds; a plain std::bad_alloc counts as kMemory), kNone when
// none did; `what` is an excerpt of the message of any other exception `error` holds ("" for a
// null `error`).
struct BudgetStop {
  BudgetLimit tripped = BudgetLimit::kNone;
  std::string what;
};
BudgetStop ExamineBudgetStop(const std::exception_ptr& error, const ThreadBudgetResult& ended);

// What stops the work of this thread: the budget in force on it tripped, its deadline passed or it
// was cancelled (which trips it); kNone when it holds or without one.
BudgetLimit ThreadBudgetPoll();
// Throws ThreadBudgetExceeded when ThreadBudgetPoll() is not kNone (and no exception unwinds).
void ThreadBudgetCheck();

}  // namespace quantd::base

#endif  // QUANTD_SERVER_BASE_THREAD_BUDGET_H_
