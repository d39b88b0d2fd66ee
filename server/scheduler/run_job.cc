#include "server/scheduler/run_job.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backends.h"
#include "server/checkpoint/sha256.h"
#include "server/compute/device_name.h"
#include "server/job/job_paths.h"
#include "server/job/progress.h"
#include "server/scheduler/scheduler.h"
#include "server/store/file_lock.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {
namespace {

using store::JobState;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The job of this spec in the store: refuses a state file that holds another spec's job.
absl::StatusOr<int64_t> FindOrCreateJob(store::JobStore& store, const RunOptions& options) {
  const std::string request_id = RunRequestId(options.spec);
  absl::StatusOr<std::vector<store::JobRow>> jobs = store.ListJobs(std::nullopt, 0, 1000);
  if (!jobs.ok()) return jobs.status();
  for (const store::JobRow& job : *jobs) {
    if (job.request_id == request_id) continue;
    std::string what;
    absl::StatusOr<job::JobSpec> other = job::ParseStoredJobSpec(job.spec_json, "state");
    // A state file written by an earlier release stores that release's canonical spec (fewer
    // fields, paths as given): the same job when it reads, today and resolved, as this spec.
    if (other.ok()) {
      job::JobSpec resolved = *other;
      if (job::ResolveJobPaths(&resolved, /*allow_relative=*/true).ok() &&
          job::JobSpecToJson(resolved) == job::JobSpecToJson(options.spec)) {
        return job.id;
      }
    }
    if (other.ok()) {
      what = absl::StrCat(" (source ", other->source, ", output ", other->output, ")");
    }
    return absl::FailedPreconditionError(absl::StrCat("state file ", options.state_path,
                                                      " belongs to a different job spec", what,
                                                      "; use another --state file for this spec"));
  }
  return store.CreateJob(request_id, job::JobSpecToJson(options.spec), NowMs());
}

// The worker devices: options.devices, else the spec's, else "auto"; "auto" resolved; cycled
// over the workers.
absl::StatusOr<std::vector<std::string>> WorkerDevices(const RunOptions& options) {
  std::vector<std::string> devices = options.devices;
  if (devices.empty()) devices = options.spec.devices;
  if (devices.empty()) devices = {"auto"};
  for (std::string& d : devices) {
    if (d == "auto") d = kernels::CudaDeviceCount() > 0 ? "cuda:0" : "cpu";
    int index = 0;
    if (!compute::ParseDeviceName(d, &index)) {
      return absl::InvalidArgumentError(
          absl::StrCat("device \"", d, "\": expected cpu, cuda:N or auto"));
    }
  }
  std::vector<std::string> out;
  for (int i = 0; i < std::max(1, options.workers); ++i) out.push_back(devices[i % devices.size()]);
  return out;
}

// The progress line's view of the job: its first unfinished stage (the last one when done).
v1::StageProgress StageSnapshot(const v1::Job& job) {
  v1::StageProgress s;
  for (const v1::StageProgress& p : job.stages()) {
    s = p;
    if (p.kind() == job.current_stage()) break;
  }
  return s;
}

}  // namespace

std::string RunRequestId(const job::JobSpec& spec) {
  checkpoint::Sha256 sha;
  const std::string json = job::JobSpecToJson(spec);
  sha.Update(json.data(), json.size());
  return absl::StrCat("run:", sha.HexDigest());
}

