// Scheduler: the engine that runs conversion jobs, for the daemon (`quantd serve`, many jobs, many
// clients) and for `quantd run` (one job). One scheduler thread owns the JobStore; every store
// access, every state change and every task hand-out happens there, so SQLite sees one writer.
//
// Devices and workers: one worker thread per device ("cpu", "cuda:N"), each with its own kernel
// Backend. A job holds the devices its spec asks for (empty: every device) from the moment it
// starts until it stops; jobs whose device sets are disjoint run side by side, the others wait in
// PENDING, oldest first. The number of PENDING jobs is capped (queue_limit).
//
// Tasks are leased from the store with an expiry and renewed while they run (JobStore), so a task
// that a crashed process held is handed out again, and a completion from a lost lease is refused.
// A task's error decides what happens (stage.h): transient codes (Unavailable, ResourceExhausted)
// are retried with back-off (pipeline::RetryDelayMs), anything else fails the job with the task's
// message; finished shards stay.
//
// Cancelling is cooperative: the job's cancel flag is set, its running tasks stop between tensors
// and are requeued, then the job becomes CANCELLED or PAUSED. Shutdown does the same for every
// running job but leaves it RUNNING, so that the next start resumes it by itself; a process that
// dies without Shutdown leaves its leases behind, which the next start requeues.
//
// Test hook: QUANTD_TEST_KILL_AT (documented in pipeline/runner.h) works here too.
#ifndef QUANTD_SERVER_SCHEDULER_SCHEDULER_H_
#define QUANTD_SERVER_SCHEDULER_SCHEDULER_H_

#include <stdint.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "quantd/v1/quantd.pb.h"
#include "server/metrics/metrics.h"
#include "server/pipeline/job_spec.h"
#include "server/scheduler/job_board.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {

struct SchedulerOptions {
  // One worker per entry: "cpu" or "cuda:N". The same name may repeat (two CPU workers).
  std::vector<std::string> devices = {"cpu"};
  int cpu_threads = 0;      // threads per CPU kernel call; 0 = all cores
  int queue_limit = 64;     // PENDING jobs at most; SubmitJob beyond it is ResourceExhausted
  int64_t host_memory_bytes = 0;  // a job whose spec asks for more is refused; 0 = no limit
  // quantd run: its --device choice replaces the spec's devices, so every job uses every worker.
  bool ignore_spec_devices = false;
  // Added to the nice value of each worker thread (Linux keeps it per thread, and the kernel
  // threads a worker starts inherit it), so that a host whose cores the kernels saturate still
  // answers RPCs promptly. 0 leaves the priority alone.
  int worker_nice = 0;
  int64_t lease_ms = 60'000;        // a task lease; renewed every lease_ms / 3 while it runs
  metrics::Metrics* metrics = nullptr;  // not owned; nullptr = no metrics
  // Receives one line per state change, task retry or failure (job id, event kind, message);
  // called on the scheduler thread. nullptr = silent.
  std::function<void(int64_t job_id, const std::string& kind, const std::string& message)> log;
};

class Scheduler {
 public:
  // Takes the store, requeues the leases a dead process left behind, resumes the jobs that were
  // RUNNING, loads every job onto the board and starts the scheduler and worker threads.
  static absl::StatusOr<std::unique_ptr<Scheduler>> Start(std::unique_ptr<store::JobStore> store,
                                                          SchedulerOptions options);
  // Shutdown(0) unless it already ran.
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Creates a PENDING job (the spec was validated by the caller). Idempotent on request_id: the
  // same id and spec return the original job with *created = false; the same id with another spec
  // is AlreadyExists. ResourceExhausted when queue_limit jobs are PENDING; Unavailable after
  // Shutdown began.
  absl::StatusOr<v1::Job> Submit(const std::string& request_id, const pipeline::JobSpec& spec,
                                 bool* created);
  // CANCELLED (pause = false) or PAUSED (pause = true); a running job gets there once its tasks
  // stopped and reads RUNNING with reason "cancelling"/"pausing" until then. The transitions are
  // those of quantd.proto; others are FailedPrecondition, an unknown id NotFound.
  // `reason` is recorded with the final state (default "cancelled" / "paused").
  absl::StatusOr<v1::Job> Cancel(int64_t job_id, bool pause, const std::string& reason = "");
  // PAUSED or FAILED -> PENDING; failed tasks are retried.
  absl::StatusOr<v1::Job> Resume(int64_t job_id);
  // Forgets a job that is not RUNNING (its output files stay).
  absl::Status Delete(int64_t job_id);
  // Per-tensor statistics (worst SQNR first, at most `worst` of them, 0 = all) and the verify
  // checks.
  absl::StatusOr<v1::JobReport> Report(int64_t job_id, int worst);

  // Snapshots for readers; never waits on the store.
  const JobBoard& board() const { return board_; }
  JobBoard& board() { return board_; }

  // Stops taking new work, asks running tasks to stop, waits for them at most `grace` (tasks
  // stop between tensors), requeues their tasks and stops the threads. Jobs stay RUNNING in the
  // store and resume on the next Start. Returns when every thread has stopped.
  void Shutdown(std::chrono::milliseconds grace);

  // Blocks until the job is in a terminal state or PAUSED, the scheduler stopped, or `poll`
  // returns false (it is called about every 100 ms and after each change, with the latest
  // snapshot); returns the last snapshot, or the error that stopped the scheduler (the store
  // failed). quantd run follows its one job this way.
  absl::StatusOr<v1::Job> WaitUntilStopped(int64_t job_id,
                                           const std::function<bool(const v1::Job&)>& poll);

 private:
  class Impl;
  explicit Scheduler(std::unique_ptr<Impl> impl);

  JobBoard board_;                // snapshots for readers
  std::unique_ptr<Impl> impl_;    // the scheduler thread, workers, store
};

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_SCHEDULER_H_
