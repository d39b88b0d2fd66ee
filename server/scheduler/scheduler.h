// Scheduler: the engine that runs conversion jobs, for the daemon (`quantd serve`, many jobs, many
// clients) and for `quantd run` (one job).
//
// Threads and owners. One boost::asio::io_context, run by one thread, executes everything on one
// strand: commands (Submit, Cancel, ...), task completions, lease renewal and expiry, retry
// back-off and progress timers. The strand owns the JobStore and every piece of job state, so
// SQLite sees one writer. Reading a job's source to plan it runs off the strand on a planning pool
// (job_planner.h), so commands never wait for it; reports are built on a reporting thread from a
// second, read-only connection to the store. Tasks run on worker threads, one per entry of
// `devices`; workers naming the same device share one compute::Device. The JobBoard is fed by the
// strand and read by the API and `quantd run`, never the other way round. The parts, by file:
//   admission.cc  commands and which waiting job starts next, planning off the strand (on a
//                 PlanningPool: several jobs at once, each under its budget, never crashing the
//                 process; a job whose planning a crash interrupted twice fails PLANNING_CRASHED)
//   job_lifecycle.cc  one round of the loop (Step, Kick) and how a job ends (MaybeFinish,
//                 SetState: leases requeued, workers released, the final state published)
//   dispatch.cc   placement of leased tasks on devices that fit, the worker threads
//   recording.cc  task results, retries with back-off, leases, store failures
//   snapshots.cc  snapshots to the board, progress publishing, metrics
//   scheduler.cc  start, shutdown and this class
//
// Devices: a job holds the workers its spec asks for (empty: every worker) from its start until
// it stops; jobs whose workers are disjoint run side by side, the others wait PENDING, oldest
// first (queue_limit caps them). A task runs only on a device that fits its requirement
// (compute::Fits): never two tasks whose memory sums past a device's capacity.
//
// Leases: a task is leased with an expiry and renewed while it runs and reports progress (its
// heartbeat); a task silent for a whole lease loses it: it is requeued for another worker and its
// late completion is ignored. The worker that ran it stays busy, its memory reserved, until the
// silent attempt returns. A task that loses its lease lease_expiry_limit times fails its job
// (reason LEASE_EXPIRED) instead of looping. A task's error decides what happens
// (pipeline/stage.h): transient codes are retried after a back-off (pipeline::RetryDelayMs),
// anything else fails the job.
//
// Store failures never stop the engine silently: a result that cannot be recorded is kept and
// recorded again with back-off; a store that fails for store_retry_limit_ms is unusable: the
// scheduler stops, serving() turns false and on_store_unusable is called.
//
// Cancelling is cooperative: running tasks stop between units of work and are requeued, then the
// job becomes CANCELLED or PAUSED. Shutdown does the same but leaves jobs RUNNING, so that the next
// start resumes them; a process that dies without Shutdown leaves leases that the next start
// requeues.
//
// Test hooks: QUANTD_TEST_KILL_AT (run_job.h) works here too, and QUANTD_TEST_PLANNING_STALL
// (planning_stall.h) stalls a job's planning.
#ifndef QUANTD_SERVER_SCHEDULER_SCHEDULER_H_
#define QUANTD_SERVER_SCHEDULER_SCHEDULER_H_

#include <stdint.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "quantd/v1/quantd.pb.h"
#include "server/compute/device.h"
#include "server/job/job_spec.h"
#include "server/metrics/metrics.h"
#include "server/pipeline/stage.h"
#include "server/scheduler/clock.h"
#include "server/scheduler/job_board.h"
#include "server/scheduler/job_planner.h"
#include "server/scheduler/planning_pool.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {

