// Admission: the commands (Submit, Cancel, Resume, Delete, Report), which waiting job starts
// next and planning a started job off the strand (how a job ends: job_lifecycle.cc). Everything
// here runs on the strand.
#include <sys/stat.h>

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/sha256.h"
#include "server/pipeline/prepared_job.h"
#include "server/pipeline/stage.h"
#include "server/pipeline/stages/quantize_stage.h"
#include "server/pipeline/stages/verify_stage.h"
#include "server/scheduler/calibration_report.h"
#include "server/scheduler/evaluation_report.h"
#include "server/scheduler/job_proto.h"
#include "server/scheduler/numerics_comparison.h"
#include "server/scheduler/scheduler_impl.h"

namespace quantd::scheduler {
namespace {

using store::JobState;

absl::Status NotFound(int64_t job_id) {
  return WithReason(absl::NotFoundError(absl::StrCat("job ", job_id, " not found")),
                    "JOB_NOT_FOUND");
}

absl::Status Forbidden(const std::string& message) {
  return WithReason(absl::FailedPreconditionError(message), "TRANSITION_FORBIDDEN");
}

absl::Status ShuttingDown() {
  return WithReason(absl::UnavailableError("quantd is shutting down"), "SHUTTING_DOWN");
}

// A calibration.amax_out that exists already is replaced only if quantd wrote it or the spec says
// overwrite: quantd wrote a file when a DONE task of a job in its store recorded that path as its
// output with the file's present size and SHA-256 (JobStore::FindRecordedOutputs). Only a file of
// a recorded size no larger than an amax file may be is hashed, on the strand. FailedPrecondition
// with reason OUTPUT_EXISTS otherwise.
absl::Status CheckAmaxOutReplaceable(store::JobStore& store, const job::JobSpec& spec) {
  const std::string& path = spec.calibration.amax_out;
  struct stat st;
  if (path.empty() || spec.overwrite || lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::vector<store::RecordedOutput> recorded,
                   store.FindRecordedOutputs(path));
  std::optional<std::string> sha256;  // of the file, once needed
  for (const store::RecordedOutput& r : recorded) {
    if (!S_ISREG(st.st_mode) || r.bytes != st.st_size ||
        static_cast<uint64_t>(st.st_size) > pipeline::kMaxAmaxFileBytes) {
      continue;
    }
    if (!sha256.has_value()) {
      absl::StatusOr<std::string> hashed = checkpoint::Sha256File(path);
      if (!hashed.ok()) break;
      sha256 = *std::move(hashed);
    }
    if (*sha256 == r.sha256) return absl::OkStatus();
  }
  return WithReason(absl::FailedPreconditionError(absl::StrCat(
                        "calibration.amax_out: ", path,
                        " exists and no job of this quantd wrote it; set overwrite to replace "
                        "it")),
                    "OUTPUT_EXISTS");
}

}  // namespace

std::string TaskLabel(const store::TaskRow& task) {
  return task.name == task.stage_kind ? task.name : absl::StrCat(task.stage_kind, " ", task.name);
}

absl::StatusOr<v1::Job> Scheduler::Impl::DoSubmit(const std::string& request_id,
                                                  const job::JobSpec& spec, bool* created) {
  *created = false;
  if (stopping_) return ShuttingDown();
  const std::string spec_json = job::JobSpecToJson(spec);
  if (!request_id.empty()) {
    ASSIGN_OR_RETURN(std::optional<store::JobRow> existing,
                     store_->FindJobByRequestId(request_id));
    if (existing.has_value()) {
      if (existing->spec_json != spec_json) {
        return WithReason(absl::AlreadyExistsError(absl::StrCat(
                              "request_id \"", request_id, "\" was used for job ", existing->id,
                              " with another spec")),
                          "REQUEST_ID_REUSED");
      }
      return Snapshot(existing->id);
    }
  }
  RETURN_IF_ERROR(WorkersFor(spec).status());
  RETURN_IF_ERROR(CheckAmaxOutReplaceable(*store_, spec));
  if (options_.host_memory_bytes > 0 && spec.host_memory_bytes > options_.host_memory_bytes) {
    return WithReason(absl::InvalidArgumentError(absl::StrCat(
                          "spec.host_memory_bytes: ", spec.host_memory_bytes,
                          " exceeds this quantd's budget of ", options_.host_memory_bytes)),
                      "INVALID_SPEC");
  }
  const int64_t pending = std::count_if(states_.begin(), states_.end(), [](const auto& s) {
    return s.second == JobState::kPending;
  });
  if (pending >= options_.queue_limit) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "the queue is full: ", pending, " jobs are PENDING (limit ",
                          options_.queue_limit, ")")),
                      "QUEUE_FULL");
  }
  ASSIGN_OR_RETURN(int64_t id,
                   store_->CreateJob(request_id, spec_json, clock_.NowMs(), created));
  states_[id] = JobState::kPending;
  Log(id, "state", absl::StrCat("PENDING (submitted): ", spec.source, " -> ", spec.output));
  reconsider_ = true;
  ASSIGN_OR_RETURN(v1::Job job, Snapshot(id));
  board_.Put(job);
  return job;
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
      for (auto& [task_id, f] : job.in_flight) f.work.run->cancel.store(true);
      if (job.planning != nullptr) job.planning->cancel.store(true);
      RETURN_IF_ERROR(
          SetState(job_id, JobState::kRunning, pause ? "pausing" : "cancelling", ""));
    }
    return Snapshot(job_id);
  }
  const char* name = store::JobStateName(row->state);
  switch (row->state) {
    case JobState::kSucceeded:
    case JobState::kCancelled:
      return Forbidden(absl::StrCat("job ", job_id, " is ", name, "; it cannot be ",
                                    pause ? "paused" : "cancelled"));
    case JobState::kPaused:
      if (pause) return Snapshot(job_id);
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
  RETURN_IF_ERROR(
      SetState(job_id, pause ? JobState::kPaused : JobState::kCancelled, final_reason, ""));
  return Snapshot(job_id);
}

