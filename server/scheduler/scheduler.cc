#include "server/scheduler/scheduler.h"

#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/compute/device.h"
#include "server/pipeline/prepared_job.h"
#include "server/pipeline/stages/verify_stage.h"
#include "server/scheduler/blocking_queue.h"
#include "server/scheduler/job_proto.h"

namespace quantd::scheduler {
namespace {

using store::JobState;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kTick(100);  // the loop's wake-up: cancel checks, publishing
constexpr int64_t kPublishEveryMs = 100;         // progress snapshots of a job at most this often
constexpr int64_t kMetricsEveryMs = 1000;        // gauges refreshed this often
constexpr size_t kBusyWindow = 60;               // busy-ratio window, in metric refreshes

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// QUANTD_TEST_KILL_AT (pipeline/runner.h): where the process kills itself.
struct KillHook {
  enum class When { kStart, kMid, kWritten, kDone };
  std::string stage;
  int64_t n = 0;
  When when = When::kStart;
};

absl::StatusOr<std::optional<KillHook>> ParseKillHook(const char* value) {
  if (value == nullptr || *value == '\0') return std::optional<KillHook>();
  const std::vector<std::string> parts = absl::StrSplit(value, ':');
  KillHook hook;
  bool ok = (parts.size() == 2 || parts.size() == 3) && !parts[0].empty() &&
            absl::SimpleAtoi(parts[1], &hook.n) && hook.n >= 1;
  hook.stage = ok ? parts[0] : "";
  if (ok && parts.size() == 3) {
    static const std::map<std::string, KillHook::When> kWhen = {
        {"start", KillHook::When::kStart},
        {"mid", KillHook::When::kMid},
        {"written", KillHook::When::kWritten},
        {"done", KillHook::When::kDone}};
    auto it = kWhen.find(parts[2]);
    ok = it != kWhen.end();
    if (ok) hook.when = it->second;
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("QUANTD_TEST_KILL_AT=", value,
                     ": expected <stage>:<n>[:start|:mid|:written|:done] with n >= 1"));
  }
  return std::optional<KillHook>(hook);
}

[[noreturn]] void KillSelf() {
  kill(getpid(), SIGKILL);
  for (;;) pause();
}

// "quantize model-00002-of-00004.safetensors"; just "export" for a stage's only task.
std::string TaskLabel(const store::TaskRow& task) {
  return task.name == task.stage_kind ? task.name : absl::StrCat(task.stage_kind, " ", task.name);
}

bool Stopped(v1::JobState s) {
  return s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED || s == v1::PAUSED;
}

absl::Status NotFound(int64_t job_id) {
  return WithReason(absl::NotFoundError(absl::StrCat("job ", job_id, " not found")),
                    "JOB_NOT_FOUND");
}

absl::Status Forbidden(const std::string& message) {
  return WithReason(absl::FailedPreconditionError(message), "TRANSITION_FORBIDDEN");
}

// Resident memory of this process, from /proc/self/statm; 0 when unreadable.
int64_t ResidentBytes() {
  FILE* f = fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long pages = 0, resident = 0;
  const bool ok = fscanf(f, "%ld %ld", &pages, &resident) == 2;
  fclose(f);
  return ok ? static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE) : 0;
}

}  // namespace

class Scheduler::Impl {
 public:
  Impl(JobBoard* board, std::unique_ptr<store::JobStore> store, SchedulerOptions options)
      : board_(*board), store_(std::move(store)), options_(std::move(options)) {}
  ~Impl() { Shutdown(std::chrono::milliseconds(0)); }

  absl::Status Init();
  void Shutdown(std::chrono::milliseconds grace);

  absl::StatusOr<v1::Job> Submit(const std::string& request_id, const pipeline::JobSpec& spec,
                                 bool* created) {
    return Call<absl::StatusOr<v1::Job>>([&] { return DoSubmit(request_id, spec, created); });
  }
  absl::StatusOr<v1::Job> Cancel(int64_t job_id, bool pause, const std::string& reason) {
    return Call<absl::StatusOr<v1::Job>>([&] { return DoCancel(job_id, pause, reason); });
  }
  absl::StatusOr<v1::Job> Resume(int64_t job_id) {
    return Call<absl::StatusOr<v1::Job>>([&] { return DoResume(job_id); });
  }
  absl::Status Delete(int64_t job_id) {
    return Call<absl::Status>([&] { return DoDelete(job_id); });
  }
  absl::StatusOr<v1::JobReport> Report(int64_t job_id, int worst) {
    return Call<absl::StatusOr<v1::JobReport>>([&] { return DoReport(job_id, worst); });
  }
  absl::StatusOr<v1::Job> WaitUntilStopped(int64_t job_id,
                                           const std::function<bool(const v1::Job&)>& poll);

 private:
  // A leased task on its way to a worker.
  struct Work {
    int64_t job_id = 0;
    int worker = 0;  // index into workers_
    store::TaskRow task;
    store::TaskLease lease;
    const pipeline::PreparedJob* prepared = nullptr;       // the job's shared state
    const std::atomic<bool>* cancel = nullptr;             // the job's cancel flag
    std::shared_ptr<std::atomic<uint64_t>> reported;       // source bytes the task processed
    bool kill_mid = false;      // test hook: SIGKILL once half of the task's bytes are reported
    bool kill_written = false;  // test hook: SIGKILL when the task returns, before it is recorded
  };

  // One worker thread and the device it runs kernels on.
  struct Worker {
    std::string device;                         // "cpu" or "cuda:N"
    std::unique_ptr<compute::Device> compute_device;  // used by this worker's thread only
    BlockingQueue<Work> queue;                  // tasks for this worker
    std::thread thread;                         // runs WorkerLoop
    // Scheduler thread only:
    int64_t job_id = 0;                  // the job holding this worker, 0 = free
    bool busy = false;                   // running a task
    Clock::time_point busy_since;        // when the current task started
    double busy_seconds = 0;             // total time spent on tasks
    double busy_sampled = 0;             // busy_seconds at the last metrics refresh
  };

