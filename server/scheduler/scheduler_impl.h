// Scheduler::Impl: the engine's state and its parts (scheduler.h lists which file holds which).
// Internal to server/scheduler.
//
// Ownership, checked by clang's -Wthread-safety where it can be stated:
//   - on_strand_ (StrandRole): members ABSL_GUARDED_BY(on_strand_) and functions
//     ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_) belong to the strand; every handler posted there
//     starts with on_strand_.Assert(). The structs reached only through such members (ActiveJob,
//     InFlight, WorkerSlot) are strand-only too.
//   - state_mu_: what other threads read about the loop's end (WaitUntilStopped, Post).
//   - report_mu_: the read-only store connection that reports are built from, on the reporting_
//     thread, so that a report (about 170 ms of reads at DeepSeek-V4 Pro scale) never holds the
//     strand; SQLite's WAL lets it read committed state while the strand writes.
//   - fixed after Init, read by any thread: options_, clock_, planner_, workers_ (each worker
//     thread uses only its own queue and device), owner_, kill_hook_.
//   - TaskRun: atomics shared by the strand and the worker running the task.
#ifndef QUANTD_SERVER_SCHEDULER_SCHEDULER_IMPL_H_
#define QUANTD_SERVER_SCHEDULER_SCHEDULER_IMPL_H_

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "quantd/v1/quantd.pb.h"
#include "server/compute/device.h"
#include "server/compute/requirement.h"
#include "server/scheduler/blocking_queue.h"
#include "server/scheduler/clock.h"
#include "server/scheduler/job_board.h"
#include "server/scheduler/job_planner.h"
#include "server/scheduler/kill_hook.h"
#include "server/scheduler/planning_pool.h"
#include "server/scheduler/scheduler.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {

using Strand = boost::asio::strand<boost::asio::io_context::executor_type>;

// "Running on the strand" as a capability for clang's thread-safety analysis.
class ABSL_LOCKABLE StrandRole {
 public:
  explicit StrandRole(const Strand* strand) : strand_(strand) {}
  // Tells the analysis that the caller runs on the strand, and checks it in every build (one
  // thread-local lookup): a handler posted elsewhere would race the strand's state, so it aborts.
  void Assert() const ABSL_ASSERT_EXCLUSIVE_LOCK() {
    if (!strand_->running_in_this_thread()) {
      fprintf(stderr, "quantd: scheduler state touched off its strand\n");
      abort();
    }
  }

 private:
  const Strand* strand_;  // the scheduler's strand
};

// One task attempt, shared by the strand and the worker that runs it.
struct TaskRun {
  std::atomic<uint64_t> bytes{0};        // source bytes the task reported so far
  std::atomic<int64_t> heartbeat_ms{0};  // when it last reported (Unix ms); its lease's life
  std::atomic<bool> cancel{false};       // set to stop it between units of work
};

// One start's source phase (JobPlanner::Load), shared by the strand and its planning thread.
struct PlanningRun {
  std::atomic<bool> cancel{false};    // set to stop it (cancel, pause, shutdown)
  std::atomic<bool> returned{false};  // its Load returned (its result may still be on the way)
};

// Starts of a job whose source phase a crash (or a hang past the shutdown grace) interrupted
// before it fails with reason PLANNING_CRASHED instead of being planned again.
inline constexpr int kMaxInterruptedPlannings = 2;

// A leased task on its way to a worker, and back with its result.
// "quantize model-00002-of-00004.safetensors"; just "export" for a stage's only task (log lines
// and events).
std::string TaskLabel(const store::TaskRow& task);
// "a GPU with 1073741824 bytes of memory", "a device" (dispatch.cc).
std::string DescribeRequirement(const compute::DeviceRequirement& req);

struct Work {
  int64_t job_id = 0;
  int worker = 0;      // index into workers_; -1 for a remote worker's
  std::string remote;  // the remote worker's id; "" for a local worker's
  store::TaskRow task;
  store::TaskLease lease;
  int64_t reserved_bytes = 0;              // device memory reserved for it
  std::shared_ptr<const JobTasks> tasks;   // the job's tasks (kept alive while it runs)
  std::shared_ptr<TaskRun> run;            // shared with the strand
  bool kill_mid = false;      // test hook: SIGKILL once half of the task's bytes are reported
  bool kill_written = false;  // test hook: SIGKILL when the task returns, before it is recorded
};