absl::StatusOr<v1::Job> Scheduler::Impl::DoResume(int64_t job_id) {
  absl::StatusOr<store::JobRow> row = store_->GetJob(job_id);
  if (!row.ok()) return absl::IsNotFound(row.status()) ? NotFound(job_id) : row.status();
  if (row->state != JobState::kPaused && row->state != JobState::kFailed) {
    return Forbidden(absl::StrCat("job ", job_id, " is ", store::JobStateName(row->state),
                                  "; only a PAUSED or FAILED job can be resumed"));
  }
  if (stopping_) return ShuttingDown();
  RETURN_IF_ERROR(store_->ResetFailedTasks(job_id, clock_.NowMs()).status());
  RETURN_IF_ERROR(SetState(job_id, JobState::kPending, "resumed", ""));
  reconsider_ = true;
  return Snapshot(job_id);
}

absl::Status Scheduler::Impl::DoDelete(int64_t job_id, store::DeletePrecondition precondition) {
  absl::StatusOr<store::JobRow> row = store_->GetJob(job_id);
  if (!row.ok()) return absl::IsNotFound(row.status()) ? NotFound(job_id) : row.status();
  if (row->state == JobState::kRunning || active_.count(job_id) != 0) {
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          "job ", job_id, " is RUNNING; cancel it first, then delete it")),
                      "JOB_RUNNING");
  }
  RETURN_IF_ERROR(store_->DeleteJob(job_id, precondition));
  states_.erase(job_id);
  Log(job_id, "state", "deleted");
  RemoveWorkDir(job_id);
  board_.Remove(job_id);
  return absl::OkStatus();
}

namespace {

// The NVFP4 modules of the DONE quantize tasks among `tasks` whose weight has no row in `stats`.
int64_t ModulesWithoutStatistics(const std::vector<store::TaskRow>& tasks,
                                 const std::vector<store::TensorStatsRow>& stats) {
  std::set<std::string> with_stats;
  for (const store::TensorStatsRow& s : stats) with_stats.insert(s.tensor);
  int64_t without = 0;
  for (const store::TaskRow& t : tasks) {
    if (t.stage_kind != pipeline::QuantizeStage::kKind || t.state != store::TaskState::kDone) {
      continue;
    }
    absl::StatusOr<pipeline::ShardTask> shard = pipeline::ParseShardTask(t.payload_json);
    if (!shard.ok()) continue;  // the plan check refuses it when the job runs
    for (const std::string& module : shard->modules) {
      without += with_stats.count(module + ".weight") == 0;
    }
  }
  return without;
}

}  // namespace