  // Why a running job stops before finishing.
  enum class Stop { kNone, kCancel, kPause, kShutdown };

  // A job this process is running: it holds workers and its PreparedJob.
  struct ActiveJob {
    int64_t id = 0;
    std::unique_ptr<pipeline::PreparedJob> prepared;  // shared read-only with its tasks
    std::atomic<bool> cancel{false};                  // its tasks stop between tensors when set
    Stop stop = Stop::kNone;                          // set by Cancel or Shutdown
    std::string stop_reason;                          // reason recorded with PAUSED / CANCELLED
    std::vector<int> workers;                         // indices of the workers it holds
    std::map<int64_t, store::TaskLease> leases;       // task id -> lease, tasks in flight
    // task id -> (stage id, bytes it reported so far), tasks in flight.
    std::map<int64_t, std::pair<int64_t, std::shared_ptr<std::atomic<uint64_t>>>> running;
    std::optional<absl::Status> failure;              // the first permanent task error
    // stage id -> (when this process began the stage, its done bytes then): the rate's base.
    std::map<int64_t, std::pair<Clock::time_point, int64_t>> stage_clock;
    std::set<int64_t> stages_timed;                   // stages whose duration went to metrics
    uint64_t published_bytes = 0;                     // running bytes in the last snapshot
    int64_t published_ms = 0;                         // when the last snapshot was published
  };

  // Runs `fn` on the scheduler thread and returns its result; Unavailable once it stopped.
  template <typename R>
  R Call(std::function<R()> fn) {
    auto promise = std::make_shared<std::promise<R>>();
    std::future<R> result = promise->get_future();
    if (!inbox_.Push([promise, fn = std::move(fn)] { promise->set_value(fn()); })) {
      return R(WithReason(absl::UnavailableError("quantd is shutting down"), "SHUTTING_DOWN"));
    }
    return result.get();
  }

  void Loop();
  // One round: start jobs, hand out tasks, finish jobs, renew leases, publish.
  absl::Status Step();
  absl::Status StartJobs();
  // The workers a job may use: every worker whose device its spec names (all for "auto").
  absl::StatusOr<std::vector<int>> WorkersFor(const pipeline::JobSpec& spec) const;
  absl::Status StartJob(int64_t job_id, const pipeline::JobSpec& spec,
                        const std::vector<int>& workers);
  absl::Status Dispatch(ActiveJob& job);
  // Ends the job when nothing of it runs and it finished, failed or was asked to stop.
  absl::Status MaybeFinish(ActiveJob& job, bool* finished);
  void Release(ActiveJob& job);
  void WorkerLoop(int index);
  absl::Status Record(const Work& work, const absl::StatusOr<pipeline::TaskOutput>& output);
  absl::Status RenewLeases();
  // Sets the job's state in the store, logs it and publishes the snapshot.
  absl::Status SetState(int64_t job_id, JobState state, const std::string& reason,
                        const std::string& error);
  absl::StatusOr<v1::Job> Snapshot(int64_t job_id);
  absl::Status Publish(int64_t job_id);
  void PublishProgress();
  void RefreshMetrics();
  void Log(int64_t job_id, const std::string& kind, const std::string& message);

  absl::StatusOr<v1::Job> DoSubmit(const std::string& request_id, const pipeline::JobSpec& spec,
                                   bool* created);
  absl::StatusOr<v1::Job> DoCancel(int64_t job_id, bool pause, const std::string& reason);
  absl::StatusOr<v1::Job> DoResume(int64_t job_id);
  absl::Status DoDelete(int64_t job_id);
  absl::StatusOr<v1::JobReport> DoReport(int64_t job_id, int worst);

  JobBoard& board_;                          // snapshots for readers
  std::unique_ptr<store::JobStore> store_;   // scheduler thread only (and Init before it)
  const SchedulerOptions options_;           // devices, limits, sinks
  std::string owner_;                        // lease owner: "quantd:<pid>"
  std::optional<KillHook> kill_hook_;        // QUANTD_TEST_KILL_AT
  std::map<std::string, int64_t> started_;   // tasks started by this process, per stage kind
  std::set<int64_t> kill_when_done_;         // test hook: task ids whose recording ends us

  std::vector<std::unique_ptr<Worker>> workers_;       // one per device entry
  std::map<int64_t, std::unique_ptr<ActiveJob>> active_;  // running jobs by id
  BlockingQueue<std::function<void()>> inbox_;        // commands and task results
  std::thread thread_;                                // runs Loop
  bool stopping_ = false;                             // scheduler thread: Shutdown began
  bool reconsider_ = true;                            // scheduler thread: StartJobs has news
  Clock::time_point stop_deadline_;                   // scheduler thread: grace ends
  int64_t last_renew_ms_ = 0;                         // scheduler thread
  int64_t last_metrics_ms_ = 0;                       // scheduler thread
  std::map<std::string, std::deque<double>> busy_window_;  // device -> busy share samples

  std::mutex state_mu_;              // guards the members below
  std::condition_variable stopped_cv_;  // signalled when the loop ends
  bool loop_ended_ = false;          // the scheduler thread left Loop
  bool shut_down_ = false;           // Shutdown completed
  absl::Status fatal_;               // the store error that stopped the loop
};

