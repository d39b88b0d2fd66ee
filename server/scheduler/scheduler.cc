// Scheduler: start, shutdown, posting to the strand, the periodic timers, and the public class.
#include "server/scheduler/scheduler.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/pipeline/stored_job.h"
#include "server/scheduler/job_proto.h"
#include "server/scheduler/planning_stall.h"
#include "server/scheduler/scheduler_impl.h"

namespace quantd::scheduler {
namespace {

constexpr int64_t kPublishEveryMs = 100;   // progress snapshots of a job at most this often
constexpr int64_t kMetricsEveryMs = 1000;  // gauges refreshed this often

absl::Status ShuttingDown() {
  return WithReason(absl::UnavailableError("quantd is shutting down"), "SHUTTING_DOWN");
}

bool Stopped(v1::JobState s) {
  return s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED || s == v1::PAUSED;
}

}  // namespace

Scheduler::Impl::Impl(JobBoard* board, std::unique_ptr<store::JobStore> store,
                      SchedulerOptions options)
    : board_(*board),
      options_(std::move(options)),
      clock_(options_.clock != nullptr ? *options_.clock : SystemClock()),
      planner_(options_.planner != nullptr ? options_.planner
                                            : NewPipelinePlanner(options_.max_tasks_per_job)),
      strand_(boost::asio::make_strand(io_)),
      on_strand_(&strand_),
      store_(std::move(store)) {}

Scheduler::Impl::~Impl() { Shutdown(std::chrono::milliseconds(0)); }

absl::Status Scheduler::Impl::Init() {
  ASSIGN_OR_RETURN(kill_hook_, ParseKillHook(getenv("QUANTD_TEST_KILL_AT")));
  ASSIGN_OR_RETURN(const std::optional<PlanningStall> stall,
                   ParsePlanningStall(getenv("QUANTD_TEST_PLANNING_STALL")));
  if (stall.has_value()) planner_ = StallingPlanner(planner_, *stall);
  owner_ = absl::StrCat("quantd:", getpid());
  {
    absl::MutexLock lock(&report_mu_);
    ASSIGN_OR_RETURN(report_store_, store::JobStore::OpenReadOnly(store_->db().path()));
  }
  RETURN_IF_ERROR(pipeline::CreateWorkRoot(store_->db().path()));
  for (const std::string& name : options_.devices) {
    absl::StatusOr<std::unique_ptr<compute::Device>> device =
        options_.open_device
            ? options_.open_device(name)
            : compute::OpenDevice(name, {options_.cpu_threads, options_.host_memory_bytes});
    if (!device.ok()) return device.status();
    auto worker = std::make_unique<WorkerThread>();
    worker->device = *std::move(device);
    workers_.push_back(std::move(worker));
    slots_.emplace_back();
  }
  // Leases still in the store belong to a process that died: this one owns the state now.
  const int64_t now = clock_.NowMs();
  int64_t after = 0;
  while (true) {
    ASSIGN_OR_RETURN(std::vector<store::JobRow> jobs, store_->ListJobs(std::nullopt, after, 500));
    if (jobs.empty()) break;
    for (const store::JobRow& job : jobs) {
      after = job.id;
      states_[job.id] = job.state;
      if (job.state == store::JobState::kRunning) {
        ASSIGN_OR_RETURN(int n, store_->RequeueJobLeases(job.id, now));
        if (n > 0) Log(job.id, "recover", absl::StrCat("requeued ", n, " interrupted task(s)"));
      }
      RETURN_IF_ERROR(Publish(job.id));
    }
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i]->thread = std::thread([this, i] { WorkerLoop(static_cast<int>(i)); });
  }
  At(now + std::max<int64_t>(1, options_.lease_ms / 3), [this] {
    on_strand_.Assert();
    OnLeaseTimer();
  });
  At(now + kPublishEveryMs, [this] {
    on_strand_.Assert();
    OnPublishTimer();
  });
  if (options_.metrics != nullptr) {
    At(now + kMetricsEveryMs, [this] {
      on_strand_.Assert();
      OnMetricsTimer();
    });
  }
  boost::asio::post(strand_, [this] {
    on_strand_.Assert();
    Kick();
  });
  io_thread_ = std::thread([this] {
    io_.run();
    // Commands and results queued before the loop ended still get their answer (Unavailable).
    io_.restart();
    io_.poll();
  });
  return absl::OkStatus();
}