absl::StatusOr<v1::JobReport> Scheduler::Impl::DoReport(int64_t job_id, int worst) {
  absl::StatusOr<store::JobRow> row = report_store_->GetJob(job_id);
  if (!row.ok()) return absl::IsNotFound(row.status()) ? NotFound(job_id) : row.status();
  ASSIGN_OR_RETURN(std::vector<store::TensorStatsRow> stats, report_store_->ListTensorStats(job_id));
  std::sort(stats.begin(), stats.end(),
            [](const store::TensorStatsRow& a, const store::TensorStatsRow& b) {
              return a.sqnr_db != b.sqnr_db ? a.sqnr_db < b.sqnr_db : a.tensor < b.tensor;
            });
  v1::JobReport report;
  report.set_job_id(job_id);
  report.set_state(JobStateToProto(row->state));
  report.set_tensors_total(static_cast<int64_t>(stats.size()));
  double sum = 0;
  for (const store::TensorStatsRow& s : stats) sum += s.sqnr_db;
  if (!stats.empty()) {
    report.set_min_sqnr_db(stats.front().sqnr_db);
    report.set_mean_sqnr_db(sum / stats.size());
  }
  for (const store::TensorStatsRow& s : stats) {
    if (worst > 0 && report.tensors_size() == worst) break;
    v1::TensorStats* t = report.add_tensors();
    t->set_tensor(s.tensor);
    t->set_rel_rmse(s.rel_rmse);
    t->set_sqnr_db(s.sqnr_db);
    t->set_max_abs_err(s.max_abs_err);
  }
  ASSIGN_OR_RETURN(std::vector<store::TaskRow> tasks, report_store_->ListTasks(job_id));
  report.set_modules_without_statistics(ModulesWithoutStatistics(tasks, stats));
  for (const store::TaskRow& t : tasks) {
    if (t.stage_kind != pipeline::VerifyStage::kKind) continue;
    if (t.state != store::TaskState::kDone && t.state != store::TaskState::kFailed) continue;
    v1::RuleCheck* check = report.add_rules();
    check->set_name(TaskLabel(t));
    check->set_passed(t.state == store::TaskState::kDone);
    check->set_message(t.error);
  }
  for (const store::TaskRow& t : tasks) {
    if (t.ran_by.empty()) continue;
    if (t.state != store::TaskState::kDone && t.state != store::TaskState::kFailed) continue;
    v1::TaskRun* run = report.add_tasks();
    run->set_stage(t.stage_kind);
    run->set_name(t.name);
    run->set_label(t.label);
    run->set_attempt(t.attempt);
    run->set_done(t.state == store::TaskState::kDone);
    run->set_worker(WorkerOfLeaseOwner(t.ran_by));
  }
  ASSIGN_OR_RETURN(const std::vector<store::AmaxRow> amax, report_store_->ListAmax(job_id));
  AddLayerCalibration(amax, tasks, &report);
  RETURN_IF_ERROR(AddStoredEvaluation(*report_store_, job_id, &report));
  if (absl::StatusOr<job::JobSpec> spec = job::ParseStoredJobSpec(row->spec_json, "stored spec");
      spec.ok()) {
    RETURN_IF_ERROR(
        AddNumericsComparisonFromStore(*report_store_, job_id, *spec, amax, tasks, &report));
  }
  return report;
}