struct SchedulerOptions {
  // One worker per entry: "cpu" or "cuda:N". The same name may repeat (two CPU workers). Empty:
  // no local worker, tasks run on remote workers only (quantd serve --devices none).
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
  // A task whose lease expires this many times in this process fails its job (reason
  // LEASE_EXPIRED) instead of being requeued again.
  int lease_expiry_limit = 3;
  // A job's planning (its source phase, job_planner.h): how many jobs plan at once, and the memory
  // and time one may take (planning_pool.h). The defaults fit DeepSeek-V4-Pro: its headers,
  // inventory and plan (62 layers, ~150k tensors) and hashing its outputs on a resume.
  PlanningBudget planning;
  // Tasks one job's plan may hold (the real model's: about 1,000); a larger plan fails the job.
  int64_t max_tasks_per_job = 100'000;
  metrics::Metrics* metrics = nullptr;  // not owned; nullptr = no metrics
  // Receives one line per state change, task retry or failure (job id, event kind, message);
  // called on the scheduler thread. nullptr = silent.
  std::function<void(int64_t job_id, const std::string& kind, const std::string& message)> log;
  // A store that keeps failing this long (every write refused) is unusable: the scheduler stops
  // and calls on_store_unusable once, on the strand.
  int64_t store_retry_limit_ms = 60'000;
  std::function<void(const absl::Status& error)> on_store_unusable;

  // Seams for tests; nullptr / empty = the real thing.
  Clock* clock = nullptr;                // not owned; SystemClock()
  std::shared_ptr<JobPlanner> planner;   // NewPipelinePlanner()
  // Opens a worker's device by name; compute::OpenDevice with cpu_threads and host_memory_bytes.
  std::function<absl::StatusOr<std::unique_ptr<compute::Device>>(const std::string& name)>
      open_device;
};

// Remote workers (`quantd worker`, api/worker_service.h) lease tasks through the commands below,
// on the same strand, store and leases as the local workers: a remote lease is an attempt in the
// job's in-flight set whose heartbeat is the worker's renewal, it expires as a local one does
// (lease_ms, lease_expiry_limit), and its result is recorded by the same code. The attempt number
// is the fencing token: a renewal, completion or failure whose (worker, task, attempt) is not the
// job's current in-flight attempt is FailedPrecondition with reason LEASE_LOST, changes nothing,
// is logged ("task_late") and counted (quantd_worker_stale_calls_total). Registrations live in
// memory only: after a restart a worker's calls get NotFound (reason WORKER_UNKNOWN) and it
// registers again. Remote workers take tasks of jobs whose stages keep no state between tasks
// (JobTasks::RunsRemotely); a coordinator without local workers fails the other jobs (reason
// NO_WORKER), and also a job with a runnable task that no registered worker's device fits, once
// the newest registration is a lease old (remote_workers.cc states the rule); with no worker
// registered a job waits for one.

// A device of a remote worker, as it registered it.
struct RemoteDevice {
  std::string name;  // "cpu", "cuda:N" on the worker's host
  bool gpu = false;
  int64_t memory_bytes = 0;
};

// A task leased to a remote worker: enough to open its job from the stored spec and run it.
struct RemoteLease {
  int64_t job_id = 0;
  store::TaskRow task;  // task.attempt is the fencing token
  int64_t job_created_ms = 0;  // a job id may be given again after a delete
  // Set unless the worker said it holds the job already:
  bool job_included = false;
  std::string job_store;  // with job_id and job_created_ms: pipeline::JobIdentity
  std::string spec_json;  // the job's stored spec
  std::string work_dir;
  std::vector<store::AmaxRow> input_amax;  // kind "input"
  // The job's stored plan as it is now (DONE tasks with their outputs) when job_included;
  // otherwise only the leased task and the tasks it depends on, directly or not (what its stage
  // may read of earlier outputs).
  std::vector<store::TaskRow> tasks;
};

// What Register answers a remote worker.
struct RemoteRegistration {
  std::string worker_id;  // sent with every later call
  int64_t lease_ms = 0;   // a task silent this long loses its lease
};

// A registered remote worker, for `quantctl workers`.
struct RemoteWorkerView {
  std::string name;
  std::string peer;
  std::vector<RemoteDevice> devices;
  std::vector<std::string> tasks;  // "job 3: quantize model-00001-of-00002.safetensors"
  int64_t tasks_leased = 0;
  int64_t registered_ms = 0;
  int64_t last_seen_ms = 0;
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

  // The commands below post to the strand and return at once; `done` runs on the strand once the
  // command ran (or at once with Unavailable when the scheduler has stopped) and must not block.
  using JobDone = std::function<void(absl::StatusOr<v1::Job>)>;
  void SubmitAsync(const std::string& request_id, const job::JobSpec& spec,
                   std::function<void(absl::StatusOr<v1::Job>, bool created)> done);
  void CancelAsync(int64_t job_id, bool pause, const std::string& reason, JobDone done);
  void ResumeAsync(int64_t job_id, JobDone done);
  void DeleteAsync(int64_t job_id, store::DeletePrecondition precondition,
                   std::function<void(absl::Status)> done);
  // A report is the exception: it is built off the strand, from a read-only connection to the
  // store (a committed snapshot), and `done` runs on the reporting thread; a slow command or a
  // busy strand does not delay it, and building it does not delay them.
  void ReportAsync(int64_t job_id, int worst,
                   std::function<void(absl::StatusOr<v1::JobReport>)> done);