void Scheduler::Impl::Shutdown(std::chrono::milliseconds grace) {
  const auto until = std::chrono::steady_clock::now() + grace;
  {
    absl::MutexLock lock(&state_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  Post(
      [this, grace] {
        on_strand_.Assert();
        BeginStop(grace);
      },
      [] {});
  if (io_thread_.joinable()) io_thread_.join();
  // BeginStop asked every planning to stop; one that does not within the grace is left running.
  abandoned_planning_ = planning_.Close(until);
  // Nothing runs on the strand any more: the plannings that stopped within the grace ended; the
  // others count as interrupted when the job starts again.
  EndReturnedPlannings();
  reporting_.join();  // EndLoop closed report_store_: nothing more is posted
  for (auto& worker : workers_) worker->queue.Close();
  for (auto& worker : workers_) {
    if (worker->thread.joinable()) worker->thread.join();
  }
}

void Scheduler::Impl::Post(std::function<void()> fn, std::function<void()> closed) {
  {
    absl::MutexLock lock(&state_mu_);
    if (!closed_) {
      // Under the lock, so that nothing is posted after EndLoop closed the strand.
      boost::asio::post(strand_, std::move(fn));
      return;
    }
  }
  closed();
}

void Scheduler::Impl::At(int64_t at_ms, std::function<void()> fn) {
  std::weak_ptr<int> alive = alive_;
  clock_.CallAt(io_, at_ms, [this, alive, fn = std::move(fn)] {
    if (alive.lock() == nullptr) return;
    boost::asio::post(strand_, [this, fn] {
      on_strand_.Assert();
      if (!ended_) fn();
    });
  });
}

void Scheduler::Impl::OnLeaseTimer() {
  ForgetSilentWorkers();
  if (absl::Status s = FailJobsNoRemoteWorkerFits(); !s.ok()) {
    OnStoreError(s, "matching tasks to remote workers");
  } else if (absl::Status s = RenewAndExpireLeases(); !s.ok()) {
    OnStoreError(s, "renewing leases");
  } else {
    Kick();
  }
  At(clock_.NowMs() + std::max<int64_t>(1, options_.lease_ms / 3), [this] {
    on_strand_.Assert();
    OnLeaseTimer();
  });
}

void Scheduler::Impl::OnPublishTimer() {
  PublishProgress();
  At(clock_.NowMs() + kPublishEveryMs, [this] {
    on_strand_.Assert();
    OnPublishTimer();
  });
}

void Scheduler::Impl::OnMetricsTimer() {
  RefreshMetrics();
  At(clock_.NowMs() + kMetricsEveryMs, [this] {
    on_strand_.Assert();
    OnMetricsTimer();
  });
}

void Scheduler::Impl::BeginStop(std::chrono::milliseconds grace) {
  if (stopping_ || ended_) return;
  stopping_ = true;
  for (auto& [id, job] : active_) {
    if (job->stop == Stop::kNone) job->stop = Stop::kShutdown;
    for (auto& [task_id, f] : job->in_flight) f.work.run->cancel.store(true);
    if (job->planning != nullptr) job->planning->cancel.store(true);
  }
  At(clock_.NowMs() + grace.count(), [this] {
    on_strand_.Assert();
    MaybeEndLoop(/*force=*/true);
  });
  Kick();
  MaybeEndLoop(/*force=*/grace.count() == 0);
}

void Scheduler::Impl::MaybeEndLoop(bool force) {
  if (ended_ || !stopping_) return;
  bool running = !unrecorded_.empty();
  for (const auto& [id, job] : active_) running |= !job->in_flight.empty();
  if (running && !force) return;
  EndLoop(absl::OkStatus());
}

void Scheduler::Impl::EndLoop(const absl::Status& status) {
  ended_ = true;
  for (RemoteWaiter& waiter : remote_waiters_) waiter.done(ShuttingDown());
  remote_waiters_.clear();
  // Tasks still running stop at their next check; their leases go back to PENDING now (this
  // process will not record them), which is what a crash would leave too.
  for (auto& [id, job] : active_) {
    for (auto& [task_id, f] : job->in_flight) f.work.run->cancel.store(true);
    if (!status.ok() || (job->in_flight.empty() && !job->parked.has_value())) continue;
    if (absl::StatusOr<int> n = store_->RequeueJobLeases(id, clock_.NowMs()); !n.ok()) {
      Log(id, "error", absl::StrCat("requeueing its tasks: ", n.status().message()));
    }
  }
  if (!status.ok()) Log(0, "error", absl::StrCat("scheduler stopped: ", status.message()));
  {
    absl::MutexLock lock(&state_mu_);
    closed_ = true;
    fatal_ = status;
  }
  {
    absl::MutexLock lock(&report_mu_);
    report_store_.reset();
  }
  io_.stop();
}

void Scheduler::Impl::Log(int64_t job_id, const std::string& kind,
                          const std::string& message) const {
  if (options_.log) options_.log(job_id, kind, message);
}

void Scheduler::Impl::Submit(const std::string& request_id, const job::JobSpec& spec,
                             std::function<void(absl::StatusOr<v1::Job>, bool)> done) {
  Post(
      [this, request_id, spec, done] {
        on_strand_.Assert();
        bool created = false;
        absl::StatusOr<v1::Job> job = ended_ ? ShuttingDown() : DoSubmit(request_id, spec, &created);
        if (!ended_) Kick();
        done(std::move(job), created);
      },
      [done] { done(ShuttingDown(), false); });
}

void Scheduler::Impl::Cancel(int64_t job_id, bool pause, const std::string& reason,
                             JobDone done) {
  Post(
      [this, job_id, pause, reason, done] {
        on_strand_.Assert();
        absl::StatusOr<v1::Job> job = ended_ ? ShuttingDown() : DoCancel(job_id, pause, reason);
        if (!ended_) Kick();
        done(std::move(job));
      },
      [done] { done(ShuttingDown()); });
}

void Scheduler::Impl::Resume(int64_t job_id, JobDone done) {
  Post(
      [this, job_id, done] {
        on_strand_.Assert();
        absl::StatusOr<v1::Job> job = ended_ ? ShuttingDown() : DoResume(job_id);
        if (!ended_) Kick();
        done(std::move(job));
      },
      [done] { done(ShuttingDown()); });
}

void Scheduler::Impl::Delete(int64_t job_id, store::DeletePrecondition precondition,
                             std::function<void(absl::Status)> done) {
  Post(
      [this, job_id, precondition, done] {
        on_strand_.Assert();
        done(ended_ ? ShuttingDown() : DoDelete(job_id, precondition));
      },
      [done] { done(ShuttingDown()); });
}

void Scheduler::Impl::Report(int64_t job_id, int worst,
                             std::function<void(absl::StatusOr<v1::JobReport>)> done) {
  {
    absl::MutexLock lock(&report_mu_);
    if (report_store_ != nullptr) {
      // Under the lock, so that nothing is posted after EndLoop closed the connection (and
      // Shutdown joins reporting_).
      boost::asio::post(reporting_, [this, job_id, worst, done] {
        absl::StatusOr<v1::JobReport> report = ShuttingDown();
        {
          absl::MutexLock lock(&report_mu_);
          if (report_store_ != nullptr) {
            // One read transaction: every read of the report sees the same committed state.
            const absl::Status read = report_store_->db().ReadTransaction([&] {
              report_mu_.AssertHeld();  // held by the enclosing scope
              report = DoReport(job_id, worst);
              return report.status();
            });
            if (!read.ok()) report = read;
          }
        }
        done(std::move(report));
      });
      return;
    }
  }
  done(ShuttingDown());
}

absl::StatusOr<v1::Job> Scheduler::Impl::WaitUntilStopped(
    int64_t job_id, const std::function<bool(const v1::Job&)>& poll) {
  absl::Mutex mu;
  bool changed = false;
  const int64_t token = board_.Subscribe(job_id, [&] {
    absl::MutexLock lock(&mu);
    changed = true;
  });
  absl::StatusOr<v1::Job> result;
  while (true) {
    std::optional<v1::Job> job = board_.Get(job_id);
    if (!job.has_value()) {
      result = WithReason(absl::NotFoundError(absl::StrCat("job ", job_id, " not found")),
                          "JOB_NOT_FOUND");
      break;
    }
    result = *job;
    if (Stopped(job->state()) || (poll && !poll(*job))) break;
    {
      absl::MutexLock lock(&state_mu_);
      if (closed_) {
        if (!fatal_.ok()) result = fatal_;
        break;
      }
    }
    // Wakes on a change of the job, and every 100 ms for `poll` and the loop's end.
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(100));
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
  RETURN_IF_ERROR(scheduler->impl_->Init());
  return scheduler;
}

void Scheduler::SubmitAsync(const std::string& request_id, const job::JobSpec& spec,
                            std::function<void(absl::StatusOr<v1::Job>, bool)> done) {
  impl_->Submit(request_id, spec, std::move(done));
}
void Scheduler::CancelAsync(int64_t job_id, bool pause, const std::string& reason, JobDone done) {
  impl_->Cancel(job_id, pause, reason, std::move(done));
}
void Scheduler::ResumeAsync(int64_t job_id, JobDone done) {
  impl_->Resume(job_id, std::move(done));
}
void Scheduler::DeleteAsync(int64_t job_id, store::DeletePrecondition precondition,
                            std::function<void(absl::Status)> done) {
  impl_->Delete(job_id, precondition, std::move(done));
}
void Scheduler::RegisterWorkerAsync(const std::string& name, const std::string& peer,
                                    std::vector<RemoteDevice> devices,
                                    std::function<void(absl::StatusOr<RemoteRegistration>)> done) {
  impl_->RegisterWorker(name, peer, std::move(devices), std::move(done));
}
void Scheduler::LeaseRemoteAsync(
    const std::string& worker_id, int device, int64_t wait_ms, std::set<int64_t> open_jobs,
    std::function<void(absl::StatusOr<std::optional<RemoteLease>>)> done) {
  impl_->LeaseRemote(worker_id, device, wait_ms, std::move(open_jobs), std::move(done));
}
void Scheduler::RenewRemoteAsync(const std::string& worker_id, int64_t task_id, int attempt,
                                 uint64_t bytes_done,
                                 std::function<void(absl::StatusOr<bool>)> done) {
  impl_->RenewRemote(worker_id, task_id, attempt, bytes_done, std::move(done));
}
void Scheduler::CompleteRemoteAsync(const std::string& worker_id, int64_t task_id, int attempt,
                                    absl::StatusOr<pipeline::TaskOutput> output,
                                    std::function<void(absl::Status)> done) {
  impl_->CompleteRemote(worker_id, task_id, attempt, std::move(output), std::move(done));
}
void Scheduler::ListWorkersAsync(std::function<void(std::vector<RemoteWorkerView>)> done) {
  impl_->ListWorkers(std::move(done));
}
void Scheduler::ReportAsync(int64_t job_id, int worst,
                            std::function<void(absl::StatusOr<v1::JobReport>)> done) {
  impl_->Report(job_id, worst, std::move(done));
}

absl::StatusOr<v1::Job> Scheduler::Submit(const std::string& request_id, const job::JobSpec& spec,
                                          bool* created) {
  std::promise<absl::StatusOr<v1::Job>> answer;
  SubmitAsync(request_id, spec, [&](absl::StatusOr<v1::Job> job, bool was_created) {
    if (created != nullptr) *created = was_created;
    answer.set_value(std::move(job));
  });
  return answer.get_future().get();
}

absl::StatusOr<v1::Job> Scheduler::Cancel(int64_t job_id, bool pause, const std::string& reason) {
  std::promise<absl::StatusOr<v1::Job>> answer;
  CancelAsync(job_id, pause, reason, [&](absl::StatusOr<v1::Job> job) {
    answer.set_value(std::move(job));
  });
  return answer.get_future().get();
}

absl::StatusOr<v1::Job> Scheduler::Resume(int64_t job_id) {
  std::promise<absl::StatusOr<v1::Job>> answer;
  ResumeAsync(job_id, [&](absl::StatusOr<v1::Job> job) { answer.set_value(std::move(job)); });
  return answer.get_future().get();
}

absl::Status Scheduler::Delete(int64_t job_id, store::DeletePrecondition precondition) {
  std::promise<absl::Status> answer;
  DeleteAsync(job_id, precondition, [&](absl::Status s) { answer.set_value(std::move(s)); });
  return answer.get_future().get();
}

absl::StatusOr<v1::JobReport> Scheduler::Report(int64_t job_id, int worst) {
  std::promise<absl::StatusOr<v1::JobReport>> answer;
  ReportAsync(job_id, worst,
              [&](absl::StatusOr<v1::JobReport> r) { answer.set_value(std::move(r)); });
  return answer.get_future().get();
}

bool Scheduler::serving() const { return impl_->serving(); }

int Scheduler::abandoned_planning() const { return impl_->abandoned_planning(); }

void Scheduler::Shutdown(std::chrono::milliseconds grace) { impl_->Shutdown(grace); }

absl::StatusOr<v1::Job> Scheduler::WaitUntilStopped(
    int64_t job_id, const std::function<bool(const v1::Job&)>& poll) {
  return impl_->WaitUntilStopped(job_id, poll);
}

}  // namespace quantd::scheduler
