// The job lifecycle: one step of the scheduler's loop (Step, Kick), and how a job ends
// (MaybeFinish, Release, SetState): its leases requeued, its workers released, its final state
// committed and published, its work directory removed when it cannot resume. Everything here runs
// on the strand.
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/pipeline/stage.h"
#include "server/pipeline/stored_job.h"
#include "server/scheduler/scheduler_impl.h"

namespace quantd::scheduler {

using store::JobState;

absl::Status Scheduler::Impl::MaybeFinish(ActiveJob& job, bool* finished) {
  *finished = false;
  if (!job.in_flight.empty()) return absl::OkStatus();
  const int64_t now = clock_.NowMs();
  if (job.stop != Stop::kNone) {
    RETURN_IF_ERROR(store_->RequeueJobLeases(job.id, now).status());
    job.parked.reset();
    *finished = true;
    Release(job);
    if (job.stop == Stop::kShutdown) {
      Log(job.id, "shutdown", "stopped for shutdown; it resumes when quantd starts again");
      return Publish(job.id);
    }
    if (job.stop == Stop::kPause) return SetState(job.id, JobState::kPaused, job.stop_reason, "");
    if (job.tasks != nullptr) RETURN_IF_ERROR(job.tasks->SweepTmpFiles().status());
    return SetState(job.id, JobState::kCancelled, job.stop_reason, "");
  }
  if (job.tasks == nullptr) return absl::OkStatus();  // still reading its source
  if (job.failure.has_value()) {
    RETURN_IF_ERROR(store_->RequeueJobLeases(job.id, now).status());
    job.parked.reset();
    *finished = true;
    Release(job);
    const std::string reason = pipeline::JobReasonOf(*job.failure);
    if (options_.metrics != nullptr) options_.metrics->JobFailed(reason);
    return SetState(job.id, JobState::kFailed, reason, std::string(job.failure->message()));
  }
  if (job.parked.has_value()) return absl::OkStatus();  // waiting for a device
  ASSIGN_OR_RETURN(std::vector<store::StageProgress> stages, store_->Progress(job.id));
  bool all_done = true;
  for (const store::StageProgress& p : stages) all_done &= p.state == store::StageState::kSucceeded;
  if (!all_done) return absl::OkStatus();  // waiting out a retry back-off
  ASSIGN_OR_RETURN(int swept, job.tasks->SweepTmpFiles());
  if (swept > 0) {
    RETURN_IF_ERROR(store_->AddEvent(job.id, "sweep",
                                     absl::StrCat("removed ", swept, " stale .tmp file(s)"), now));
  }
  *finished = true;
  Release(job);
  return SetState(job.id, JobState::kSucceeded, "", "");
}

void Scheduler::Impl::Release(ActiveJob& job) {
  for (int w : job.workers) slots_[w].job_id = 0;
  job.workers.clear();
  reconsider_ = true;
}

absl::Status Scheduler::Impl::SetState(int64_t job_id, JobState state, const std::string& reason,
                                       const std::string& error) {
  RETURN_IF_ERROR(store_->SetJobState(job_id, state, reason, error, clock_.NowMs()));
  states_[job_id] = state;
  std::string message = store::JobStateName(state);
  if (!reason.empty()) absl::StrAppend(&message, " (", reason, ")");
  if (!error.empty()) absl::StrAppend(&message, ": ", error);
  Log(job_id, "state", message);
  // A job that can resume (PAUSED, FAILED) keeps its work directory (calibration tokens).
  if (state == JobState::kSucceeded || state == JobState::kCancelled) RemoveWorkDir(job_id);
  return Publish(job_id);
}

absl::Status Scheduler::Impl::Reconsider() {
  if (stopping_ || !reconsider_) return absl::OkStatus();
  reconsider_ = false;
  absl::Status s = StartJobs();
  if (!s.ok()) reconsider_ = true;
  return s;
}

void Scheduler::Impl::RemoveWorkDir(int64_t job_id) {
  // The job's state is already committed: a directory that stays is only logged.
  if (absl::Status s = pipeline::RemoveJobWorkDir(store_->db().path(), job_id); !s.ok()) {
    Log(job_id, "cleanup", std::string(s.message()));
  }
}

absl::Status Scheduler::Impl::Step() {
  RETURN_IF_ERROR(Reconsider());
  for (auto& [id, job] : active_) RETURN_IF_ERROR(Dispatch(*job));
  bool released = false;
  for (auto it = active_.begin(); it != active_.end();) {
    bool finished = false;
    RETURN_IF_ERROR(MaybeFinish(*it->second, &finished));
    released |= finished;
    it = finished ? active_.erase(it) : std::next(it);
  }
  // A job that ended freed its workers: a waiting job starts now, not at the next event.
  if (released) RETURN_IF_ERROR(Reconsider());
  return absl::OkStatus();
}

void Scheduler::Impl::Kick() {
  if (ended_) return;
  if (absl::Status s = Step(); !s.ok()) {
    OnStoreError(s, "scheduling");
    return;
  }
  OnStoreOk();
  ServeRemoteWaiters();
  MaybeEndLoop(/*force=*/false);
}

}  // namespace quantd::scheduler
