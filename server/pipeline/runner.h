// The job runner behind `quantd run`: runs one job spec to completion against a SQLite state file,
// so that a killed run continues where it stopped when the same command runs again.
//
// The state file holds one job, identified by request_id "run:" + SHA-256 of the spec's canonical
// JSON. A state file that holds a job of another spec is refused, and so is one that another
// process is running (flock on `<state>.lock`). On every start the runner requeues the tasks a
// dead process held (their .tmp output is rewritten from scratch) and resets FAILED tasks
// (re-running after the input was fixed); done tasks are never redone. A SUCCEEDED job is left
// alone.
//
// The first start plans the job: it opens the source, builds the inventory and plan, checks free
// disk space, loads calibration.amax_file into the amax table (the file is read only then) and
// stores the plan. Later starts rebuild the plan from the source and refuse to continue when it
// differs (the source changed).
//
// Threads: the calling thread owns the JobStore; it leases tasks in plan order (the tasks of one
// stage run concurrently, stages in order), hands them to `workers` worker threads (one Backend
// each) and records what comes back: CompleteTask (+ tensor stats of verify), or FailTask.
// Errors (stage.h): InvalidArgument, DataLoss and other codes fail the job with the task's message
// and leave finished shards in place; Unavailable and ResourceExhausted are retried with back-off
// (RetryDelayMs) up to kMaxAttempts attempts. When `cancel` becomes true the runner stops leasing,
// waits for running tasks (which stop between tensors), requeues them and pauses the job.
// A job that finishes has its output directories swept of *.tmp files and is SUCCEEDED.
//
// Test hook (integration tests of resumability): the environment variable
//   QUANTD_TEST_KILL_AT="<stage>:<n>[:start|:mid|:written|:done]"
// makes the runner send SIGKILL to its own process at the n-th task (counted from 1 over the tasks
// of <stage> this process starts): `start` (default) right after the task was leased, before any
// output is written; `mid` once the task has reported half of its bytes through add_progress
// (its .tmp file is half written); `written` when the task returned its output (renamed into
// place) but before its completion was recorded; `done` right after the completion was recorded
// (between tasks). Unset in normal use; a malformed value is an error.
#ifndef QUANTD_SERVER_PIPELINE_RUNNER_H_
#define QUANTD_SERVER_PIPELINE_RUNNER_H_

#include <stdint.h>

#include <atomic>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/pipeline/job_spec.h"
#include "server/pipeline/plan.h"
#include "server/store/job_store.h"

namespace quantd::pipeline {

inline constexpr int kMaxAttempts = 3;

struct RunOptions {
  std::string state_path;  // SQLite state file, created when absent
  JobSpec spec;            // the job to run
  int workers = 2;         // tasks in flight at once (>= 1)
  // Where kernels run: "cpu", "cuda:N" or "auto" (CUDA device 0 when there is one, else the CPU);
  // worker i uses devices[i % size]. Empty: the spec's devices (empty there too: "auto").
  std::vector<std::string> devices;
  int cpu_threads = 0;                        // threads per CPU kernel call; 0 = all cores
  std::ostream* progress = nullptr;           // progress and log lines; nullptr = silent
  bool progress_tty = false;                  // redraw one progress line in place
  const std::atomic<bool>* cancel = nullptr;  // becomes true to pause (SIGINT/SIGTERM)
};

// After a task's attempt `attempt` (from 1) failed with `code`: the back-off before the next
// attempt, or nullopt when the error is permanent (the job fails). Unavailable, ResourceExhausted
// and Cancelled (without a cancel request) are transient: 2 s, then 4 s, then permanent.
std::optional<int64_t> RetryDelayMs(absl::StatusCode code, int attempt);

// "run:" + hex SHA-256 of JobSpecToJson(spec).
std::string RunRequestId(const JobSpec& spec);

// Runs the job to the end. OK: the job SUCCEEDED (now or in an earlier run). Cancelled: `cancel`
// was set and the job is PAUSED. Any other error: the job could not start (bad state file, bad
// amax file, ...) or it FAILED; the message says why, naming the shard and tensor.
absl::Status RunJob(const RunOptions& options);

// Reads calibration.amax_file: a JSON object {module: input_amax}. Every value must be a finite
// float32 >= 0 and every module a linear module of `inventory`. Errors name the file and module.
absl::StatusOr<std::vector<store::AmaxRow>> LoadAmaxFile(const std::string& path,
                                                         const TensorInventory& inventory);

// OK when `plan` has exactly the stages and tasks (names, payloads, bytes) stored for the job;
// otherwise names the first difference (the source changed since the job was planned).
absl::Status CheckPlanUnchanged(const Plan& plan, const std::vector<store::TaskRow>& stored);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_RUNNER_H_