class Scheduler::Impl {
 public:
  Impl(JobBoard* board, std::unique_ptr<store::JobStore> store, SchedulerOptions options);
  ~Impl();

  // Opens the devices, requeues the leases a dead process left, loads every job onto the board
  // and starts the threads. Runs before any thread starts, so it touches strand-owned members
  // directly.
  absl::Status Init() ABSL_NO_THREAD_SAFETY_ANALYSIS;
  void Shutdown(std::chrono::milliseconds grace) ABSL_LOCKS_EXCLUDED(state_mu_);
  int abandoned_planning() const { return abandoned_planning_.load(); }

  void Submit(const std::string& request_id, const job::JobSpec& spec,
              std::function<void(absl::StatusOr<v1::Job>, bool)> done);
  void Cancel(int64_t job_id, bool pause, const std::string& reason, JobDone done);
  void Resume(int64_t job_id, JobDone done);
  void Delete(int64_t job_id, store::DeletePrecondition precondition,
              std::function<void(absl::Status)> done);
  // Answers from reporting_, not the strand: a report never waits for a command or a result.
  void Report(int64_t job_id, int worst, std::function<void(absl::StatusOr<v1::JobReport>)> done)
      ABSL_LOCKS_EXCLUDED(report_mu_);
  absl::StatusOr<v1::Job> WaitUntilStopped(int64_t job_id,
                                           const std::function<bool(const v1::Job&)>& poll)
      ABSL_LOCKS_EXCLUDED(state_mu_);
  bool serving() const { return serving_.load(); }

  // remote_workers.cc: the commands of Scheduler's remote-worker API.
  void RegisterWorker(const std::string& name, const std::string& peer,
                      std::vector<RemoteDevice> devices,
                      std::function<void(absl::StatusOr<RemoteRegistration>)> done);
  void LeaseRemote(const std::string& worker_id, int device, int64_t wait_ms,
                   std::set<int64_t> open_jobs,
                   std::function<void(absl::StatusOr<std::optional<RemoteLease>>)> done);
  void RenewRemote(const std::string& worker_id, int64_t task_id, int attempt, uint64_t bytes_done,
                   std::function<void(absl::StatusOr<bool>)> done);
  void CompleteRemote(const std::string& worker_id, int64_t task_id, int attempt,
                      absl::StatusOr<pipeline::TaskOutput> output,
                      std::function<void(absl::Status)> done);
  void ListWorkers(std::function<void(std::vector<RemoteWorkerView>)> done);

 private:
  // Why a running job stops before finishing.
  enum class Stop { kNone, kCancel, kPause, kShutdown };

  // A task of a job between its lease and its recording.
  struct InFlight {
    Work work;              // what the worker got (its run is the worker's heartbeat)
    bool returned = false;  // the worker returned; the result waits in unrecorded_
  };

  // A leased task that waits for a device that fits it.
  struct Parked {
    store::TaskRow task;
    store::TaskLease lease;
    compute::DeviceRequirement requirement;
  };

  // A job this process is running (or planning).
  struct ActiveJob {
    int64_t id = 0;
    uint64_t serial = 0;                    // tells this start from an earlier one of the job
    v1::JobSpec spec;                       // its stored spec as read at this start (snapshots)
    std::shared_ptr<const JobTasks> tasks;  // nullptr while its source is being loaded
    std::shared_ptr<PlanningRun> planning;  // its source phase (also in loading_ until it ends)
    Stop stop = Stop::kNone;                // set by Cancel or Shutdown
    std::string stop_reason;                // recorded with PAUSED / CANCELLED
    std::vector<int> workers;               // the workers it holds
    std::map<int64_t, InFlight> in_flight;  // task id -> its attempt
    std::map<int64_t, int> lease_expiries;  // task id -> leases it lost in this process
    std::optional<Parked> parked;           // at most one leased task waiting for a device
    std::optional<absl::Status> failure;    // the first permanent task error
    // stage id -> (when this process began the stage, its done bytes then): the rate's base.
    std::map<int64_t, std::pair<int64_t, int64_t>> stage_clock;
    std::set<int64_t> stages_timed;  // stages whose duration went to metrics
    uint64_t published_bytes = 0;    // running bytes in the last snapshot
  };