  // Remote workers (see above). `done` runs on the strand and must not block.
  // Registers worker `name` (replacing an earlier registration of the same name).
  void RegisterWorkerAsync(const std::string& name, const std::string& peer,
                           std::vector<RemoteDevice> devices,
                           std::function<void(absl::StatusOr<RemoteRegistration>)> done);
  // Leases a task that fits the worker's device `device`, waiting up to wait_ms for one; nullopt
  // when none came. `open_jobs`: jobs the worker holds already (their spec is not sent again).
  void LeaseRemoteAsync(const std::string& worker_id, int device, int64_t wait_ms,
                        std::set<int64_t> open_jobs,
                        std::function<void(absl::StatusOr<std::optional<RemoteLease>>)> done);
  // The task's heartbeat; answers whether the task should stop (its job is stopping).
  void RenewRemoteAsync(const std::string& worker_id, int64_t task_id, int attempt,
                        uint64_t bytes_done, std::function<void(absl::StatusOr<bool>)> done);
  // Records the attempt's result as a local worker's (recording.cc); `output` is the stage's.
  void CompleteRemoteAsync(const std::string& worker_id, int64_t task_id, int attempt,
                           absl::StatusOr<pipeline::TaskOutput> output,
                           std::function<void(absl::Status)> done);
  void ListWorkersAsync(std::function<void(std::vector<RemoteWorkerView>)> done);

  // The same commands, waiting for their answer (quantd run and tests).
  // Creates a PENDING job (the spec was validated by the caller). Idempotent on request_id: the
  // same id and spec return the original job with *created = false; the same id with another spec
  // is AlreadyExists. ResourceExhausted when queue_limit jobs are PENDING; Unavailable after
  // Shutdown began.
  absl::StatusOr<v1::Job> Submit(const std::string& request_id, const job::JobSpec& spec,
                                 bool* created);
  // CANCELLED (pause = false) or PAUSED (pause = true); a running job gets there once its tasks
  // stopped and reads RUNNING with reason "cancelling"/"pausing" until then. The transitions are
  // those of quantd.proto; others are FailedPrecondition, an unknown id NotFound.
  // `reason` is recorded with the final state (default "cancelled" / "paused").
  absl::StatusOr<v1::Job> Cancel(int64_t job_id, bool pause, const std::string& reason = "");
  // PAUSED or FAILED -> PENDING; failed tasks are retried.
  absl::StatusOr<v1::Job> Resume(int64_t job_id);
  // Forgets a job that is not RUNNING, and with DeletePrecondition::kFinished only one that is
  // SUCCEEDED, FAILED or CANCELLED when it is deleted (its output files stay).
  absl::Status Delete(int64_t job_id, store::DeletePrecondition precondition =
                                          store::DeletePrecondition::kNotRunning);
  // Per-tensor statistics (worst SQNR first, at most `worst` of them, 0 = all) and the verify
  // checks.
  absl::StatusOr<v1::JobReport> Report(int64_t job_id, int worst);

  // False once the store became unusable (health turns NOT_SERVING).
  bool serving() const;

  // Snapshots for readers; never waits on the store.
  const JobBoard& board() const { return board_; }
  JobBoard& board() { return board_; }

  // Stops taking new work, asks running tasks and plannings to stop, waits for them at most
  // `grace` (tasks stop between tensors), requeues their tasks and stops the threads. Jobs stay
  // RUNNING in the store and resume on the next Start. Returns when every thread has stopped,
  // except planning threads still running after `grace`: those are abandoned (detached; see
  // abandoned_planning()).
  void Shutdown(std::chrono::milliseconds grace);
  // Planning threads Shutdown abandoned: the process should end with _exit, as they may still
  // use what static destructors would destroy.
  int abandoned_planning() const;

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
  std::unique_ptr<Impl> impl_;    // the strand, workers, store
};

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_SCHEDULER_H_
