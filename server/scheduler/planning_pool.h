// PlanningPool: where the scheduler runs jobs' source phases (JobPlanner::Load), several at once,
// each under its job's budget (LoadWithinBudget), so that no job's input can take the daemon
// down or hold it:
//   - at most `threads` source phases run at once, each on a thread of its own; a job waiting
//     for a thread waits for any of them, not for one that a hostile input wedges;
//   - the threads hold only the pool's shared state, never the scheduler: Close waits for the
//     running phases at most until its deadline, abandons the rest (their threads are detached,
//     their results dropped) and returns how many it abandoned, so a shutdown never waits on
//     planning past its grace period.
#ifndef QUANTD_SERVER_SCHEDULER_PLANNING_POOL_H_
#define QUANTD_SERVER_SCHEDULER_PLANNING_POOL_H_

#include <stdint.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/job/job_spec.h"
#include "server/pipeline/stored_job.h"
#include "server/scheduler/job_planner.h"

namespace quantd::scheduler {

// What one job's source phase may take (SchedulerOptions::planning).
struct PlanningBudget {
  int threads = 2;                            // source phases at once
  int64_t memory_bytes = int64_t{8} << 30;    // bytes one phase may hold; 0 = no limit
  int64_t deadline_ms = 2 * 3600 * 1000;      // how long one phase may run; 0 = no limit
};

// What one source phase took.
struct PlanningFigures {
  double seconds = 0;      // wall time
  int64_t peak_bytes = 0;  // the most bytes its thread held at once
};

// planner.Load(spec, stored) on this thread under `budget` and `cancelled`
// (base/thread_budget.h). Every exception it throws becomes an error naming the input it was
// reading: ResourceExhausted when it ran out of memory or past the budget's bytes,
// DeadlineExceeded past its time, Cancelled once `cancelled` was set, InvalidArgument for any
// other exception (a parser's), with reason PLANNING_LIMIT for the first two. `figures` receives
// what it took.
absl::StatusOr<std::unique_ptr<LoadedJob>> LoadWithinBudget(JobPlanner& planner,
                                                            const job::JobSpec& spec,
                                                            pipeline::StoredJob stored,
                                                            const PlanningBudget& budget,
                                                            const std::atomic<bool>* cancelled,
                                                            PlanningFigures* figures);

class PlanningPool {
 public:
  explicit PlanningPool(int threads);
  ~PlanningPool();  // Close(now) unless it ran
  PlanningPool(const PlanningPool&) = delete;
  PlanningPool& operator=(const PlanningPool&) = delete;

  // Queues `work`, which runs on a pool thread once fewer than `threads` works run. `work` must
  // not touch its caller's state except through Deliver. Dropped after Close.
  void Run(std::function<void()> work);
  // Runs `deliver` (on the calling pool thread, under the pool's lock) unless the pool closed:
  // how a work hands its result back without touching a scheduler that ended. Returns whether
  // it ran.
  bool Deliver(const std::function<void()>& deliver);
  // No work starts and nothing is delivered from now on; waits until the running works returned
  // or `until` passed. Returns how many still run (abandoned: they finish on their own threads).
  int Close(std::chrono::steady_clock::time_point until);

 private:
  struct State;
  // A pool thread: runs queued works until none is left or the pool closed.
  static void Serve(std::shared_ptr<State> state);

  std::shared_ptr<State> state_;  // shared with the pool threads
  bool closed_ = false;
};

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_PLANNING_POOL_H_