  // The strand's view of one worker.
  struct WorkerSlot {
    int64_t job_id = 0;           // the job holding it, 0 = free
    bool busy = false;            // running a task
    int64_t busy_since_ms = 0;    // when the current task started
    double busy_seconds = 0;      // total time spent on tasks
    double busy_sampled = 0;      // busy_seconds at the last metrics refresh
  };

  // One worker thread and the device it runs tasks on.
  struct WorkerThread {
    std::unique_ptr<compute::Device> device;  // used by this thread only (memory: any thread)
    BlockingQueue<Work> queue;                // tasks for it
    std::thread thread;                       // runs WorkerLoop
  };

  // A task result the store has not taken yet.
  struct Result {
    Work work;
    absl::StatusOr<pipeline::TaskOutput> output;
  };

  // --- scheduler.cc: posting and timers
  // Runs `fn` on the strand; runs `closed` instead, at once, when the loop has ended.
  void Post(std::function<void()> fn, std::function<void()> closed) ABSL_LOCKS_EXCLUDED(state_mu_);
  // Runs `fn` on the strand once the clock reaches at_ms (unless the loop has ended).
  void At(int64_t at_ms, std::function<void()> fn);
  void OnLeaseTimer() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void OnPublishTimer() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void OnMetricsTimer() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void BeginStop(std::chrono::milliseconds grace) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Ends the loop once nothing runs, or at once when `force`.
  void MaybeEndLoop(bool force) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void EndLoop(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_)
      ABSL_LOCKS_EXCLUDED(state_mu_, report_mu_);
  void Log(int64_t job_id, const std::string& kind, const std::string& message) const;

