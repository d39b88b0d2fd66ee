// ScopedThreadBudget through this process's operator new: bytes held (allocated minus freed)
// against the limit, cancel and deadline polled (never thrown by operator new), nothing thrown while an exception unwinds, only the
// thread in the scope counted, and ScopedInput naming the innermost input an exception unwound.
#include "server/base/thread_budget.h"

#include <gtest/gtest.h>

#include <atomic>
#include <exception>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace quantd::base {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Allocates `bytes` and keeps them until the vector dies.
std::unique_ptr<std::vector<char>> Hold(int64_t bytes) {
  return std::make_unique<std::vector<char>>(static_cast<size_t>(bytes));
}

TEST(ThreadBudgetTest, BytesHeldPastTheLimitThrowAndTheBudgetStaysTripped) {
  ThreadBudgetLimits limits;
  limits.memory_bytes = 4 * kMiB;
  ScopedThreadBudget scope(limits);
  // Allocated and freed again and again: never more than 1 MiB held.
  for (int i = 0; i < 100; ++i) Hold(kMiB);
  auto kept = Hold(3 * kMiB);
  try {
    Hold(2 * kMiB);
    FAIL() << "no exception";
  } catch (const ThreadBudgetExceeded& e) {
    EXPECT_EQ(e.limit(), BudgetLimit::kMemory);
    EXPECT_STREQ(e.what(), "memory budget exceeded");
  }
  kept.reset();
  // Below the limit again, allocations succeed; the budget stays tripped for the work's polls.
  Hold(16);
  EXPECT_EQ(ThreadBudgetPoll(), BudgetLimit::kMemory);
  EXPECT_THROW(ThreadBudgetCheck(), ThreadBudgetExceeded);
  const ThreadBudgetResult result = scope.End();
  EXPECT_EQ(result.tripped, BudgetLimit::kMemory);
  EXPECT_GE(result.peak_bytes, 3 * kMiB);
  EXPECT_LT(result.peak_bytes, 4 * kMiB + 4096);
  Hold(64 * kMiB);  // ended: no longer counted
}

TEST(ThreadBudgetTest, CancelAndDeadlineStopTheThread) {
  std::atomic<bool> cancelled{false};
  {
    ThreadBudgetLimits limits;
    limits.cancelled = &cancelled;
    ScopedThreadBudget scope(limits);
    ThreadBudgetCheck();
    EXPECT_EQ(ThreadBudgetPoll(), BudgetLimit::kNone);
    cancelled = true;
    Hold(16);  // operator new never delivers a cancel (a destructor may allocate)
    EXPECT_EQ(ThreadBudgetPoll(), BudgetLimit::kCancelled);
    EXPECT_THROW(ThreadBudgetCheck(), ThreadBudgetExceeded);
    EXPECT_EQ(scope.End().tripped, BudgetLimit::kCancelled);
  }
  ThreadBudgetLimits limits;
  limits.deadline = std::chrono::steady_clock::now();
  ScopedThreadBudget scope(limits);
  try {
    ThreadBudgetCheck();
    FAIL() << "no exception";
  } catch (const ThreadBudgetExceeded& e) {
    EXPECT_EQ(e.limit(), BudgetLimit::kDeadline);
  }
  EXPECT_EQ(scope.End().tripped, BudgetLimit::kDeadline);
}

// Allocates in its destructor, which runs while an exception unwinds.
struct AllocatesWhenDestroyed {
  ~AllocatesWhenDestroyed() { Hold(1024); }
};

TEST(ThreadBudgetTest, NothingIsThrownWhileAnExceptionUnwindsAndInputsAreNamed) {
  ThreadBudgetLimits limits;
  limits.memory_bytes = kMiB;
  ScopedThreadBudget scope(limits);
  try {
    const ScopedInput source("/m");
    {
      const ScopedInput file("/m/tokenizer.json");
      const AllocatesWhenDestroyed allocates;
      Hold(2 * kMiB);
    }
  } catch (const ThreadBudgetExceeded&) {
  }
  const ThreadBudgetResult result = scope.End();
  EXPECT_EQ(result.tripped, BudgetLimit::kMemory);
  EXPECT_EQ(result.failed_input, "/m/tokenizer.json");

  ScopedThreadBudget parser(ThreadBudgetLimits{});
  try {
    const ScopedInput file("/m/config.json");
    throw std::runtime_error("type_error");
  } catch (const std::runtime_error&) {
  }
  { const ScopedInput done("/m/other.json"); }  // ended without an exception: not named
  EXPECT_EQ(parser.End().failed_input, "/m/config.json");
}

// How a stopped work is told apart, once the budget ended (planning and the tokens task share it).
TEST(ThreadBudgetTest, ExamineBudgetStopNamesTheLimitOrTheException) {
  ThreadBudgetResult held;
  EXPECT_EQ(ExamineBudgetStop(nullptr, held).tripped, BudgetLimit::kNone);
  EXPECT_EQ(ExamineBudgetStop(nullptr, held).what, "");
  ThreadBudgetResult late;
  late.tripped = BudgetLimit::kDeadline;
  EXPECT_EQ(ExamineBudgetStop(nullptr, late).tripped, BudgetLimit::kDeadline);
  const auto thrown = [](auto e) { return std::make_exception_ptr(e); };
  EXPECT_EQ(ExamineBudgetStop(thrown(ThreadBudgetExceeded(BudgetLimit::kCancelled)), held).tripped,
            BudgetLimit::kCancelled);
  EXPECT_EQ(ExamineBudgetStop(thrown(std::bad_alloc()), held).tripped, BudgetLimit::kMemory);
  EXPECT_EQ(ExamineBudgetStop(thrown(std::bad_alloc()), late).tripped, BudgetLimit::kDeadline);
  const BudgetStop parse = ExamineBudgetStop(thrown(std::runtime_error("bad \"json\"")), held);
  EXPECT_EQ(parse.tripped, BudgetLimit::kNone);
  EXPECT_EQ(parse.what, "\"bad \\\"json\\\"\"");
  EXPECT_EQ(ExamineBudgetStop(thrown(42), held).what, "an unknown exception");
}

TEST(ThreadBudgetTest, OnlyTheThreadInTheScopeIsCounted) {
  ThreadBudgetLimits limits;
  limits.memory_bytes = kMiB;
  ScopedThreadBudget scope(limits);
  std::thread other([] { Hold(16 * kMiB); });
  other.join();
  EXPECT_EQ(scope.End().tripped, BudgetLimit::kNone);
}

}  // namespace
}  // namespace quantd::base
