// Recording: task results into the store (in order, retried while the store refuses them), retries
// of failed tasks after their back-off, lease renewal and expiry, and what a failing store does.
// Everything here runs on the strand.
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/pipeline/prepared_job.h"
#include "server/pipeline/stage.h"
#include "server/scheduler/scheduler_impl.h"

namespace quantd::scheduler {
namespace {

// A result or command that the store refused is tried again this much later.
constexpr int64_t kStoreRetryMs = 1000;

}  // namespace

void Scheduler::Impl::OnTaskDone(Work work, absl::StatusOr<pipeline::TaskOutput> output) {
  WorkerSlot& slot = slots_[work.worker];
  slot.busy = false;
  const double busy = (clock_.NowMs() - slot.busy_since_ms) / 1000.0;
  slot.busy_seconds += busy;
  reserved_[workers_[work.worker]->device->name()] -= work.reserved_bytes;
  if (options_.metrics != nullptr) {
    options_.metrics->AddDeviceBusy(workers_[work.worker]->device->name(), busy);
  }
  const auto job = active_.find(work.job_id);
  const auto f = job == active_.end() ? std::map<int64_t, InFlight>::iterator()
                                      : job->second->in_flight.find(work.task.id);
  if (job == active_.end() || f == job->second->in_flight.end() ||
      f->second.work.run != work.run) {
    // Its lease expired and the task went to another worker (or the job stopped meanwhile).
    Log(work.job_id, "task_late",
        absl::StrCat(TaskLabel(work.task), ": result of an expired lease ignored"));
    Kick();
    return;
  }
  f->second.returned = true;
  unrecorded_.push_back(Result{std::move(work), std::move(output)});
  RecordPending();
}

void Scheduler::Impl::RecordPending() {
  while (!unrecorded_.empty()) {
    if (absl::Status s = Record(unrecorded_.front()); !s.ok()) {
      OnStoreError(s, absl::StrCat("recording ", TaskLabel(unrecorded_.front().work.task)));
      return;
    }
    const Work& work = unrecorded_.front().work;
    const auto job = active_.find(work.job_id);
    if (job != active_.end()) job->second->in_flight.erase(work.task.id);
    const int64_t task_id = work.task.id;
    unrecorded_.pop_front();
    if (kill_when_done_.count(task_id) != 0) KillSelf();
  }
  Kick();
}

absl::Status Scheduler::Impl::Record(const Result& result) {
  const Work& work = result.work;
  const auto it = active_.find(work.job_id);
  if (it == active_.end()) return absl::OkStatus();
  ActiveJob& job = *it->second;
  const store::TaskRow& task = work.task;
  metrics::Metrics* metrics = options_.metrics;
  const int64_t now = clock_.NowMs();
  const absl::StatusOr<pipeline::TaskOutput>& output = result.output;
  if (output.ok()) {
    // The completion and the stage's record commit in one transaction; completing a task again
    // records nothing twice.
    absl::Status completed =
        work.tasks->Complete(*store_, work.lease, task, *output, now, work.remote.empty());
    if (absl::IsFailedPrecondition(completed)) {  // the store gave the task to someone else
      Log(job.id, "task_late", absl::StrCat(TaskLabel(task), ": ", completed.message()));
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(completed);
    std::string message = absl::StrCat(TaskLabel(task), " done");
    if (!output->path.empty()) {
      absl::StrAppend(&message, ": ", output->path, ", ", output->bytes, " bytes");
    }
    if (!output->summary.empty()) absl::StrAppend(&message, " (", output->summary, ")");
    RETURN_IF_ERROR(store_->AddEvent(job.id, "task_done", message, now));
    Log(job.id, "task_done", message);
    if (metrics != nullptr) {
      metrics->TaskAttempt(task.stage_kind, "done");
      metrics->AddBytesWritten(output->bytes);
      for (const pipeline::TaskFigure& figure : output->figures) {
        metrics->AddTaskFigure(figure.metric, figure.value);
      }
      ASSIGN_OR_RETURN(std::vector<store::StageProgress> stages, store_->Progress(job.id));
      for (const store::StageProgress& p : stages) {
        if (p.stage_id != task.stage_id || p.state != store::StageState::kSucceeded ||
            !p.started_ms.has_value() || !p.finished_ms.has_value() ||
            !job.stages_timed.insert(p.stage_id).second) {
          continue;
        }
        metrics->ObserveStageDuration(p.kind, (*p.finished_ms - *p.started_ms) / 1000.0);
      }
    }
    return Publish(job.id);
  }
  const absl::Status& error = output.status();
  // Interrupted by a cancel: the task stays leased and is requeued when the job stops.
  if (error.code() == absl::StatusCode::kCancelled && work.run->cancel.load()) {
    if (metrics != nullptr) metrics->TaskAttempt(task.stage_kind, "interrupted");
    return Publish(job.id);
  }
  // Stage errors usually start with the shard's name already.
  const std::string message =
      absl::StrCat(absl::StartsWith(error.message(), task.name) ? task.stage_kind : TaskLabel(task),
                   ": ", error.message());
  if (const std::optional<int64_t> delay_ms = pipeline::RetryDelayMs(error.code(), task.attempt)) {
    absl::Status failed = store_->FailTask(work.lease, message, false, now + *delay_ms, now);
    if (absl::IsFailedPrecondition(failed)) return absl::OkStatus();  // recorded already
    RETURN_IF_ERROR(failed);
    const std::string line =
        absl::StrCat(message, "; retrying in ", *delay_ms / 1000, " s (attempt ", task.attempt,
                     " of ", pipeline::kMaxAttempts, ")");
    Log(job.id, "task_retry", line);
    if (metrics != nullptr) {
      metrics->TaskAttempt(task.stage_kind, "retried");
      metrics->TaskRetried(absl::StatusCodeToString(error.code()));
    }
    RETURN_IF_ERROR(store_->AddEvent(job.id, "task_retry", line, now));
    At(now + *delay_ms, [this] {
      on_strand_.Assert();
      Kick();
    });
    return Publish(job.id);
  }
  absl::Status failed = store_->FailTask(work.lease, message, true, 0, now);
  if (absl::IsFailedPrecondition(failed)) return absl::OkStatus();  // recorded already
  RETURN_IF_ERROR(failed);
  Log(job.id, "task_failed", message);
  if (metrics != nullptr) metrics->TaskAttempt(task.stage_kind, "failed");
  if (!job.failure.has_value()) {
    job.failure = absl::Status(error.code(), message);
    if (const auto reason = error.GetPayload(pipeline::kJobReasonPayload)) {
      job.failure->SetPayload(pipeline::kJobReasonPayload, *reason);
    }
  }
  RETURN_IF_ERROR(store_->AddEvent(job.id, "task_failed", message, now));
  return Publish(job.id);
}

absl::Status Scheduler::Impl::RenewAndExpireLeases() {
  const int64_t now = clock_.NowMs();
  for (auto& [id, job] : active_) {
    for (auto it = job->in_flight.begin(); it != job->in_flight.end();) {
      InFlight& f = it->second;
      // A task that reported nothing for a whole lease is presumed hung: it loses its lease (the
      // store requeues it below) and is asked to stop; a result it still returns is ignored.
      if (!f.returned && now - f.work.run->heartbeat_ms.load() > options_.lease_ms) {
        f.work.run->cancel.store(true);
        if (options_.metrics != nullptr) options_.metrics->LeaseExpired();
        const int expiries = ++job->lease_expiries[f.work.task.id];
        const std::string label = TaskLabel(f.work.task);
        if (expiries >= options_.lease_expiry_limit) {
          const std::string message = absl::StrCat(
              label, ": no progress for ", options_.lease_ms, " ms, ", expiries,
              " times; the job fails instead of requeuing the task again");
          Log(id, "lease_expired", message);
          if (!job->failure.has_value()) {
            job->failure = pipeline::WithJobReason(absl::DeadlineExceededError(message),
                                                   "LEASE_EXPIRED");
          }
          RETURN_IF_ERROR(store_->AddEvent(id, "lease_expired", message, now));
        } else {
          Log(id, "lease_expired",
              absl::StrCat(label, ": no progress for ", options_.lease_ms, " ms (", expiries,
                           " of ", options_.lease_expiry_limit,
                           "); its lease expired and the task is requeued"));
        }
        it = job->in_flight.erase(it);
        continue;
      }
      RETURN_IF_ERROR(store_->RenewLease(f.work.lease, now, options_.lease_ms));
      ++it;
    }
    if (job->parked.has_value()) {
      RETURN_IF_ERROR(store_->RenewLease(job->parked->lease, now, options_.lease_ms));
    }
  }
  ASSIGN_OR_RETURN(int requeued, store_->RequeueExpiredLeases(now));
  if (requeued > 0) Log(0, "lease_expired", absl::StrCat("requeued ", requeued, " task(s)"));
  return absl::OkStatus();
}

void Scheduler::Impl::OnStoreError(const absl::Status& error, const std::string& what) {
  const int64_t now = clock_.NowMs();
  if (store_failing_since_ms_ == 0) store_failing_since_ms_ = now;
  const std::string line = absl::StrCat(what, ": ", error.message());
  if (now - store_failing_since_ms_ >= options_.store_retry_limit_ms) {
    Log(0, "store_error", line);
    const absl::Status unusable = absl::UnavailableError(
        absl::StrCat("the job store failed for ", (now - store_failing_since_ms_) / 1000,
                     " s; last error (", what, "): ", error.message()));
    serving_.store(false);
    EndLoop(unusable);
    if (options_.on_store_unusable) options_.on_store_unusable(unusable);
    return;
  }
  if (!store_retry_armed_) {
    store_retry_armed_ = true;
    At(now + kStoreRetryMs, [this] {
      on_strand_.Assert();
      store_retry_armed_ = false;
      reconsider_ = true;
      RecordPending();
    });
  }
  // Logged once the retry is armed, so that whoever acts on the line (a test moving a fake clock)
  // finds the timer set.
  Log(0, "store_error", line);
}

void Scheduler::Impl::OnStoreOk() {
  if (unrecorded_.empty()) store_failing_since_ms_ = 0;
}

}  // namespace quantd::scheduler
