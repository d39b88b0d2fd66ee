// Remote workers (scheduler.h): registration, leases handed to Lease calls (long polls waiting on
// the strand), renewals and results fenced by the attempt number. Everything here runs on the
// strand; a remote attempt lives in its job's in-flight set like a local one, so lease expiry,
// recording, cancel and shutdown treat both alike.
#include <algorithm>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/pipeline/stored_job.h"
#include "server/scheduler/job_proto.h"
#include "server/scheduler/scheduler_impl.h"

namespace quantd::scheduler {
namespace {

// A worker that made no call for this many leases is forgotten (its tasks expired long before).
constexpr int64_t kForgetAfterLeases = 3;

absl::Status ShuttingDown() {
  return WithReason(absl::UnavailableError("quantd is shutting down"), "SHUTTING_DOWN");
}

absl::Status LeaseLost(int64_t task_id, int attempt) {
  return WithReason(absl::FailedPreconditionError(absl::StrCat(
                        "task ", task_id, " attempt ", attempt,
                        " no longer holds its lease (it expired, or the job stopped); the "
                        "result is not recorded")),
                    "LEASE_LOST");
}

// A remote worker's output_path must be the job's output directory or its BF16 copy's (export),
// or a file directly in one ("" for none): a worker records nothing elsewhere.
absl::Status CheckOutputPath(const v1::JobSpec& spec, const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  for (const std::string* dir : {&spec.output(), &spec.materialize_bf16()}) {
    if (!dir->empty() && path == *dir) return absl::OkStatus();
    if (dir->empty() || path.size() <= dir->size() + 1 || path.compare(0, dir->size(), *dir) != 0 ||
        path[dir->size()] != '/') {
      continue;
    }
    const std::string name = path.substr(dir->size() + 1);
    if (name.find('/') == std::string::npos && name != "." && name != "..") return absl::OkStatus();
  }
  return WithReason(
      absl::InvalidArgumentError("output_path: not a file directly in the job's output or "
                                 "materialize_bf16 directory"),
      "INVALID_REQUEST");
}

// What a worker that holds the job already needs with a lease of task `leased`: that task and
// the tasks it depends on, directly or not, whose outputs are all its stage may read
// (StageContext::recorded_output: export the quantize shards, verify its shard). The whole plan
// goes only with the job itself, which the worker checks against the plan it builds from the
// source (PreparedJob::OpenForWorker): a quantize or verify lease of a 1,000-task plan carries
// two or three rows instead of a thousand.
std::vector<store::TaskRow> TasksToRun(std::vector<store::TaskRow> tasks,
                                       const std::vector<std::pair<int64_t, int64_t>>& deps,
                                       int64_t leased) {
  std::multimap<int64_t, int64_t> on;  // task -> a task it depends on
  for (const auto& [task, dep] : deps) on.emplace(task, dep);
  std::set<int64_t> needed = {leased};
  std::vector<int64_t> todo = {leased};
  while (!todo.empty()) {
    const int64_t id = todo.back();
    todo.pop_back();
    for (auto [it, end] = on.equal_range(id); it != end; ++it) {
      if (needed.insert(it->second).second) todo.push_back(it->second);
    }
  }
  std::erase_if(tasks, [&](const store::TaskRow& t) { return needed.count(t.id) == 0; });
  return tasks;
}

}  // namespace

void Scheduler::Impl::RegisterWorker(const std::string& name, const std::string& peer,
                                     std::vector<RemoteDevice> devices,
                                     std::function<void(absl::StatusOr<RemoteRegistration>)> done) {
  Post(
      [this, name, peer, devices = std::move(devices), done] {
        on_strand_.Assert();
        if (ended_ || stopping_) return done(ShuttingDown());
        // A worker that registers again under its name (it restarted) replaces its old entry;
        // the old attempts keep their leases until they expire.
        for (auto it = remote_workers_.begin(); it != remote_workers_.end();) {
          it = it->second.name == name ? remote_workers_.erase(it) : std::next(it);
        }
        const int64_t now = clock_.NowMs();
        RemoteWorker worker;
        worker.id = absl::StrCat(next_worker_++, "-", owner_, "-", now);
        worker.name = name;
        worker.peer = peer;
        worker.devices = devices;
        worker.registered_ms = now;
        worker.last_seen_ms = now;
        const std::string id = worker.id;
        remote_workers_.emplace(id, std::move(worker));
        Log(0, "worker",
            absl::StrCat("worker ", name, " registered from ", peer, " with ", devices.size(),
                         " device(s)"));
        if (options_.metrics != nullptr) {
          options_.metrics->SetWorkersConnected(static_cast<int64_t>(remote_workers_.size()));
        }
        done(RemoteRegistration{id, options_.lease_ms});
      },
      [done] { done(ShuttingDown()); });
}

void Scheduler::Impl::LeaseRemote(
    const std::string& worker_id, int device, int64_t wait_ms, std::set<int64_t> open_jobs,
    std::function<void(absl::StatusOr<std::optional<RemoteLease>>)> done) {
  Post(
      [this, worker_id, device, wait_ms, open_jobs = std::move(open_jobs), done] {
        on_strand_.Assert();
        if (ended_) return done(ShuttingDown());
        absl::StatusOr<RemoteWorker*> worker = SeeWorker(worker_id);
        if (!worker.ok()) return done(worker.status());
        if (device < 0 || device >= static_cast<int>((*worker)->devices.size())) {
          return done(
              WithReason(absl::InvalidArgumentError(absl::StrCat(
                             "device: ", device, " is not the index of a registered device (0 to ",
                             (*worker)->devices.size() - 1, ")")),
                         "INVALID_REQUEST"));
        }
        const int64_t deadline = clock_.NowMs() + wait_ms;
        remote_waiters_.push_back(RemoteWaiter{worker_id, device, deadline, open_jobs, done});
        At(deadline, [this] {
          on_strand_.Assert();
          ServeRemoteWaiters();
        });
        ServeRemoteWaiters();
      },
      [done] { done(ShuttingDown()); });
}

void Scheduler::Impl::RenewRemote(const std::string& worker_id, int64_t task_id, int attempt,
                                  uint64_t bytes_done,
                                  std::function<void(absl::StatusOr<bool>)> done) {
  Post(
      [this, worker_id, task_id, attempt, bytes_done, done] {
        on_strand_.Assert();
        if (ended_) return done(ShuttingDown());
        if (absl::StatusOr<RemoteWorker*> worker = SeeWorker(worker_id); !worker.ok()) {
          return done(worker.status());
        }
        InFlight* f = FindRemoteAttempt(worker_id, task_id, attempt, "renew");
        if (f == nullptr) return done(LeaseLost(task_id, attempt));
        TaskRun& run = *f->work.run;
        const uint64_t bytes = std::min(
            bytes_done, static_cast<uint64_t>(std::max<int64_t>(0, f->work.task.bytes_total)));
        const uint64_t before = run.bytes.exchange(std::max(bytes, run.bytes.load()));
        if (options_.metrics != nullptr && bytes > before) {
          options_.metrics->AddBytesRead(bytes - before);
        }
        run.heartbeat_ms.store(clock_.NowMs());
        done(run.cancel.load());
      },
      [done] { done(ShuttingDown()); });
}

void Scheduler::Impl::CompleteRemote(const std::string& worker_id, int64_t task_id, int attempt,
                                     absl::StatusOr<pipeline::TaskOutput> output,
                                     std::function<void(absl::Status)> done) {
  auto result = std::make_shared<absl::StatusOr<pipeline::TaskOutput>>(std::move(output));
  Post(
      [this, worker_id, task_id, attempt, result, done] {
        on_strand_.Assert();
        if (ended_) return done(ShuttingDown());
        if (absl::StatusOr<RemoteWorker*> worker = SeeWorker(worker_id); !worker.ok()) {
          return done(worker.status());
        }
        InFlight* f =
            FindRemoteAttempt(worker_id, task_id, attempt, result->ok() ? "complete" : "fail");
        if (f == nullptr) return done(LeaseLost(task_id, attempt));
        if (result->ok()) {
          if (absl::Status s = CheckOutputPath(active_.at(f->work.job_id)->spec, (*result)->path);
              !s.ok()) {
            return done(s);
          }
        }
        // Recorded exactly as a local worker's result; a store that refuses it now keeps it for
        // a retry (RecordPending), so the worker's call is answered either way.
        f->returned = true;
        unrecorded_.push_back(Result{f->work, std::move(*result)});
        RecordPending();
        done(absl::OkStatus());
      },
      [done] { done(ShuttingDown()); });
}

void Scheduler::Impl::ListWorkers(std::function<void(std::vector<RemoteWorkerView>)> done) {
  Post(
      [this, done] {
        on_strand_.Assert();
        std::vector<RemoteWorkerView> views;
        for (const auto& [id, worker] : remote_workers_) {
          RemoteWorkerView view;
          view.name = worker.name;
          view.peer = worker.peer;
          view.devices = worker.devices;
          view.tasks_leased = worker.tasks_leased;
          view.registered_ms = worker.registered_ms;
          view.last_seen_ms = worker.last_seen_ms;
          for (const auto& [job_id, job] : active_) {
            for (const auto& [task_id, f] : job->in_flight) {
              if (f.work.remote == id && !f.returned) {
                view.tasks.push_back(absl::StrCat("job ", job_id, ": ", TaskLabel(f.work.task)));
              }
            }
          }
          views.push_back(std::move(view));
        }
        std::sort(
            views.begin(), views.end(),
            [](const RemoteWorkerView& a, const RemoteWorkerView& b) { return a.name < b.name; });
        done(std::move(views));
      },
      [done] { done({}); });
}

absl::StatusOr<Scheduler::Impl::RemoteWorker*> Scheduler::Impl::SeeWorker(const std::string& id) {
  const auto it = remote_workers_.find(id);
  if (it == remote_workers_.end()) {
    return WithReason(absl::NotFoundError("worker_id: not registered with this quantd (it "
                                          "restarted, or forgot a silent worker); register again"),
                      "WORKER_UNKNOWN");
  }
  it->second.last_seen_ms = clock_.NowMs();
  return &it->second;
}

absl::StatusOr<std::optional<RemoteLease>> Scheduler::Impl::LeaseFor(
    RemoteWorker& worker, int device, const std::set<int64_t>& open_jobs) {
  if (stopping_) return std::nullopt;
  const RemoteDevice& d = worker.devices[device];
  store::DeviceCapacity capacity;
  capacity.gpu = d.gpu;
  capacity.memory_bytes = d.memory_bytes;
  const int64_t now = clock_.NowMs();
  for (auto& [job_id, job] : active_) {
    if (job->stop != Stop::kNone || job->failure.has_value() || job->tasks == nullptr ||
        !job->tasks->RunsRemotely()) {
      continue;
    }
    store::TaskLease lease;
    ASSIGN_OR_RETURN(std::optional<store::TaskRow> task,
                     store_->LeaseNextTask(job_id, WorkerLeaseOwner(worker.name), now,
                                           options_.lease_ms, &lease, capacity));
    if (!task.has_value()) continue;
    RETURN_IF_ERROR(ClockStage(*job, *task));
    Work work;
    work.job_id = job_id;
    work.worker = -1;
    work.remote = worker.id;
    work.task = *task;
    work.lease = lease;
    work.tasks = job->tasks;
    work.run = std::make_shared<TaskRun>();
    work.run->heartbeat_ms.store(now);
    // QUANTD_TEST_KILL_AT (run_job.h) at the coordinator: `start` and `done` mean the same for
    // a remote task; `mid` and `written` happen on the worker (its own hook).
    const int64_t n = ++started_[task->stage_kind];
    if (kill_hook_.has_value() && kill_hook_->stage == task->stage_kind && kill_hook_->n == n) {
      if (kill_hook_->when == KillHook::When::kStart) KillSelf();
      if (kill_hook_->when == KillHook::When::kDone) kill_when_done_.insert(task->id);
    }
    InFlight& f = job->in_flight[task->id];
    f.work = std::move(work);
    f.returned = false;
    ++worker.tasks_leased;
    if (options_.metrics != nullptr) options_.metrics->WorkerTaskLeased(worker.name);
    Log(job_id, "task_leased",
        absl::StrCat(TaskLabel(*task), " (attempt ", task->attempt, ") to worker ", worker.name,
                     " ", d.name));

    RemoteLease out;
    out.job_id = job_id;
    out.task = *std::move(task);
    ASSIGN_OR_RETURN(out.tasks, store_->ListTasks(job_id));
    ASSIGN_OR_RETURN(store::JobRow row, store_->GetJob(job_id));
    out.job_created_ms = row.created_ms;
    if (open_jobs.count(job_id) != 0) {
      ASSIGN_OR_RETURN(auto deps, store_->ListDependencies(job_id));
      out.tasks = TasksToRun(std::move(out.tasks), deps, out.task.id);
    } else {
      ASSIGN_OR_RETURN(pipeline::StoredJob stored, pipeline::ReadStoredJob(*store_, job_id));
      out.job_included = true;
      out.job_store = stored.identity.store;
      out.spec_json = row.spec_json;
      out.work_dir = stored.work_dir;
      ASSIGN_OR_RETURN(std::vector<store::AmaxRow> amax, store_->ListAmax(job_id));
      for (store::AmaxRow& row : amax) {
        if (row.kind == "input") out.input_amax.push_back(std::move(row));
      }
    }
    return out;
  }
  return std::nullopt;
}

void Scheduler::Impl::ServeRemoteWaiters() {
  if (ended_ || remote_waiters_.empty()) return;
  const int64_t now = clock_.NowMs();
  for (auto it = remote_waiters_.begin(); it != remote_waiters_.end();) {
    const auto worker = remote_workers_.find(it->worker_id);
    if (worker == remote_workers_.end()) {
      auto done = std::move(it->done);
      const std::string id = it->worker_id;
      it = remote_waiters_.erase(it);
      done(SeeWorker(id).status());
      continue;
    }
    absl::StatusOr<std::optional<RemoteLease>> lease =
        LeaseFor(worker->second, it->device, it->open_jobs);
    if (!lease.ok()) {
      OnStoreError(lease.status(), "leasing a task to a remote worker");
      return;
    }
    if (lease->has_value() || now >= it->deadline_ms || stopping_) {
      auto done = std::move(it->done);
      it = remote_waiters_.erase(it);
      done(*std::move(lease));
      continue;
    }
    ++it;
  }
}

Scheduler::Impl::InFlight* Scheduler::Impl::FindRemoteAttempt(const std::string& worker_id,
                                                              int64_t task_id, int attempt,
                                                              const char* call) {
  int64_t job_of_task = 0;
  for (auto& [job_id, job] : active_) {
    const auto f = job->in_flight.find(task_id);
    if (f == job->in_flight.end()) continue;
    job_of_task = job_id;
    if (f->second.work.remote == worker_id && f->second.work.lease.attempt == attempt &&
        !f->second.returned) {
      return &f->second;
    }
  }
  if (options_.metrics != nullptr) options_.metrics->StaleWorkerCall(call);
  const auto worker = remote_workers_.find(worker_id);
  Log(job_of_task, "task_late",
      absl::StrCat(call, " of task ", task_id, " attempt ", attempt, " from worker ",
                   worker == remote_workers_.end() ? std::string("?") : worker->second.name,
                   " refused: the attempt lost its lease"));
  return nullptr;
}

void Scheduler::Impl::ForgetSilentWorkers() {
  const int64_t now = clock_.NowMs();
  for (auto it = remote_workers_.begin(); it != remote_workers_.end();) {
    if (now - it->second.last_seen_ms > kForgetAfterLeases * options_.lease_ms) {
      Log(0, "worker",
          absl::StrCat("worker ", it->second.name, " silent for ",
                       (now - it->second.last_seen_ms) / 1000, " s; forgotten"));
      it = remote_workers_.erase(it);
    } else {
      ++it;
    }
  }
  if (options_.metrics != nullptr) {
    options_.metrics->SetWorkersConnected(static_cast<int64_t>(remote_workers_.size()));
  }
}

void Scheduler::Impl::FailIfNoWorker(ActiveJob& job) {
  if (!workers_.empty() || job.tasks->RunsRemotely()) return;
  job.failure = pipeline::WithJobReason(
      absl::FailedPreconditionError(
          "this quantd runs no local worker (--devices none), and remote workers run only jobs "
          "whose stages keep no state between tasks; run this job on a quantd with devices"),
      "NO_WORKER");
  Log(job.id, "task_failed", std::string(job.failure->message()));
}

// The rule for a job that no registered remote worker can run (issue 22 item 1). It applies only
// where remote workers are the sole way to run tasks: a coordinator without local workers, a job
// whose tasks run remotely, and at least one registered worker. Remote leases go through
// LeaseNextTask's capacity filter (LeaseFor), so a task that fits no registered device would stay
// PENDING for ever; instead, when a runnable task (PENDING, every dependency DONE, as LeaseNextTask
// picks them; a task in retry back-off counts too) needs what no device of any registered worker
// has (a GPU, or more memory than the device's total: compute::Fits with nothing reserved), the
// job fails with reason NO_WORKER, naming the task and the largest registered device. Tasks whose
// dependencies are not DONE yet are not judged: workers for a later stage may still come.
// With no worker registered the job waits (workers may come later; the "no worker connected"
// alert, deploy/prometheus/alerts.yml, is for that), and the rule is judged only once the newest
// registration is a lease old, so that workers started together (a Slurm array, an Indexed Job)
// have registered before a small one that came first is judged alone. Runs on the lease timer.
absl::Status Scheduler::Impl::FailJobsNoRemoteWorkerFits() {
  if (!workers_.empty() || remote_workers_.empty()) return absl::OkStatus();
  const int64_t now = clock_.NowMs();
  const RemoteWorker* largest_worker = nullptr;  // the largest device of any kind, and of GPUs
  const RemoteDevice* largest = nullptr;
  const RemoteWorker* largest_gpu_worker = nullptr;
  const RemoteDevice* largest_gpu = nullptr;
  for (const auto& [id, worker] : remote_workers_) {
    if (now - worker.registered_ms < options_.lease_ms) return absl::OkStatus();
    for (const RemoteDevice& d : worker.devices) {
      if (largest == nullptr || d.memory_bytes > largest->memory_bytes) {
        largest = &d;
        largest_worker = &worker;
      }
      if (d.gpu && (largest_gpu == nullptr || d.memory_bytes > largest_gpu->memory_bytes)) {
        largest_gpu = &d;
        largest_gpu_worker = &worker;
      }
    }
  }
  for (auto& [job_id, job] : active_) {
    if (job->stop != Stop::kNone || job->failure.has_value() || job->tasks == nullptr ||
        !job->tasks->RunsRemotely()) {
      continue;
    }
    ASSIGN_OR_RETURN(std::vector<store::TaskRow> tasks, store_->ListTasks(job_id));
    ASSIGN_OR_RETURN(auto deps, store_->ListDependencies(job_id));
    std::map<int64_t, store::TaskState> state;
    for (const store::TaskRow& t : tasks) state[t.id] = t.state;
    std::set<int64_t> waiting;  // tasks with a dependency not DONE
    for (const auto& [task, on] : deps) {
      if (state[on] != store::TaskState::kDone) waiting.insert(task);
    }
    for (const store::TaskRow& t : tasks) {
      if (t.state != store::TaskState::kPending || waiting.count(t.id) != 0) continue;
      const compute::DeviceRequirement& req = t.requirement;
      const RemoteDevice* best = req.gpu ? largest_gpu : largest;
      if (best != nullptr && req.memory_bytes <= best->memory_bytes) continue;
      std::string message = absl::StrCat(TaskLabel(t), ": needs ", DescribeRequirement(req), "; ");
      if (best == nullptr) {
        absl::StrAppend(&message, "none of the ", remote_workers_.size(),
                        " registered worker(s) has a GPU");
      } else {
        absl::StrAppend(&message, "the largest ", req.gpu ? "GPU" : "device", " of the ",
                        remote_workers_.size(), " registered worker(s) has ", best->memory_bytes,
                        " bytes (worker ", (req.gpu ? largest_gpu_worker : largest_worker)->name,
                        ", ", best->name, ")");
      }
      absl::StrAppend(&message, ", and this quantd runs no local worker (--devices none)");
      job->failure = pipeline::WithJobReason(absl::FailedPreconditionError(message), "NO_WORKER");
      Log(job_id, "task_failed", message);
      break;
    }
  }
  return absl::OkStatus();
}

}  // namespace quantd::scheduler
