#include "server/base/thread_budget.h"

#include <malloc.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <exception>
#include <new>

#include "server/base/excerpt.h"

namespace quantd::base {
namespace {

// The budget in force on a thread. Only its thread touches it (cancelled is an atomic).
struct ThreadState {
  ThreadBudgetLimits limits;
  int64_t held = 0;       // bytes allocated minus bytes freed since the scope began
  int64_t peak = 0;       // the most of `held`
  BudgetLimit tripped = BudgetLimit::kNone;
  // The innermost input an exception unwound; a fixed buffer, so that keeping it while an
  // exception unwinds never allocates.
  char failed_input[512] = {};
};

thread_local ThreadState* state = nullptr;

// Whether the budget is tripped, its deadline passed or it was cancelled; sets s.tripped.
bool Interrupted(ThreadState& s) {
  if (s.tripped != BudgetLimit::kNone) return true;
  if (s.limits.cancelled != nullptr && s.limits.cancelled->load(std::memory_order_relaxed)) {
    s.tripped = BudgetLimit::kCancelled;
    return true;
  }
  if (std::chrono::steady_clock::now() >= s.limits.deadline) {
    s.tripped = BudgetLimit::kDeadline;
    return true;
  }
  return false;
}

void* Allocate(size_t size) {
  void* p = malloc(size == 0 ? 1 : size);
  ThreadState* s = state;
  if (s == nullptr) {
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  if (p == nullptr) {
    if (s->tripped == BudgetLimit::kNone) s->tripped = BudgetLimit::kMemory;
    throw std::bad_alloc();
  }
  s->held += static_cast<int64_t>(malloc_usable_size(p));
  if (s->limits.memory_bytes > 0 && s->held > s->limits.memory_bytes) {
    if (s->tripped == BudgetLimit::kNone) s->tripped = BudgetLimit::kMemory;
    if (std::uncaught_exceptions() == 0) {
      s->held -= static_cast<int64_t>(malloc_usable_size(p));
      free(p);
      throw ThreadBudgetExceeded(BudgetLimit::kMemory);
    }
  }
  if (s->held > s->peak) s->peak = s->held;
  return p;
}

void Free(void* p) {
  if (p == nullptr) return;
  if (ThreadState* s = state; s != nullptr) s->held -= static_cast<int64_t>(malloc_usable_size(p));
  free(p);
}

}  // namespace

BudgetStop ExamineBudgetStop(const std::exception_ptr& error, const ThreadBudgetResult& ended) {
  BudgetStop stop;
  stop.tripped = ended.tripped;
  if (!error) return stop;
  try {
    std::rethrow_exception(error);
  } catch (const ThreadBudgetExceeded& e) {
    stop.tripped = e.limit();
  } catch (const std::bad_alloc&) {
    if (stop.tripped == BudgetLimit::kNone) stop.tripped = BudgetLimit::kMemory;
  } catch (const std::exception& e) {
    stop.what = Excerpt(e.what());
  } catch (...) {
    stop.what = "an unknown exception";
  }
  return stop;
}

const char* ThreadBudgetExceeded::what() const noexcept {
  switch (limit_) {
    case BudgetLimit::kMemory:
      return "memory budget exceeded";
    case BudgetLimit::kDeadline:
      return "deadline passed";
    case BudgetLimit::kCancelled:
      return "cancelled";
    case BudgetLimit::kNone:
      break;
  }
  return "budget exceeded";
}

ScopedThreadBudget::ScopedThreadBudget(const ThreadBudgetLimits& limits) {
  state = new ThreadState{limits};
}

ScopedThreadBudget::~ScopedThreadBudget() {
  if (!ended_) End();
}

ThreadBudgetResult ScopedThreadBudget::End() {
  ended_ = true;
  ThreadState* s = state;
  state = nullptr;  // from here on, allocations are neither counted nor refused
  ThreadBudgetResult result;
  if (s == nullptr) return result;
  result.tripped = s->tripped;
  result.peak_bytes = s->peak;
  result.failed_input = s->failed_input;
  delete s;
  return result;
}

ScopedInput::ScopedInput(std::string_view input)
    : input_(input), uncaught_(std::uncaught_exceptions()) {}

ScopedInput::~ScopedInput() {
  ThreadState* s = state;
  if (s == nullptr || std::uncaught_exceptions() <= uncaught_ || s->failed_input[0] != 0) return;
  const size_t n = std::min(input_.size(), sizeof(s->failed_input) - 1);
  memcpy(s->failed_input, input_.data(), n);
  s->failed_input[n] = 0;
}

BudgetLimit ThreadBudgetPoll() {
  ThreadState* s = state;
  if (s == nullptr || !Interrupted(*s)) return BudgetLimit::kNone;
  return s->tripped;
}

void ThreadBudgetCheck() {
  const BudgetLimit limit = ThreadBudgetPoll();
  if (limit != BudgetLimit::kNone && std::uncaught_exceptions() == 0) {
    throw ThreadBudgetExceeded(limit);
  }
}

}  // namespace quantd::base

// Every C++ allocation of the process passes here: counted against the thread's budget, if any.
// The other forms of operator new (array, nothrow) call this one; the aligned ones are not
// counted (they free with free(), not with these). Under AddressSanitizer (the fuzz targets),
// which defines the whole operator new family itself, these are left out (a fuzz build defines
// QUANTD_NO_COUNTING_OPERATOR_NEW for quantd_base, which it links uninstrumented): replacing part
// of the family makes ASan report its nothrow new freed by our delete. There the budget counts
// nothing.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QUANTD_NO_COUNTING_OPERATOR_NEW 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define QUANTD_NO_COUNTING_OPERATOR_NEW 1
#endif
#ifndef QUANTD_NO_COUNTING_OPERATOR_NEW
void* operator new(size_t size) { return quantd::base::Allocate(size); }
void operator delete(void* p) noexcept { quantd::base::Free(p); }
void operator delete(void* p, size_t) noexcept { quantd::base::Free(p); }
#endif