absl::StatusOr<std::vector<int>> Scheduler::Impl::WorkersFor(const job::JobSpec& spec) const {
  std::vector<int> out;
  for (size_t i = 0; i < workers_.size(); ++i) {
    const std::string& device = workers_[i]->device->name();
    if (spec.devices.empty() || options_.ignore_spec_devices ||
        std::find(spec.devices.begin(), spec.devices.end(), device) != spec.devices.end()) {
      out.push_back(static_cast<int>(i));
    }
  }
  if (options_.ignore_spec_devices) return out;
  for (const std::string& d : spec.devices) {
    std::vector<std::string> have;
    for (const auto& w : workers_) {
      const std::string& name = w->device->name();
      if (std::find(have.begin(), have.end(), name) == have.end()) have.push_back(name);
    }
    if (std::find(have.begin(), have.end(), d) == have.end()) {
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
  // A job waits while a worker it needs is held; younger jobs may not take workers an older
  // waiting job needs, so nobody starves.
  // A job whose earlier start's source phase still runs (it stopped meanwhile) waits for it to
  // end, so that two source phases of one job never claim its output at once.
  std::vector<int64_t> candidates;
  for (JobState state : {JobState::kRunning, JobState::kPending}) {
    for (const auto& [id, s] : states_) {
      if (s == state && active_.count(id) == 0 && loading_.count(id) == 0) {
        candidates.push_back(id);
      }
    }
  }
  std::set<int> reserved;
  for (int64_t id : candidates) {
    ASSIGN_OR_RETURN(store::JobRow row, store_->GetJob(id));
    absl::StatusOr<job::JobSpec> spec = job::ParseStoredJobSpec(row.spec_json, "stored spec");
    absl::StatusOr<std::vector<int>> workers =
        spec.ok() ? WorkersFor(*spec) : absl::StatusOr<std::vector<int>>(spec.status());
    if (!workers.ok()) {
      RETURN_IF_ERROR(SetState(id, JobState::kFailed, "cannot_start",
                               std::string(workers.status().message())));
      if (options_.metrics != nullptr) options_.metrics->JobFailed("cannot_start");
      continue;
    }
    bool free = true;
    for (int w : *workers) free &= slots_[w].job_id == 0 && reserved.count(w) == 0;
    if (!free) {
      reserved.insert(workers->begin(), workers->end());
      continue;
    }
    RETURN_IF_ERROR(StartJob(id, *spec, *workers));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::Impl::StartJob(int64_t job_id, const job::JobSpec& spec,
                                       const std::vector<int>& workers) {
  ASSIGN_OR_RETURN(store::JobRow row, store_->GetJob(job_id));
  ASSIGN_OR_RETURN(const int interrupted, InterruptedPlannings(job_id));
  if (interrupted >= kMaxInterruptedPlannings) {
    // Planning it crashed (or hung) the process every time: it is not planned a third time. A
    // resume plans it again.
    EndPlanning(job_id, "given up");
    if (options_.metrics != nullptr) options_.metrics->JobFailed("PLANNING_CRASHED");
    return SetState(job_id, JobState::kFailed, "PLANNING_CRASHED",
                    absl::StrCat("planning this job was interrupted ", interrupted,
                                 " times by a crash or a hang of quantd; it is not planned again "
                                 "(resume it to try once more)"));
  }
  ASSIGN_OR_RETURN(pipeline::StoredJob stored, pipeline::ReadStoredJob(*store_, job_id));
  const bool resumed = row.state == JobState::kRunning || row.reason == "resumed";
  RETURN_IF_ERROR(SetState(job_id, JobState::kRunning, resumed ? "resumed" : "started", ""));
  RETURN_IF_ERROR(store_->AddEvent(job_id, "planning",
                                   absl::StrCat("planning began (start ", interrupted + 1, ")"),
                                   clock_.NowMs()));
  // Test hook: "planning:<n>" kills the process once the n-th planning it began is recorded.
  if (kill_hook_.has_value() && kill_hook_->stage == "planning" &&
      ++started_["planning"] == kill_hook_->n) {
    KillSelf();
  }
  auto job = std::make_unique<ActiveJob>();
  job->id = job_id;
  job->serial = next_serial_++;
  job->spec = job::JobSpecToProto(spec);
  job->workers = workers;
  for (int w : workers) slots_[w].job_id = job_id;
  const uint64_t serial = job->serial;
  auto run = std::make_shared<PlanningRun>();
  job->planning = run;
  active_[job_id] = std::move(job);
  loading_.emplace(job_id, run);
  // Reading the source (every shard header, every finished output) may take minutes, and its
  // inputs are the caller's: not on the strand, and under the job's budget. The work holds no
  // pointer into the scheduler but through Deliver, which runs only while the scheduler lives.
  planning_.Run([this, planner = planner_, budget = options_.planning, job_id, serial, spec,
                 stored = std::move(stored), run]() mutable {
    PlanningFigures figures;
    auto result = std::make_shared<absl::StatusOr<std::unique_ptr<LoadedJob>>>(
        LoadWithinBudget(*planner, spec, std::move(stored), budget, &run->cancel, &figures));
    run->returned = true;
    planning_.Deliver([this, job_id, serial, result, figures] {
      boost::asio::post(strand_, [this, job_id, serial, result, figures] {
        on_strand_.Assert();
        if (ended_) return;
        Log(job_id, "planning",
            absl::StrCat("read its source in ", absl::SixDigits(figures.seconds),
                         " s, holding at most ", figures.peak_bytes, " bytes"));
        OnLoaded(job_id, serial, std::move(*result));
      });
    });
  });
  return absl::OkStatus();
}

absl::StatusOr<int> Scheduler::Impl::InterruptedPlannings(int64_t job_id) {
  ASSIGN_OR_RETURN(const std::vector<store::EventRow> events, store_->ListEvents(job_id, 0));
  int interrupted = 0;
  for (const store::EventRow& e : events) {
    if (e.kind == "planning") ++interrupted;
    if (e.kind == "planning_end") interrupted = 0;
  }
  return interrupted;
}

void Scheduler::Impl::EndPlanning(int64_t job_id, const std::string& how) {
  if (states_.count(job_id) == 0) return;  // deleted meanwhile
  if (absl::Status s = store_->AddEvent(job_id, "planning_end", how, clock_.NowMs()); !s.ok()) {
    Log(job_id, "error", absl::StrCat("recording the end of its planning: ", s.message()));
  }
}

void Scheduler::Impl::EndReturnedPlannings() {
  for (const auto& [id, run] : loading_) {
    if (run->returned.load()) EndPlanning(id, "stopped for shutdown");
  }
}

void Scheduler::Impl::OnLoaded(int64_t job_id, uint64_t serial,
                               absl::StatusOr<std::unique_ptr<LoadedJob>> loaded) {
  loading_.erase(job_id);
  EndPlanning(job_id, loaded.ok() ? "loaded" : "failed");
  const auto it = active_.find(job_id);
  if (it == active_.end() || it->second->serial != serial) {
    // The job stopped meanwhile: its source phase is dropped (releasing its output claims)
    // before the job may start again.
    if (loaded.ok()) loaded->reset();
    reconsider_ = true;
    Kick();
    return;
  }
  ActiveJob& job = *it->second;
  absl::StatusOr<std::unique_ptr<JobTasks>> tasks =
      loaded.ok() ? AttachLoaded(**loaded, job_id) : loaded.status();
  if (!tasks.ok()) {
    const std::string reason = tasks.status().GetPayload(pipeline::kJobReasonPayload).has_value()
                                   ? pipeline::JobReasonOf(tasks.status())
                                   : std::string("cannot_start");
    if (options_.metrics != nullptr) options_.metrics->JobFailed(reason);
    Release(job);
    active_.erase(it);
    if (absl::Status s = SetState(job_id, JobState::kFailed, reason,
                                  std::string(tasks.status().message()));
        !s.ok()) {
      OnStoreError(s, absl::StrCat("failing job ", job_id));
    }
    Kick();
    return;
  }
  job.tasks = *std::move(tasks);
  Log(job_id, "start",
      absl::StrCat("running on ", job.workers.size(), " worker(s): ",
                   absl::StrJoin(job.workers, ", ", [&](std::string* out, int w) {
                     compute::Device& device = *workers_[w]->device;
                     absl::StrAppend(out, device.name(), " (", device.backend().name(), ")");
                   })));
  if (absl::Status s = Publish(job_id); !s.ok()) OnStoreError(s, "publishing");
  Kick();
}

absl::StatusOr<std::unique_ptr<JobTasks>> Scheduler::Impl::AttachLoaded(LoadedJob& loaded,
                                                                        int64_t job_id) {
  // Storing the plan allocates with its size (bounded by max_tasks_per_job): running out of
  // memory fails the job, not the daemon.
  try {
    return loaded.Attach(*store_, clock_.NowMs(),
                         [&](const std::string& m) { Log(job_id, "plan", m); });
  } catch (const std::bad_alloc&) {
    return pipeline::WithJobReason(
        absl::ResourceExhaustedError("storing the job's plan ran out of memory"),
        "PLANNING_LIMIT");
  }
}

}  // namespace quantd::scheduler