absl::Status RunJob(const RunOptions& options) {
  absl::StatusOr<std::vector<std::string>> devices = WorkerDevices(options);
  if (!devices.ok()) return devices.status();
  // Two processes on one state file would requeue each other's leases and write the same .tmp
  // files.
  bool in_use = false;
  absl::StatusOr<std::unique_ptr<store::FileLock>> lock =
      store::FileLock::Acquire(options.state_path + ".lock", &in_use);
  if (!lock.ok() && in_use) {
    return absl::FailedPreconditionError(
        absl::StrCat("state file ", options.state_path, " is in use by another quantd run"));
  }
  if (!lock.ok()) return lock.status();
  absl::StatusOr<std::unique_ptr<store::JobStore>> store =
      store::JobStore::Open(options.state_path);
  if (!store.ok()) return store.status();
  absl::StatusOr<int64_t> job_id = FindOrCreateJob(**store, options);
  if (!job_id.ok()) return job_id.status();
  absl::StatusOr<store::JobRow> job = (*store)->GetJob(*job_id);
  if (!job.ok()) return job.status();

  absl::Mutex printer_mu;  // the scheduler thread logs while this thread shows progress
  job::ProgressPrinter printer(options.progress, options.progress_tty);
  auto message = [&](const std::string& line) {
    absl::MutexLock l(&printer_mu);
    printer.Message(line);
  };
  if (job->state == JobState::kSucceeded) {
    message(absl::StrCat("job ", *job_id, " already SUCCEEDED: ", options.spec.output));
    return absl::OkStatus();
  }
  if (job->state == JobState::kCancelled) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", *job_id, " in ", options.state_path, " was cancelled"));
  }
  if (job->state != JobState::kPending) {
    absl::StatusOr<int> requeued = (*store)->RequeueJobLeases(*job_id, NowMs());
    if (!requeued.ok()) return requeued.status();
    absl::StatusOr<int> reset = (*store)->ResetFailedTasks(*job_id, NowMs());
    if (!reset.ok()) return reset.status();
    absl::StatusOr<std::vector<store::TaskRow>> tasks = (*store)->ListTasks(*job_id);
    if (!tasks.ok()) return tasks.status();
    int64_t done = 0;
    for (const store::TaskRow& t : *tasks) done += t.state == store::TaskState::kDone;
    message(absl::StrCat("resuming job ", *job_id, ": ", done, " of ", tasks->size(),
                         " tasks done, ", *requeued, " interrupted and ", *reset,
                         " failed task(s) to redo"));
    if (job->state != JobState::kRunning) {
      if (absl::Status s =
              (*store)->SetJobState(*job_id, JobState::kPending, "resumed", "", NowMs());
          !s.ok()) {
        return s;
      }
    }
  }

  SchedulerOptions scheduler_options;
  scheduler_options.devices = *devices;
  scheduler_options.cpu_threads = options.cpu_threads;
  scheduler_options.ignore_spec_devices = true;
  scheduler_options.log = [&](int64_t, const std::string& kind, const std::string& line) {
    // On a terminal the live line shows finished tasks; elsewhere each gets a line.
    if (kind == "task_done" && options.progress_tty) return;
    if (kind == "state") return;  // the run's own messages say it
    message(line);
  };
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler =
      Scheduler::Start(*std::move(store), scheduler_options);
  if (!scheduler.ok()) return scheduler.status();
  bool pause_sent = false;
  absl::StatusOr<v1::Job> last =
      (*scheduler)->WaitUntilStopped(*job_id, [&](const v1::Job& snapshot) {
        {
          absl::MutexLock l(&printer_mu);
          printer.Show(StageSnapshot(snapshot));
        }
        // A job can be paused once it runs (it is PENDING for a moment after the start).
        if (options.cancel != nullptr && options.cancel->load() && !pause_sent &&
            snapshot.state() == v1::RUNNING) {
          pause_sent = true;
          absl::StatusOr<v1::Job> paused = (*scheduler)->Cancel(*job_id, true, "interrupted");
          if (!paused.ok()) message(absl::StrCat("cannot pause: ", paused.status().message()));
        }
        return true;
      });
  (*scheduler)->Shutdown(std::chrono::milliseconds(0));
  {
    absl::MutexLock l(&printer_mu);
    if (last.ok()) printer.Show(StageSnapshot(*last));
    printer.Finish();
  }
  if (!last.ok()) return last.status();
  switch (last->state()) {
    case v1::SUCCEEDED:
      message(absl::StrCat("job ", *job_id, " SUCCEEDED: ", options.spec.output));
      return absl::OkStatus();
    case v1::PAUSED:
      return absl::CancelledError(
          "interrupted; the job is PAUSED: run the same command again to resume");
    case v1::FAILED:
      return absl::FailedPreconditionError(last->last_error());
    default:
      return absl::InternalError(absl::StrCat("job ", *job_id, " stopped in state ",
                                              v1::JobState_Name(last->state())));
  }
}

}  // namespace quantd::scheduler