absl::Status Scheduler::Impl::Init() {
  absl::StatusOr<std::optional<KillHook>> hook = ParseKillHook(getenv("QUANTD_TEST_KILL_AT"));
  if (!hook.ok()) return hook.status();
  kill_hook_ = *hook;
  owner_ = absl::StrCat("quantd:", getpid());
  if (options_.devices.empty()) return absl::InvalidArgumentError("no devices to run tasks on");
  for (const std::string& device : options_.devices) {
    absl::StatusOr<std::unique_ptr<compute::Device>> opened =
        compute::OpenDevice(device, {options_.cpu_threads, 0});
    if (!opened.ok()) return opened.status();
    auto worker = std::make_unique<Worker>();
    worker->device = device;
    worker->compute_device = std::move(*opened);
    workers_.push_back(std::move(worker));
  }
  // Leases still in the store belong to a process that died: this one owns the state now.
  int64_t after = 0;
  while (true) {
    absl::StatusOr<std::vector<store::JobRow>> jobs = store_->ListJobs(std::nullopt, after, 500);
    if (!jobs.ok()) return jobs.status();
    if (jobs->empty()) break;
    for (const store::JobRow& job : *jobs) {
      after = job.id;
      if (job.state == JobState::kRunning) {
        absl::StatusOr<int> n = store_->RequeueJobLeases(job.id, NowMs());
        if (!n.ok()) return n.status();
        if (*n > 0) Log(job.id, "recover", absl::StrCat("requeued ", *n, " interrupted task(s)"));
      }
      if (absl::Status s = Publish(job.id); !s.ok()) return s;
    }
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i]->thread = std::thread([this, i] { WorkerLoop(static_cast<int>(i)); });
  }
  last_renew_ms_ = last_metrics_ms_ = NowMs();
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void Scheduler::Impl::Shutdown(std::chrono::milliseconds grace) {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (thread_.joinable()) {
    // If the loop already ended (a store failure), the push fails and the join returns at once.
    inbox_.Push([this, grace] {
      if (stopping_) return;
      stopping_ = true;
      stop_deadline_ = Clock::now() + grace;
      for (auto& [id, job] : active_) {
        if (job->stop == Stop::kNone) job->stop = Stop::kShutdown;
        job->cancel.store(true);
      }
    });
    thread_.join();
  }
  for (auto& worker : workers_) worker->queue.Close();
  for (auto& worker : workers_) {
    if (worker->thread.joinable()) worker->thread.join();
  }
}

void Scheduler::Impl::Loop() {
  absl::Status status;
  while (status.ok()) {
    if (std::optional<std::function<void()>> item = inbox_.PopFor(kTick)) (*item)();
    while (std::optional<std::function<void()>> item = inbox_.TryPop()) (*item)();
    status = Step();
    if (!stopping_) continue;
    bool in_flight = false;
    for (auto& [id, job] : active_) in_flight |= !job->leases.empty();
    if (!in_flight || Clock::now() >= stop_deadline_) break;
  }
  if (!status.ok()) Log(0, "error", absl::StrCat("scheduler stopped: ", status.message()));
  // Tasks still running past the grace period stop at their next check; their leases go back to
  // PENDING now (this process will not record them), which is what a crash would leave too.
  for (auto& [id, job] : active_) {
    job->cancel.store(true);
    if (status.ok() && !job->leases.empty()) {
      absl::StatusOr<int> n = store_->RequeueJobLeases(id, NowMs());
      if (!n.ok()) status = n.status();
    }
  }
  inbox_.Close();
  // Commands that raced with the close still get an answer.
  while (std::optional<std::function<void()>> item = inbox_.TryPop()) (*item)();
  std::lock_guard<std::mutex> lock(state_mu_);
  loop_ended_ = true;
  fatal_ = status;
  stopped_cv_.notify_all();
}