  // --- admission.cc: commands, which waiting job starts next, planning off the strand
  absl::StatusOr<v1::Job> DoSubmit(const std::string& request_id, const job::JobSpec& spec,
                                   bool* created) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  absl::StatusOr<v1::Job> DoCancel(int64_t job_id, bool pause, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  absl::StatusOr<v1::Job> DoResume(int64_t job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  absl::Status DoDelete(int64_t job_id, store::DeletePrecondition precondition)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Runs on reporting_, reading report_store_ in one read transaction (a consistent snapshot).
  absl::StatusOr<v1::JobReport> DoReport(int64_t job_id, int worst)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(report_mu_);
  // The workers a job may use: every worker whose device its spec names (all when none).
  absl::StatusOr<std::vector<int>> WorkersFor(const job::JobSpec& spec) const;
  absl::Status StartJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // StartJobs when something changed since it last ran (reconsider_) and no shutdown began.
  absl::Status Reconsider() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // RUNNING, holding `workers`; its source is read on the planning pool, then OnLoaded.
  absl::Status StartJob(int64_t job_id, const job::JobSpec& spec, const std::vector<int>& workers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void OnLoaded(int64_t job_id, uint64_t serial, absl::StatusOr<std::unique_ptr<LoadedJob>> loaded)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // How many starts of the job in a row began planning (an event "planning") and never ended it
  // (an event "planning_end"): a crash or a hang interrupted them.
  absl::StatusOr<int> InterruptedPlannings(int64_t job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Records the end of the job's planning (an event "planning_end") unless the job is gone.
  void EndPlanning(int64_t job_id, const std::string& how) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // After the loop ended (Shutdown): the plannings that returned within the grace ended.
  void EndReturnedPlannings() ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // LoadedJob::Attach, its std::bad_alloc an error.
  absl::StatusOr<std::unique_ptr<JobTasks>> AttachLoaded(LoadedJob& loaded, int64_t job_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);

  // --- job_lifecycle.cc: one round of the loop, and how a job ends
  // Ends the job when nothing of it runs and it finished, failed or was asked to stop.
  absl::Status MaybeFinish(ActiveJob& job, bool* finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void Release(ActiveJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Sets the job's state in the store and the index, logs it and publishes the snapshot.
  absl::Status SetState(int64_t job_id, store::JobState state, const std::string& reason,
                        const std::string& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Removes the job's work directory (pipeline::RemoveJobWorkDir); a failure is logged.
  void RemoveWorkDir(int64_t job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // One round after any event: start jobs, hand out tasks, finish jobs; a store error goes to
  // OnStoreError.
  void Kick() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  absl::Status Step() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);

  // --- dispatch.cc: placement and the worker threads
  absl::Status Dispatch(ActiveJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // A free worker of the job whose device fits `req` now, or -1.
  int PlaceTask(const ActiveJob& job, const compute::DeviceRequirement& req) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Whether some worker of the job could ever run a task needing `req`.
  bool EverFits(const ActiveJob& job, const compute::DeviceRequirement& req) const;
  absl::Status StartTask(ActiveJob& job, int worker, store::TaskRow task, store::TaskLease lease,
                         const compute::DeviceRequirement& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void WorkerLoop(int index);

  // --- recording.cc: results, retries, leases, store failures
  void OnTaskDone(Work work, absl::StatusOr<pipeline::TaskOutput> output)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Records unrecorded_ in order; on a store error keeps the rest for a retry.
  void RecordPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  absl::Status Record(const Result& result) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Renews the leases of live tasks, takes them from silent ones, requeues expired leases.
  absl::Status RenewAndExpireLeases() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void OnStoreError(const absl::Status& error, const std::string& what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void OnStoreOk() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);

  // --- remote_workers.cc: remote workers (scheduler.h)
  struct RemoteWorker {
    std::string id;    // handed out by Register, sent with every call
    std::string name;  // as it registered (metrics label, `quantctl workers`)
    std::string peer;  // the address it registered from
    std::vector<RemoteDevice> devices;
    int64_t registered_ms = 0;
    int64_t last_seen_ms = 0;   // its last call
    int64_t tasks_leased = 0;
  };
  // A Lease call waiting for a task.
  struct RemoteWaiter {
    std::string worker_id;
    int device = 0;
    int64_t deadline_ms = 0;
    std::set<int64_t> open_jobs;
    std::function<void(absl::StatusOr<std::optional<RemoteLease>>)> done;
  };
  // The registered worker `id`; NotFound (reason WORKER_UNKNOWN) for none. Marks it seen.
  absl::StatusOr<RemoteWorker*> SeeWorker(const std::string& id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Leases the oldest running job's next task that fits the worker's device; nullopt for none.
  absl::StatusOr<std::optional<RemoteLease>> LeaseFor(RemoteWorker& worker, int device,
                                                      const std::set<int64_t>& open_jobs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Answers the waiting Lease calls that a task now fits or whose wait ended (from Kick).
  void ServeRemoteWaiters() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // The in-flight attempt of remote worker `worker_id` on task `task_id` with `attempt` (not yet
  // returned); nullptr when there is none (the fencing: logged and counted under `call`).
  InFlight* FindRemoteAttempt(const std::string& worker_id, int64_t task_id, int attempt,
                              const char* call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Forgets workers silent for three leases (lease timer) and refreshes the connected gauge.
  void ForgetSilentWorkers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // A job that no worker of this process can run fails (reason NO_WORKER).
  void FailIfNoWorker(ActiveJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // On a coordinator without local workers, fails (reason NO_WORKER) each job with a runnable
  // task that no registered remote worker's device fits (the rule: remote_workers.cc).
  absl::Status FailJobsNoRemoteWorkerFits() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  // Notes when this process began the task's stage (the progress rate's base).
  absl::Status ClockStage(ActiveJob& job, const store::TaskRow& task)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);

  // --- snapshots.cc: the board and metrics
  absl::StatusOr<v1::Job> Snapshot(int64_t job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  absl::Status Publish(int64_t job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void PublishProgress() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);
  void RefreshMetrics() ABSL_EXCLUSIVE_LOCKS_REQUIRED(on_strand_);

  // Fixed after Init.
  JobBoard& board_;                       // fed here, read by the API and quantd run
  const SchedulerOptions options_;        // devices, limits, sinks
  Clock& clock_;                          // options_.clock or the system clock
  std::shared_ptr<JobPlanner> planner_;   // reads sources off the strand
  std::string owner_;                     // lease owner: "quantd:<pid>"
  std::optional<KillHook> kill_hook_;     // QUANTD_TEST_KILL_AT
  std::vector<std::unique_ptr<WorkerThread>> workers_;  // one per options_.devices entry

  boost::asio::io_context io_;                // runs the strand and the timers
  // Keeps io_ running while it waits (a fake clock arms no timer in it) until EndLoop stops it.
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> io_work_ =
      boost::asio::make_work_guard(io_);
  Strand strand_;                             // everything below marked on_strand_
  StrandRole on_strand_;                      // the capability of running on strand_
  PlanningPool planning_{options_.planning.threads};  // JobPlanner::Load, under options_.planning
  boost::asio::thread_pool reporting_{1};     // DoReport, off the strand
  std::thread io_thread_;                     // runs io_
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // clock callbacks hold it weakly
  std::atomic<bool> serving_{true};           // false once the store is unusable
  std::atomic<int> abandoned_planning_{0};    // planning threads Shutdown left running

  std::unique_ptr<store::JobStore> store_ ABSL_GUARDED_BY(on_strand_);  // (and Init before)
  std::vector<WorkerSlot> slots_ ABSL_GUARDED_BY(on_strand_);           // one per worker
  // Device memory reserved by running tasks, per device name.
  std::map<std::string, int64_t> reserved_ ABSL_GUARDED_BY(on_strand_);
  std::map<int64_t, store::JobState> states_ ABSL_GUARDED_BY(on_strand_);  // every job's state
  std::map<int64_t, std::unique_ptr<ActiveJob>> active_ ABSL_GUARDED_BY(on_strand_);
  uint64_t next_serial_ ABSL_GUARDED_BY(on_strand_) = 1;   // for ActiveJob::serial
  // Jobs whose source phase (JobPlanner::Load) runs on planning_, current or stopped meanwhile.
  // (job id -> its source phase).
  std::map<int64_t, std::shared_ptr<PlanningRun>> loading_ ABSL_GUARDED_BY(on_strand_);
  std::deque<Result> unrecorded_ ABSL_GUARDED_BY(on_strand_);  // results awaiting the store
  bool reconsider_ ABSL_GUARDED_BY(on_strand_) = true;     // StartJobs has news
  bool stopping_ ABSL_GUARDED_BY(on_strand_) = false;      // Shutdown began
  bool ended_ ABSL_GUARDED_BY(on_strand_) = false;         // the loop ended
  int64_t store_failing_since_ms_ ABSL_GUARDED_BY(on_strand_) = 0;  // 0 = the store works
  bool store_retry_armed_ ABSL_GUARDED_BY(on_strand_) = false;      // a retry timer is set
  std::map<std::string, int64_t> started_ ABSL_GUARDED_BY(on_strand_);  // tasks per stage kind
  std::set<int64_t> kill_when_done_ ABSL_GUARDED_BY(on_strand_);  // test hook: task ids
  std::map<std::string, std::deque<double>> busy_window_ ABSL_GUARDED_BY(on_strand_);
  std::map<std::string, RemoteWorker> remote_workers_ ABSL_GUARDED_BY(on_strand_);  // by id
  std::deque<RemoteWaiter> remote_waiters_ ABSL_GUARDED_BY(on_strand_);  // Lease calls, oldest first
  uint64_t next_worker_ ABSL_GUARDED_BY(on_strand_) = 1;  // for RemoteWorker::id

  mutable absl::Mutex report_mu_;  // guards report_store_
  // A read-only connection to store_'s database for DoReport; null once the loop ended (reports
  // then answer SHUTTING_DOWN).
  std::unique_ptr<store::JobStore> report_store_ ABSL_GUARDED_BY(report_mu_);

  mutable absl::Mutex state_mu_;                 // guards the members below
  bool closed_ ABSL_GUARDED_BY(state_mu_) = false;     // the loop ended; Post answers at once
  bool shut_down_ ABSL_GUARDED_BY(state_mu_) = false;  // Shutdown ran
  absl::Status fatal_ ABSL_GUARDED_BY(state_mu_);      // the store error that ended the loop
};

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_SCHEDULER_IMPL_H_
