// RunJob: `quantd run`, one job spec run to completion against a SQLite state file by the same
// Scheduler the daemon uses, so that a killed run continues where it stopped when the same
// command runs again.
//
// The state file holds one job, identified by request_id "run:" + SHA-256 of the spec's canonical
// JSON. A state file that holds a job of another spec is refused, and so is one that another
// process is running (flock on `<state>.lock`). On every start the tasks a dead process held are
// requeued (their .tmp output is rewritten from scratch) and FAILED tasks are reset (re-running
// after the input was fixed); done tasks are never redone. A SUCCEEDED job is left alone.
// Planning, task errors, retries and the final sweep of *.tmp files are the scheduler's
// (scheduler.h, pipeline/prepared_job.h). When `cancel` becomes true the job is paused: running
// tasks stop between tensors, are requeued, and the job is PAUSED with reason "interrupted".
//
// Test hook (integration tests of resumability, in quantd run and quantd serve alike):
//   QUANTD_TEST_KILL_AT="<stage>:<n>[:start|:mid|:written|:done]"
// makes the scheduler send SIGKILL to its own process at the n-th task (counted from 1 over the
// tasks of <stage> this process starts): `start` (default) right after the task was leased, before
// any output is written; `mid` once the task has reported half of its bytes through add_progress
// (its .tmp file is half written); `written` when the task returned its output (renamed into
// place) but before its completion was recorded; `done` right after the completion was recorded
// (between tasks). "planning:<n>" instead kills it once the n-th job planning it begins is
// recorded, before the planning runs. Unset in normal use; a malformed value is an error.
#ifndef QUANTD_SERVER_SCHEDULER_RUN_JOB_H_
#define QUANTD_SERVER_SCHEDULER_RUN_JOB_H_

#include <atomic>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/job/job_spec.h"

namespace quantd::scheduler {

struct RunOptions {
  std::string state_path;  // SQLite state file, created when absent
  job::JobSpec spec;       // the job to run
  int workers = 2;         // tasks in flight at once (>= 1)
  // Where kernels run: "cpu", "cuda:N" or "auto" (CUDA device 0 when there is one, else the CPU);
  // worker i uses devices[i % size]. Empty: the spec's devices (empty there too: "auto").
  std::vector<std::string> devices;
  int cpu_threads = 0;                        // threads per CPU kernel call; 0 = all cores
  std::ostream* progress = nullptr;           // progress and log lines; nullptr = silent
  bool progress_tty = false;                  // redraw one progress line in place
  const std::atomic<bool>* cancel = nullptr;  // becomes true to pause (SIGINT/SIGTERM)
};

// "run:" + hex SHA-256 of JobSpecToJson(spec).
std::string RunRequestId(const job::JobSpec& spec);

// Runs the job to the end. OK: the job SUCCEEDED (now or in an earlier run). Cancelled: `cancel`
// was set and the job is PAUSED. FailedPrecondition: the job FAILED (the message is the job's
// error, naming the shard and tensor) or the state file cannot be used. Other errors: the store.
absl::Status RunJob(const RunOptions& options);

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_RUN_JOB_H_