absl::Status Scheduler::Impl::Step() {
  // Waiting jobs can only start after a submit, a resume or a release of workers.
  if (!stopping_ && reconsider_) {
    reconsider_ = false;
    if (absl::Status s = StartJobs(); !s.ok()) return s;
  }
  for (auto& [id, job] : active_) {
    if (absl::Status s = Dispatch(*job); !s.ok()) return s;
  }
  for (auto it = active_.begin(); it != active_.end();) {
    bool finished = false;
    if (absl::Status s = MaybeFinish(*it->second, &finished); !s.ok()) return s;
    it = finished ? active_.erase(it) : std::next(it);
  }
  const int64_t now = NowMs();
  if (now - last_renew_ms_ >= options_.lease_ms / 3) {
    if (absl::Status s = RenewLeases(); !s.ok()) return s;
    last_renew_ms_ = now;
  }
  PublishProgress();
  if (now - last_metrics_ms_ >= kMetricsEveryMs) {
    RefreshMetrics();
    last_metrics_ms_ = now;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> Scheduler::Impl::WorkersFor(
    const pipeline::JobSpec& spec) const {
  std::vector<int> out;
  for (size_t i = 0; i < workers_.size(); ++i) {
    const std::string& device = workers_[i]->device;
    if (spec.devices.empty() || options_.ignore_spec_devices ||
        std::find(spec.devices.begin(), spec.devices.end(), device) != spec.devices.end()) {
      out.push_back(static_cast<int>(i));
    }
  }
  for (const std::string& d : spec.devices) {
    if (options_.ignore_spec_devices) break;
    bool found = false;
    for (const auto& w : workers_) found |= w->device == d;
    if (!found) {
      std::vector<std::string> have;
      for (const auto& w : workers_) {
        if (std::find(have.begin(), have.end(), w->device) == have.end()) have.push_back(w->device);
      }
      return WithReason(
          absl::InvalidArgumentError(absl::StrCat("spec.devices: ", d,
                                                  " is not a device of this quantd (it has ",
                                                  absl::StrJoin(have, ", "), ")")),
          "INVALID_SPEC");
    }
  }
  return out;
}

absl::Status Scheduler::Impl::StartJobs() {
  // Jobs that were RUNNING when the process stopped come first, then PENDING ones, oldest first.
  // A job waits while a device it needs is busy; younger jobs may not take devices an older
  // waiting job needs, so nobody starves.
  std::vector<v1::Job> candidates;
  for (v1::JobState state : {v1::RUNNING, v1::PENDING}) {
    bool more = false;
    for (v1::Job& job : board_.List(state, 0, 1 << 30, &more)) {
      if (active_.count(job.id()) == 0) candidates.push_back(std::move(job));
    }
  }
  std::set<int> reserved;
  for (const v1::Job& candidate : candidates) {
    absl::StatusOr<store::JobRow> row = store_->GetJob(candidate.id());
    if (!row.ok()) return row.status();
    absl::StatusOr<pipeline::JobSpec> spec = pipeline::ParseJobSpec(row->spec_json, "stored spec");
    absl::StatusOr<std::vector<int>> workers =
        spec.ok() ? WorkersFor(*spec) : absl::StatusOr<std::vector<int>>(spec.status());
    if (!workers.ok()) {
      if (absl::Status s = SetState(row->id, JobState::kFailed, "cannot_start",
                                    std::string(workers.status().message()));
          !s.ok()) {
        return s;
      }
      if (options_.metrics != nullptr) options_.metrics->JobFailed("cannot_start");
      continue;
    }
    bool free = true;
    for (int w : *workers) free &= workers_[w]->job_id == 0 && reserved.count(w) == 0;
    if (!free) {
      reserved.insert(workers->begin(), workers->end());
      continue;
    }
    if (absl::Status s = StartJob(row->id, *spec, *workers); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Scheduler::Impl::StartJob(int64_t job_id, const pipeline::JobSpec& spec,
                                       const std::vector<int>& workers) {
  absl::StatusOr<store::JobRow> row = store_->GetJob(job_id);
  if (!row.ok()) return row.status();
  const bool resumed = row->state == JobState::kRunning || row->reason == "resumed";
  if (absl::Status s = SetState(job_id, JobState::kRunning, resumed ? "resumed" : "started", "");
      !s.ok()) {
    return s;
  }
  absl::StatusOr<std::unique_ptr<pipeline::PreparedJob>> prepared =
      pipeline::PreparedJob::Prepare(*store_, job_id, spec, NowMs(),
                                     [&](const std::string& m) { Log(job_id, "plan", m); });
  if (!prepared.ok()) {
    if (options_.metrics != nullptr) options_.metrics->JobFailed("cannot_start");
    return SetState(job_id, JobState::kFailed, "cannot_start",
                    std::string(prepared.status().message()));
  }
  auto job = std::make_unique<ActiveJob>();
  job->id = job_id;
  job->prepared = std::move(*prepared);
  job->workers = workers;
  for (int w : workers) workers_[w]->job_id = job_id;
  Log(job_id, "start",
      absl::StrCat("running on ", workers.size(), " worker(s): ",
                   absl::StrJoin(workers, ", ",
                                 [&](std::string* out, int w) {
                                   absl::StrAppend(out, workers_[w]->device, " (",
                                                   workers_[w]->compute_device->backend().name(), ")");
                                 })));
  active_[job_id] = std::move(job);
  return Publish(job_id);
}

absl::Status Scheduler::Impl::Dispatch(ActiveJob& job) {
  if (job.stop != Stop::kNone || job.failure.has_value()) return absl::OkStatus();
  for (int w : job.workers) {
    Worker& worker = *workers_[w];
    if (worker.busy) continue;
    store::TaskLease lease;
    absl::StatusOr<std::optional<store::TaskRow>> task =
        store_->LeaseNextTask(job.id, owner_, NowMs(), options_.lease_ms, &lease);
    if (!task.ok()) return task.status();
    if (!task->has_value()) break;
    Work work;
    work.job_id = job.id;
    work.worker = w;
    work.task = std::move(**task);
    work.lease = lease;
    work.prepared = job.prepared.get();
    work.cancel = &job.cancel;
    work.reported = std::make_shared<std::atomic<uint64_t>>(0);
    const int64_t n = ++started_[work.task.stage_kind];
    if (kill_hook_.has_value() && kill_hook_->stage == work.task.stage_kind && kill_hook_->n == n) {
      switch (kill_hook_->when) {
        case KillHook::When::kStart:
          KillSelf();
        case KillHook::When::kMid:
          work.kill_mid = true;
          break;
        case KillHook::When::kWritten:
          work.kill_written = true;
          break;
        case KillHook::When::kDone:
          kill_when_done_.insert(work.task.id);
          break;
      }
    }
    if (job.stage_clock.count(work.task.stage_id) == 0) {
      absl::StatusOr<std::vector<store::StageProgress>> stages = store_->Progress(job.id);
      if (!stages.ok()) return stages.status();
      for (const store::StageProgress& p : *stages) {
        if (p.stage_id == work.task.stage_id) {
          job.stage_clock[p.stage_id] = {Clock::now(), p.bytes_done};
        }
      }
    }
    job.leases[work.task.id] = lease;
    job.running[work.task.id] = {work.task.stage_id, work.reported};
    worker.busy = true;
    worker.busy_since = Clock::now();
    worker.queue.Push(std::move(work));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::Impl::MaybeFinish(ActiveJob& job, bool* finished) {
  *finished = false;
  if (!job.leases.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<store::StageProgress>> stages = store_->Progress(job.id);
  if (!stages.ok()) return stages.status();
  bool all_done = true;
  for (const store::StageProgress& p : *stages) all_done &= p.state == store::StageState::kSucceeded;
  if (all_done) {
    absl::StatusOr<int> swept = job.prepared->SweepTmpFiles();
    if (!swept.ok()) return swept.status();
    if (*swept > 0) {
      const std::string m = absl::StrCat("removed ", *swept, " stale .tmp file(s)");
      if (absl::Status s = store_->AddEvent(job.id, "sweep", m, NowMs()); !s.ok()) return s;
    }
    *finished = true;
    Release(job);
    return SetState(job.id, JobState::kSucceeded, "", "");
  }
  if (job.stop != Stop::kNone) {
    absl::StatusOr<int> requeued = store_->RequeueJobLeases(job.id, NowMs());
    if (!requeued.ok()) return requeued.status();
    *finished = true;
    Release(job);
    if (job.stop == Stop::kShutdown) {
      Log(job.id, "shutdown", "stopped for shutdown; it resumes when quantd starts again");
      return Publish(job.id);
    }
    if (job.stop == Stop::kPause) {
      return SetState(job.id, JobState::kPaused, job.stop_reason, "");
    }
    absl::StatusOr<int> swept = job.prepared->SweepTmpFiles();
    if (!swept.ok()) return swept.status();
    return SetState(job.id, JobState::kCancelled, job.stop_reason, "");
  }
  if (job.failure.has_value()) {
    *finished = true;
    Release(job);
    if (options_.metrics != nullptr) options_.metrics->JobFailed("task_failed");
    return SetState(job.id, JobState::kFailed, "task_failed",
                    std::string(job.failure->message()));
  }
  return absl::OkStatus();  // waiting out a retry back-off
}

void Scheduler::Impl::Release(ActiveJob& job) {
  for (int w : job.workers) workers_[w]->job_id = 0;
  job.workers.clear();
  reconsider_ = true;
}

void Scheduler::Impl::WorkerLoop(int index) {
  Worker& worker = *workers_[index];
  if (options_.worker_nice != 0) {
    // PRIO_PROCESS with a thread id changes only that thread on Linux. Lowering the priority needs
    // no privilege; a failure leaves it as it was, which is harmless.
    const id_t self = static_cast<id_t>(gettid());
    errno = 0;
    const int current = getpriority(PRIO_PROCESS, self);
    if (errno == 0) setpriority(PRIO_PROCESS, self, current + options_.worker_nice);
  }
  while (std::optional<Work> work = worker.queue.Pop()) {
    const uint64_t half = static_cast<uint64_t>(work->task.bytes_total) / 2;
    const bool kill_mid = work->kill_mid;
    std::atomic<uint64_t>* reported = work->reported.get();
    metrics::Metrics* metrics = options_.metrics;
    absl::StatusOr<pipeline::TaskOutput> output = work->prepared->RunTask(
        work->task, *worker.compute_device, work->cancel,
        [reported, half, kill_mid, metrics](uint64_t n) {
          const uint64_t total = reported->fetch_add(n, std::memory_order_relaxed) + n;
          if (metrics != nullptr) metrics->AddBytesRead(n);
          if (kill_mid && total >= half) KillSelf();
        });
    if (work->kill_written && output.ok()) KillSelf();
    // The scheduler thread records the result; after Shutdown closed the inbox nobody will, and
    // the task's lease was already requeued.
    inbox_.Push([this, work = std::move(*work), output = std::move(output)] {
      if (absl::Status s = Record(work, output); !s.ok()) {
        Log(work.job_id, "error", absl::StrCat("recording ", TaskLabel(work.task), ": ",
                                                s.message()));
      }
    });
  }
}

absl::Status Scheduler::Impl::Record(const Work& work,
                                     const absl::StatusOr<pipeline::TaskOutput>& output) {
  Worker& worker = *workers_[work.worker];
  worker.busy = false;
  const double busy = std::chrono::duration<double>(Clock::now() - worker.busy_since).count();
  worker.busy_seconds += busy;
  metrics::Metrics* metrics = options_.metrics;
  if (metrics != nullptr) metrics->AddDeviceBusy(worker.device, busy);
  auto it = active_.find(work.job_id);
  if (it == active_.end()) return absl::OkStatus();  // the loop already gave the job up
  ActiveJob& job = *it->second;
  job.leases.erase(work.task.id);
  job.running.erase(work.task.id);
  const store::TaskRow& task = work.task;
  const int64_t now = NowMs();
  if (output.ok()) {
    if (absl::Status s = work.prepared->CompleteTask(*store_, work.lease, task, *output, now);
        !s.ok()) {
      return s;
    }
    std::string message = absl::StrCat(TaskLabel(task), " done");
    if (!output->path.empty()) {
      absl::StrAppend(&message, ": ", output->path, ", ", output->bytes, " bytes");
    }
    if (absl::Status s = store_->AddEvent(job.id, "task_done", message, now); !s.ok()) return s;
    Log(job.id, "task_done", message);
    if (metrics != nullptr) {
      metrics->TaskAttempt(task.stage_kind, "done");
      metrics->AddBytesWritten(output->bytes);
      absl::StatusOr<std::vector<store::StageProgress>> stages = store_->Progress(job.id);
      if (!stages.ok()) return stages.status();
      for (const store::StageProgress& p : *stages) {
        if (p.stage_id != task.stage_id || p.state != store::StageState::kSucceeded ||
            !p.started_ms.has_value() || !p.finished_ms.has_value() ||
            !job.stages_timed.insert(p.stage_id).second) {
          continue;
        }
        metrics->ObserveStageDuration(p.kind, (*p.finished_ms - *p.started_ms) / 1000.0);
      }
    }
    if (kill_when_done_.count(task.id) != 0) KillSelf();
    return Publish(job.id);
  }
  const absl::Status& error = output.status();
  // Interrupted by the cancel flag: the task stays leased and is requeued when the job stops.
  if (error.code() == absl::StatusCode::kCancelled && job.cancel.load()) {
    if (metrics != nullptr) metrics->TaskAttempt(task.stage_kind, "interrupted");
    return Publish(job.id);
  }
  // Stage errors usually start with the shard's name already.
  const std::string message =
      absl::StrCat(absl::StartsWith(error.message(), task.name) ? task.stage_kind : TaskLabel(task),
                   ": ", error.message());
  if (const std::optional<int64_t> delay_ms = pipeline::RetryDelayMs(error.code(), task.attempt)) {
    if (absl::Status s = store_->FailTask(work.lease, message, false, now + *delay_ms, now);
        !s.ok()) {
      return s;
    }
    const std::string line =
        absl::StrCat(message, "; retrying in ", *delay_ms / 1000, " s (attempt ", task.attempt,
                     " of ", pipeline::kMaxAttempts, ")");
    Log(job.id, "task_retry", line);
    if (metrics != nullptr) {
      metrics->TaskAttempt(task.stage_kind, "retried");
      metrics->TaskRetried(absl::StatusCodeToString(error.code()));
    }
    if (absl::Status s = store_->AddEvent(job.id, "task_retry", line, now); !s.ok()) return s;
    return Publish(job.id);
  }
  if (absl::Status s = store_->FailTask(work.lease, message, true, 0, now); !s.ok()) return s;
  Log(job.id, "task_failed", message);
  if (metrics != nullptr) metrics->TaskAttempt(task.stage_kind, "failed");
  if (!job.failure.has_value()) job.failure = absl::Status(error.code(), message);
  if (absl::Status s = store_->AddEvent(job.id, "task_failed", message, now); !s.ok()) return s;
  return Publish(job.id);
}

absl::Status Scheduler::Impl::RenewLeases() {
  for (auto& [id, job] : active_) {
    for (auto& [task_id, lease] : job->leases) {
      if (absl::Status s = store_->RenewLease(lease, NowMs(), options_.lease_ms); !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Scheduler::Impl::SetState(int64_t job_id, JobState state, const std::string& reason,
                                       const std::string& error) {
  if (absl::Status s = store_->SetJobState(job_id, state, reason, error, NowMs()); !s.ok()) {
    return s;
  }
  std::string message = store::JobStateName(state);
  if (!reason.empty()) absl::StrAppend(&message, " (", reason, ")");
  if (!error.empty()) absl::StrAppend(&message, ": ", error);
  Log(job_id, "state", message);
  return Publish(job_id);
}

absl::StatusOr<v1::Job> Scheduler::Impl::Snapshot(int64_t job_id) {
  absl::StatusOr<store::JobRow> row = store_->GetJob(job_id);
  if (!row.ok()) return row.status();
  absl::StatusOr<std::vector<store::StageProgress>> stages = store_->Progress(job_id);
  if (!stages.ok()) return stages.status();
  absl::StatusOr<int64_t> retries = store_->CountEvents(job_id, "task_retry");
  if (!retries.ok()) return retries.status();
  v1::Job job;
  job.set_id(row->id);
  job.set_request_id(row->request_id);
  absl::StatusOr<pipeline::JobSpec> spec = pipeline::ParseJobSpec(row->spec_json, "stored spec");
  if (spec.ok()) *job.mutable_spec() = JobSpecToProto(*spec);
  job.set_state(JobStateToProto(row->state));
  job.set_reason(row->reason);
  job.set_last_error(row->error);
  *job.mutable_create_time() = TimestampFromMs(row->created_ms);
  *job.mutable_update_time() = TimestampFromMs(row->updated_ms);
  if (row->started_ms.has_value()) *job.mutable_start_time() = TimestampFromMs(*row->started_ms);
  if (row->finished_ms.has_value()) *job.mutable_end_time() = TimestampFromMs(*row->finished_ms);
  job.set_task_retries(*retries);
  const auto active = active_.find(job_id);
  int64_t attempts = 0;
  for (const store::StageProgress& p : *stages) {
    v1::StageProgress* out = job.add_stages();
    out->set_kind(p.kind);
    out->set_state(StageStateToProto(p.state));
    out->set_tasks_done(p.tasks_done);
    out->set_tasks_total(p.tasks_total);
    out->set_bytes_total(p.bytes_total);
    out->set_task_attempts(p.task_attempts);
    attempts += p.task_attempts;
    if (p.started_ms.has_value()) *out->mutable_start_time() = TimestampFromMs(*p.started_ms);
    if (p.finished_ms.has_value()) *out->mutable_end_time() = TimestampFromMs(*p.finished_ms);
    int64_t done = p.bytes_done;
    if (active != active_.end()) {
      for (const auto& [task_id, running] : active->second->running) {
        if (running.first == p.stage_id) done += running.second->load(std::memory_order_relaxed);
      }
      done = std::min(done, p.bytes_total);
      const auto clock = active->second->stage_clock.find(p.stage_id);
      if (p.state != store::StageState::kSucceeded && clock != active->second->stage_clock.end()) {
        const double elapsed =
            std::chrono::duration<double>(Clock::now() - clock->second.first).count();
        const int64_t processed = done - clock->second.second;
        if (processed > 0 && elapsed > 0) {
          const double rate = processed / elapsed;
          out->set_bytes_per_second(rate);
          out->set_eta_seconds((p.bytes_total - done) / rate);
        }
      }
    }
    out->set_bytes_done(done);
    if (job.current_stage().empty() && p.state != store::StageState::kSucceeded) {
      job.set_current_stage(p.kind);
    }
  }
  job.set_task_attempts(attempts);
  return job;
}

absl::Status Scheduler::Impl::Publish(int64_t job_id) {
  absl::StatusOr<v1::Job> job = Snapshot(job_id);
  if (!job.ok()) return job.status();
  const auto active = active_.find(job_id);
  if (active != active_.end()) {
    uint64_t running = 0;
    for (const auto& [id, r] : active->second->running) running += r.second->load();
    active->second->published_bytes = running;
    active->second->published_ms = NowMs();
  }
  board_.Put(*job);
  return absl::OkStatus();
}

void Scheduler::Impl::PublishProgress() {
  const int64_t now = NowMs();
  for (auto& [id, job] : active_) {
    if (now - job->published_ms < kPublishEveryMs) continue;
    uint64_t running = 0;
    for (const auto& [task_id, r] : job->running) running += r.second->load();
    if (running == job->published_bytes) continue;
    if (absl::Status s = Publish(id); !s.ok()) Log(id, "error", std::string(s.message()));
  }
}

void Scheduler::Impl::RefreshMetrics() {
  metrics::Metrics* metrics = options_.metrics;
  if (metrics == nullptr) return;
  const std::map<std::string, int64_t> jobs = board_.CountByState();
  metrics->SetJobCounts(jobs);
  const auto pending = jobs.find("PENDING");
  metrics->SetQueueDepth(pending == jobs.end() ? 0 : pending->second);
  std::map<std::pair<std::string, std::string>, int64_t> tasks;
  for (const auto& [id, job] : active_) {
    absl::StatusOr<std::vector<store::TaskRow>> rows = store_->ListTasks(id);
    if (!rows.ok()) continue;
    for (const store::TaskRow& t : *rows) ++tasks[{t.stage_kind, store::TaskStateName(t.state)}];
  }
  metrics->SetTaskCounts(tasks);
  // Busy share per device name over the last kBusyWindow refreshes.
  const Clock::time_point now = Clock::now();
  std::map<std::string, std::pair<double, int>> busy;  // device -> (busy seconds, workers)
  for (auto& worker : workers_) {
    double total = worker->busy_seconds;
    if (worker->busy) total += std::chrono::duration<double>(now - worker->busy_since).count();
    busy[worker->device].first += total - worker->busy_sampled;
    busy[worker->device].second += 1;
    worker->busy_sampled = total;
  }
  const double interval = kMetricsEveryMs / 1000.0;
  for (const auto& [device, b] : busy) {
    std::deque<double>& window = busy_window_[device];
    window.push_back(std::min(1.0, b.first / (interval * b.second)));
    if (window.size() > kBusyWindow) window.pop_front();
    double sum = 0;
    for (double v : window) sum += v;
    metrics->SetDeviceBusyRatio(device, sum / window.size());
    // CPU workers use this process's memory; CUDA backends do not report theirs yet.
    if (device == "cpu") metrics->SetDeviceMemoryUsed(device, ResidentBytes());
  }
}

void Scheduler::Impl::Log(int64_t job_id, const std::string& kind, const std::string& message) {
  if (options_.log) options_.log(job_id, kind, message);
}

absl::StatusOr<v1::Job> Scheduler::Impl::DoSubmit(const std::string& request_id,
                                                  const pipeline::JobSpec& spec, bool* created) {
  *created = false;
  if (stopping_) {
    return WithReason(absl::UnavailableError("quantd is shutting down"), "SHUTTING_DOWN");
  }
  const std::string spec_json = pipeline::JobSpecToJson(spec);
  if (!request_id.empty()) {
    absl::StatusOr<std::optional<store::JobRow>> existing =
        store_->FindJobByRequestId(request_id);
    if (!existing.ok()) return existing.status();
    if (existing->has_value()) {
      if ((*existing)->spec_json != spec_json) {
        return WithReason(absl::AlreadyExistsError(absl::StrCat(
                              "request_id \"", request_id, "\" was used for job ",
                              (*existing)->id, " with another spec")),
                          "REQUEST_ID_REUSED");
      }
      std::optional<v1::Job> job = board_.Get((*existing)->id);
      if (job.has_value()) return *job;
      return Snapshot((*existing)->id);
    }
  }
  if (absl::StatusOr<std::vector<int>> w = WorkersFor(spec); !w.ok()) return w.status();
  if (options_.host_memory_bytes > 0 && spec.host_memory_bytes > options_.host_memory_bytes) {
    return WithReason(absl::InvalidArgumentError(absl::StrCat(
                          "spec.host_memory_bytes: ", spec.host_memory_bytes,
                          " exceeds this quantd's budget of ", options_.host_memory_bytes)),
                      "INVALID_SPEC");
  }
  const std::map<std::string, int64_t> counts = board_.CountByState();
  const auto pending = counts.find("PENDING");
  if (pending != counts.end() && pending->second >= options_.queue_limit) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "the queue is full: ", pending->second, " jobs are PENDING (limit ",
                          options_.queue_limit, ")")),
                      "QUEUE_FULL");
  }
  absl::StatusOr<int64_t> id = store_->CreateJob(request_id, spec_json, NowMs(), created);
  if (!id.ok()) return id.status();
  Log(*id, "state", absl::StrCat("PENDING (submitted): ", spec.source, " -> ", spec.output));
  reconsider_ = true;
  if (absl::Status s = Publish(*id); !s.ok()) return s;
  return *board_.Get(*id);
}

absl::StatusOr<v1::Job> Scheduler::Impl::DoCancel(int64_t job_id, bool pause,
                                                  const std::string& reason) {
  absl::StatusOr<store::JobRow> row = store_->GetJob(job_id);
  if (!row.ok()) return absl::IsNotFound(row.status()) ? NotFound(job_id) : row.status();
  const std::string final_reason = !reason.empty() ? reason : pause ? "paused" : "cancelled";
  const auto active = active_.find(job_id);
  if (active != active_.end()) {
    ActiveJob& job = *active->second;
    // A pause may become a cancel, not the other way round; a shutdown in progress wins.
    if (job.stop == Stop::kNone || (job.stop == Stop::kPause && !pause)) {
      job.stop = pause ? Stop::kPause : Stop::kCancel;
      job.stop_reason = final_reason;
      job.cancel.store(true);
      if (absl::Status s = SetState(job_id, JobState::kRunning, pause ? "pausing" : "cancelling",
                                    "");
          !s.ok()) {
        return s;
      }
    }
    return *board_.Get(job_id);
  }
  const char* name = store::JobStateName(row->state);
  switch (row->state) {
    case JobState::kSucceeded:
    case JobState::kCancelled:
      return Forbidden(absl::StrCat("job ", job_id, " is ", name, "; it cannot be ",
                                    pause ? "paused" : "cancelled"));
    case JobState::kPaused:
      if (pause) return *board_.Get(job_id);
      break;
    case JobState::kPending:
    case JobState::kFailed:
      if (pause) {
        return Forbidden(absl::StrCat("job ", job_id, " is ", name,
                                      "; only a RUNNING job can be paused"));
      }
      break;
    case JobState::kRunning:  // waiting for its devices after a restart
      break;
  }
  if (absl::Status s = SetState(job_id, pause ? JobState::kPaused : JobState::kCancelled,
                                final_reason, "");
      !s.ok()) {
    return s;
  }
  return *board_.Get(job_id);
}

absl::StatusOr<v1::Job> Scheduler::Impl::DoResume(int64_t job_id) {
  absl::StatusOr<store::JobRow> row = store_->GetJob(job_id);
  if (!row.ok()) return absl::IsNotFound(row.status()) ? NotFound(job_id) : row.status();
  if (row->state != JobState::kPaused && row->state != JobState::kFailed) {
    return Forbidden(absl::StrCat("job ", job_id, " is ", store::JobStateName(row->state),
                                  "; only a PAUSED or FAILED job can be resumed"));
  }
  if (stopping_) {
    return WithReason(absl::UnavailableError("quantd is shutting down"), "SHUTTING_DOWN");
  }
  absl::StatusOr<int> reset = store_->ResetFailedTasks(job_id, NowMs());
  if (!reset.ok()) return reset.status();
  if (absl::Status s = SetState(job_id, JobState::kPending, "resumed", ""); !s.ok()) return s;
  reconsider_ = true;
  return *board_.Get(job_id);
}

absl::Status Scheduler::Impl::DoDelete(int64_t job_id) {
  absl::StatusOr<store::JobRow> row = store_->GetJob(job_id);
  if (!row.ok()) return absl::IsNotFound(row.status()) ? NotFound(job_id) : row.status();
  if (row->state == JobState::kRunning || active_.count(job_id) != 0) {
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          "job ", job_id, " is RUNNING; cancel it first, then delete it")),
                      "JOB_RUNNING");
  }
  if (absl::Status s = store_->DeleteJob(job_id); !s.ok()) return s;
  Log(job_id, "state", "deleted");
  board_.Remove(job_id);
  return absl::OkStatus();
}

absl::StatusOr<v1::JobReport> Scheduler::Impl::DoReport(int64_t job_id, int worst) {
  absl::StatusOr<store::JobRow> row = store_->GetJob(job_id);
  if (!row.ok()) return absl::IsNotFound(row.status()) ? NotFound(job_id) : row.status();
  absl::StatusOr<std::vector<store::TensorStatsRow>> stats = store_->ListTensorStats(job_id);
  if (!stats.ok()) return stats.status();
  std::sort(stats->begin(), stats->end(),
            [](const store::TensorStatsRow& a, const store::TensorStatsRow& b) {
              return a.sqnr_db != b.sqnr_db ? a.sqnr_db < b.sqnr_db : a.tensor < b.tensor;
            });
  v1::JobReport report;
  report.set_job_id(job_id);
  report.set_state(JobStateToProto(row->state));
  report.set_tensors_total(static_cast<int64_t>(stats->size()));
  double sum = 0;
  for (const store::TensorStatsRow& s : *stats) sum += s.sqnr_db;
  if (!stats->empty()) {
    report.set_min_sqnr_db(stats->front().sqnr_db);
    report.set_mean_sqnr_db(sum / stats->size());
  }
  for (const store::TensorStatsRow& s : *stats) {
    if (worst > 0 && report.tensors_size() == worst) break;
    v1::TensorStats* t = report.add_tensors();
    t->set_tensor(s.tensor);
    t->set_rel_rmse(s.rel_rmse);
    t->set_sqnr_db(s.sqnr_db);
    t->set_max_abs_err(s.max_abs_err);
  }
  absl::StatusOr<std::vector<store::TaskRow>> tasks = store_->ListTasks(job_id);
  if (!tasks.ok()) return tasks.status();
  for (const store::TaskRow& t : *tasks) {
    if (t.stage_kind != pipeline::VerifyStage::kKind) continue;
    if (t.state != store::TaskState::kDone && t.state != store::TaskState::kFailed) continue;
    v1::RuleCheck* check = report.add_rules();
    check->set_name(TaskLabel(t));
    check->set_passed(t.state == store::TaskState::kDone);
    check->set_message(t.error);
  }
  return report;
}

absl::StatusOr<v1::Job> Scheduler::Impl::WaitUntilStopped(
    int64_t job_id, const std::function<bool(const v1::Job&)>& poll) {
  std::mutex mu;
  std::condition_variable cv;
  bool changed = false;
  const int64_t token = board_.Subscribe(job_id, [&] {
    std::lock_guard<std::mutex> lock(mu);
    changed = true;
    cv.notify_all();
  });
  absl::StatusOr<v1::Job> result;
  while (true) {
    std::optional<v1::Job> job = board_.Get(job_id);
    if (!job.has_value()) {
      result = NotFound(job_id);
      break;
    }
    result = *job;
    if (Stopped(job->state()) || (poll && !poll(*job))) break;
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      if (loop_ended_) {
        if (!fatal_.ok()) result = fatal_;
        break;
      }
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, kTick, [&] { return changed; });
    changed = false;
  }
  board_.Unsubscribe(token);
  return result;
}

Scheduler::Scheduler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Scheduler::~Scheduler() { impl_.reset(); }

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Start(std::unique_ptr<store::JobStore> store,
                                                            SchedulerOptions options) {
  std::unique_ptr<Scheduler> scheduler(new Scheduler(nullptr));
  scheduler->impl_ =
      std::make_unique<Impl>(&scheduler->board_, std::move(store), std::move(options));
  if (absl::Status s = scheduler->impl_->Init(); !s.ok()) return s;
  return scheduler;
}

absl::StatusOr<v1::Job> Scheduler::Submit(const std::string& request_id,
                                          const pipeline::JobSpec& spec, bool* created) {
  bool ignored = false;
  return impl_->Submit(request_id, spec, created != nullptr ? created : &ignored);
}

absl::StatusOr<v1::Job> Scheduler::Cancel(int64_t job_id, bool pause, const std::string& reason) {
  return impl_->Cancel(job_id, pause, reason);
}

absl::StatusOr<v1::Job> Scheduler::Resume(int64_t job_id) { return impl_->Resume(job_id); }

absl::Status Scheduler::Delete(int64_t job_id) { return impl_->Delete(job_id); }

absl::StatusOr<v1::JobReport> Scheduler::Report(int64_t job_id, int worst) {
  return impl_->Report(job_id, worst);
}

void Scheduler::Shutdown(std::chrono::milliseconds grace) { impl_->Shutdown(grace); }

absl::StatusOr<v1::Job> Scheduler::WaitUntilStopped(
    int64_t job_id, const std::function<bool(const v1::Job&)>& poll) {
  return impl_->WaitUntilStopped(job_id, poll);
}

}  // namespace quantd::scheduler
