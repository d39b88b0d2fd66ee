#include "server/scheduler/planning_pool.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/excerpt.h"
#include "server/base/thread_budget.h"
#include "server/job/job_spec.h"
#include "server/pipeline/stage.h"

namespace quantd::scheduler {

struct PlanningPool::State {
  std::mutex mu;                                // guards the members below
  std::condition_variable idle;                 // signalled when a thread ends
  std::deque<std::function<void()>> queue;      // works not started yet
  int threads = 1;                              // at most this many run at once
  int running = 0;                              // threads running works
  bool closed = false;
};

void PlanningPool::Serve(std::shared_ptr<State> s) {
  while (true) {
    std::function<void()> work;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->closed || s->queue.empty()) {
        --s->running;
        s->idle.notify_all();
        return;
      }
      work = std::move(s->queue.front());
      s->queue.pop_front();
    }
    work();
  }
}

PlanningPool::PlanningPool(int threads) : state_(std::make_shared<State>()) {
  state_->threads = threads < 1 ? 1 : threads;
}

PlanningPool::~PlanningPool() {
  if (!closed_) Close(std::chrono::steady_clock::now());
}

void PlanningPool::Run(std::function<void()> work) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->closed) return;
  state_->queue.push_back(std::move(work));
  if (state_->running >= state_->threads) return;
  ++state_->running;
  std::thread(&PlanningPool::Serve, state_).detach();
}

bool PlanningPool::Deliver(const std::function<void()>& deliver) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->closed) return false;
  deliver();
  return true;
}

int PlanningPool::Close(std::chrono::steady_clock::time_point until) {
  closed_ = true;
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->closed = true;
  state_->queue.clear();
  state_->idle.wait_until(lock, until, [&] { return state_->running == 0; });
  return state_->running;
}

absl::StatusOr<std::unique_ptr<LoadedJob>> LoadWithinBudget(JobPlanner& planner,
                                                            const job::JobSpec& spec,
                                                            pipeline::StoredJob stored,
                                                            const PlanningBudget& budget,
                                                            const std::atomic<bool>* cancelled,
                                                            PlanningFigures* figures) {
  const auto start = std::chrono::steady_clock::now();
  base::ThreadBudgetLimits limits;
  limits.memory_bytes = budget.memory_bytes;
  if (budget.deadline_ms > 0) {
    limits.deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(budget.deadline_ms);
  }
  limits.cancelled = cancelled;
  absl::StatusOr<std::unique_ptr<LoadedJob>> loaded = absl::UnknownError("not loaded");
  std::exception_ptr error;
  base::ScopedThreadBudget scope(limits);
  try {
    loaded = planner.Load(spec, std::move(stored));
  } catch (...) {
    error = std::current_exception();  // examined once the budget no longer holds
  }
  const base::ThreadBudgetResult ended = scope.End();
  figures->seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  figures->peak_bytes = ended.peak_bytes;
  // An error the budget caused, caught and returned by the planner, is the budget's too.
  if (!error && (loaded.ok() || ended.tripped == base::BudgetLimit::kNone)) return loaded;
  // The budget ended: what follows may allocate freely.
  const base::BudgetStop stop = base::ExamineBudgetStop(error, ended);
  std::string input = ended.failed_input;
  if (input.empty()) input = absl::StrCat("the source ", spec.source, " or the job's inputs");
  const std::string what = error ? stop.what : base::Excerpt(loaded.status().message());
  switch (stop.tripped) {
    case base::BudgetLimit::kMemory:
      return pipeline::WithJobReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "planning ran out of memory reading ", input, " (a job's planning may hold ",
              budget.memory_bytes, " bytes: --planning-memory-bytes)")),
          "PLANNING_LIMIT");
    case base::BudgetLimit::kDeadline:
      return pipeline::WithJobReason(
          absl::DeadlineExceededError(absl::StrCat(
              "planning took longer than ", budget.deadline_ms / 1000.0, " s reading ", input,
              " (--planning-deadline-seconds)")),
          "PLANNING_LIMIT");
    case base::BudgetLimit::kCancelled:
      return absl::CancelledError(absl::StrCat("planning stopped reading ", input));
    case base::BudgetLimit::kNone:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("planning failed reading ", input, ": ", what));
}

}  // namespace quantd::scheduler
