// Dispatch and placement: leases a running job's next task, places it on a free worker of the job
// whose device fits the task's requirement (never two tasks whose memory sums past a device's
// capacity), and the worker threads that run tasks. Dispatch runs on the strand; WorkerLoop on its
// worker's thread.
#include <errno.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "server/scheduler/scheduler_impl.h"

namespace quantd::scheduler {

std::string DescribeRequirement(const compute::DeviceRequirement& req) {
  std::string out = req.gpu ? "a GPU" : "a device";
  if (req.memory_bytes > 0) absl::StrAppend(&out, " with ", req.memory_bytes, " bytes of memory");
  return out;
}

absl::Status Scheduler::Impl::Dispatch(ActiveJob& job) {
  if (job.stop != Stop::kNone || job.failure.has_value() || job.tasks == nullptr) {
    return absl::OkStatus();
  }
  FailIfNoWorker(job);
  if (job.failure.has_value()) return absl::OkStatus();
  while (true) {
    // A leased task that waits for a device goes first; new tasks are leased only while a worker
    // of the job is free and nothing waits.
    if (!job.parked.has_value()) {
      bool any_free = false;
      for (int w : job.workers) any_free |= !slots_[w].busy;
      if (!any_free) return absl::OkStatus();
      store::TaskLease lease;
      ASSIGN_OR_RETURN(std::optional<store::TaskRow> task,
                       store_->LeaseNextTask(job.id, owner_, clock_.NowMs(), options_.lease_ms,
                                             &lease));
      if (!task.has_value()) return absl::OkStatus();
      const compute::DeviceRequirement req = job.tasks->Requirement(*task);
      if (!EverFits(job, req)) {
        std::vector<std::string> names;
        for (int w : job.workers) {
          const std::string& name = workers_[w]->device->name();
          if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
        }
        const std::string message = absl::StrCat(
            task->stage_kind, " ", task->name, ": needs ", DescribeRequirement(req),
            "; none of the job's devices (", absl::StrJoin(names, ", "), ") has that");
        RETURN_IF_ERROR(store_->FailTask(lease, message, true, 0, clock_.NowMs()));
        Log(job.id, "task_failed", message);
        job.failure = absl::FailedPreconditionError(message);
        return absl::OkStatus();
      }
      job.parked = Parked{*std::move(task), lease, req};
    }
    const int worker = PlaceTask(job, job.parked->requirement);
    if (worker < 0) return absl::OkStatus();  // it waits for memory or a worker to free
    Parked parked = *std::move(job.parked);
    job.parked.reset();
    RETURN_IF_ERROR(
        StartTask(job, worker, std::move(parked.task), parked.lease, parked.requirement));
  }
}

absl::Status Scheduler::Impl::ClockStage(ActiveJob& job, const store::TaskRow& task) {
  if (job.stage_clock.count(task.stage_id) != 0) return absl::OkStatus();
  const int64_t now = clock_.NowMs();
  ASSIGN_OR_RETURN(std::vector<store::StageProgress> stages, store_->Progress(job.id));
  for (const store::StageProgress& p : stages) {
    if (p.stage_id == task.stage_id) job.stage_clock[p.stage_id] = {now, p.bytes_done};
  }
  return absl::OkStatus();
}

int Scheduler::Impl::PlaceTask(const ActiveJob& job, const compute::DeviceRequirement& req) const {
  for (int w : job.workers) {
    if (slots_[w].busy) continue;
    const compute::Device& device = *workers_[w]->device;
    const auto reserved = reserved_.find(device.name());
    if (compute::Fits(device, req, reserved == reserved_.end() ? 0 : reserved->second)) return w;
  }
  return -1;
}

bool Scheduler::Impl::EverFits(const ActiveJob& job, const compute::DeviceRequirement& req) const {
  for (int w : job.workers) {
    if (compute::Fits(*workers_[w]->device, req, 0)) return true;
  }
  return false;
}

absl::Status Scheduler::Impl::StartTask(ActiveJob& job, int worker, store::TaskRow task,
                                        store::TaskLease lease,
                                        const compute::DeviceRequirement& req) {
  const int64_t now = clock_.NowMs();
  RETURN_IF_ERROR(ClockStage(job, task));
  Work work;
  work.job_id = job.id;
  work.worker = worker;
  work.task = std::move(task);
  work.lease = lease;
  work.reserved_bytes = req.memory_bytes;
  work.tasks = job.tasks;
  work.run = std::make_shared<TaskRun>();
  work.run->heartbeat_ms.store(now);
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
  WorkerSlot& slot = slots_[worker];
  slot.busy = true;
  slot.busy_since_ms = now;
  reserved_[workers_[worker]->device->name()] += req.memory_bytes;
  InFlight& f = job.in_flight[work.task.id];
  f.work = work;
  f.returned = false;
  workers_[worker]->queue.Push(std::move(work));
  return absl::OkStatus();
}

void Scheduler::Impl::WorkerLoop(int index) {
  WorkerThread& worker = *workers_[index];
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
    TaskRun* run = work->run.get();
    metrics::Metrics* metrics = options_.metrics;
    Clock* clock = &clock_;
    absl::StatusOr<pipeline::TaskOutput> output = work->tasks->RunTask(
        work->task, *worker.device, &run->cancel,
        [run, clock, half, kill_mid, metrics](uint64_t n) {
          const uint64_t total = run->bytes.fetch_add(n, std::memory_order_relaxed) + n;
          run->heartbeat_ms.store(clock->NowMs(), std::memory_order_relaxed);
          if (metrics != nullptr) metrics->AddBytesRead(n);
          if (kill_mid && total >= half) KillSelf();
        });
    if (work->kill_written && output.ok()) KillSelf();
    // Once the loop ended nobody records it; its lease was requeued.
    auto result = std::make_shared<Result>(Result{*std::move(work), std::move(output)});
    Post(
        [this, result] {
          on_strand_.Assert();
          if (!ended_) OnTaskDone(std::move(result->work), std::move(result->output));
        },
        [] {});
  }
}

}  // namespace quantd::scheduler
