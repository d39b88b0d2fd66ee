#include "server/pipeline/runner.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/backends.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/sha256.h"
#include "server/pipeline/progress.h"
#include "server/pipeline/stage.h"
#include "server/pipeline/stages/dequant_stage.h"
#include "server/pipeline/stages/export_stage.h"
#include "server/pipeline/stages/quantize_stage.h"
#include "server/pipeline/stages/verify_stage.h"
#include "server/pipeline/tensor_inventory.h"

namespace quantd::pipeline {
namespace {

using store::JobState;

constexpr int64_t kLeaseMs = 60'000;                  // a task lease; renewed while the task runs
constexpr int64_t kRenewEveryMs = 20'000;             // how often running tasks' leases are renewed
constexpr std::chrono::milliseconds kWakeEvery(100);  // main loop: cancel checks, redraws

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// QUANTD_TEST_KILL_AT (runner.h): where the process kills itself.
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

// A thread-safe FIFO between the main thread and the workers.
template <typename T>
class BlockingQueue {
 public:
  void Push(T item) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(std::move(item));
    }
    cv_.notify_one();
  }
  // Waits for an item; nullopt once the queue is closed and empty.
  std::optional<T> Pop() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return closed_ || !items_.empty(); });
    return TakeLocked();
  }
  // Waits at most `timeout`; nullopt when nothing came.
  std::optional<T> PopFor(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [this] { return closed_ || !items_.empty(); });
    return TakeLocked();
  }
  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::optional<T> TakeLocked() {
    if (items_.empty()) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }

  std::mutex mu_;               // guards items_ and closed_
  std::condition_variable cv_;  // signalled on Push and Close
  std::deque<T> items_;         // waiting items, oldest first
  bool closed_ = false;         // no more items will come
};

// A leased task on its way to a worker.
struct Work {
  store::TaskRow task;
  store::TaskLease lease;
  bool kill_mid = false;      // test hook: SIGKILL once half of the task's bytes are reported
  bool kill_written = false;  // test hook: SIGKILL when the task returns, before it is recorded
};

// A task back from a worker.
struct Done {
  Work work;
  absl::StatusOr<TaskOutput> output;
  uint64_t reported = 0;  // bytes the task reported through add_progress
};

// "quantize model-00002-of-00004.safetensors"; just "export" for a stage's only task.
std::string TaskLabel(const store::TaskRow& task) {
  return task.name == task.stage_kind ? task.name : absl::StrCat(task.stage_kind, " ", task.name);
}

// The inspect task: re-reads the source headers, checks that they still give the stored plan and
// that the output fits on disk.
absl::StatusOr<TaskOutput> RunInspectTask(const JobSpec& spec,
                                          const std::vector<store::TaskRow>& stored) {
  absl::StatusOr<std::unique_ptr<checkpoint::CheckpointDir>> source =
      checkpoint::CheckpointDir::Open(spec.source);
  if (!source.ok()) return source.status();
  absl::StatusOr<TensorInventory> inventory = BuildInventory(**source);
  if (!inventory.ok()) return inventory.status();
  absl::StatusOr<Plan> plan = BuildPlan(spec, **source, *inventory);
  if (!plan.ok()) return plan.status();
  if (absl::Status s = CheckPlanUnchanged(*plan, stored); !s.ok()) return s;
  if (absl::Status s = CheckDiskSpace(spec, *plan); !s.ok()) return s;
  return TaskOutput{};
}

// Removes the *.tmp files directly inside `dir` (left by interrupted tasks). Returns how many.
absl::StatusOr<int> SweepTmpFiles(const std::string& dir) {
  std::error_code ec;
  if (dir.empty() || !std::filesystem::is_directory(dir, ec)) return 0;
  int removed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!entry.is_regular_file() || entry.path().extension() != ".tmp") continue;
    if (!std::filesystem::remove(entry.path(), ec) || ec) {
      return absl::InternalError(
          absl::StrCat("cannot remove ", entry.path().string(), ": ", ec.message()));
    }
    ++removed;
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  return removed;
}

absl::StatusOr<std::unique_ptr<kernels::Backend>> MakeBackend(const std::string& device,
                                                              int cpu_threads) {
  std::string d = device;
  if (d == "auto") d = kernels::CudaDeviceCount() > 0 ? "cuda:0" : "cpu";
  if (d == "cpu") return kernels::MakeCpuBackend({cpu_threads, kernels::SimdLevel::kAuto});
  int index = 0;
  if (absl::StartsWith(d, "cuda:") && absl::SimpleAtoi(d.substr(5), &index) && index >= 0) {
    return kernels::MakeCudaBackend(index);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device \"", device, "\": expected cpu, cuda:N or auto"));
}

class Runner {
 public:
  explicit Runner(const RunOptions& options)
      : options_(options),
        spec_(options.spec),
        progress_(options.progress, options.progress_tty),
        cancel_(options.cancel != nullptr ? options.cancel : &never_cancelled_) {}
  ~Runner() {
    StopWorkers();
    if (lock_fd_ >= 0) close(lock_fd_);
  }

  absl::Status Run();

 private:
  // Takes the state file's lock, opens it and finds or creates the job of this spec.
  absl::Status OpenJob();
  // Sets the job FAILED with `status`'s message and returns `status`.
  absl::Status FailJob(const absl::Status& status, const std::string& reason);
  // Opens the source and builds inventory and plan; plans the job on its first start, otherwise
  // checks that the plan is unchanged. Loads the amax table.
  absl::Status Prepare();
  // First start: amax file, disk check, SetPlan.
  absl::Status PlanJob();
  absl::Status StartWorkers();
  void StopWorkers();
  void WorkerLoop(kernels::Backend* backend);
  absl::StatusOr<TaskOutput> RunTask(const StageContext& ctx, const store::TaskRow& task) const;
  // Leases tasks, hands them out and records results until the job ends, fails or is cancelled.
  absl::Status Loop();
  absl::Status StartTask(store::TaskRow task, const store::TaskLease& lease);
  // Records a finished task. Sets *failure on a permanent error.
  absl::Status Record(Done done, std::optional<absl::Status>* failure);
  absl::Status RenewLeases();
  absl::StatusOr<bool> AllStagesSucceeded();

  const RunOptions& options_;                 // what to run, how
  const JobSpec& spec_;                       // options_.spec
  ProgressPrinter progress_;                  // what the user sees
  std::atomic<bool> never_cancelled_{false};  // stands in for a missing options.cancel
  const std::atomic<bool>* cancel_;           // options.cancel or never_cancelled_
  std::optional<KillHook> kill_hook_;         // QUANTD_TEST_KILL_AT
  std::map<std::string, int64_t> started_;    // tasks started by this process, per stage kind
  std::set<int64_t> kill_when_done_;          // test hook: task ids whose recording ends us

  int lock_fd_ = -1;                        // flock on <state>.lock, held for the whole run
  std::unique_ptr<store::JobStore> store_;  // used by this (the main) thread only
  int64_t job_id_ = 0;                      // the job of this spec in store_
  std::string owner_;                       // lease owner: "quantd-run:<pid>"
  // Read-only after Prepare(), shared by the workers:
  std::unique_ptr<checkpoint::CheckpointDir> source_;  // the source checkpoint, opened once
  TensorInventory inventory_;                          // of source_
  Plan plan_;                                          // rebuilt from spec + source on every start
  std::vector<store::TaskRow> stored_tasks_;           // the stored plan (for the inspect task)
  std::map<std::string, float> input_amax_;            // the amax table, kind "input"

  std::vector<std::unique_ptr<kernels::Backend>> backends_;  // one per worker
  std::vector<std::thread> workers_;                         // run WorkerLoop
  BlockingQueue<Work> work_;                                 // main -> workers
  BlockingQueue<Done> done_;                                 // workers -> main
  std::map<int64_t, store::TaskLease> leases_;               // task id -> lease, of tasks in flight
  std::string current_stage_;                                // stage kind the progress line shows
};

absl::Status Runner::OpenJob() {
  // Two processes on one state file would requeue each other's leases and write the same .tmp
  // files. The lock goes away with the process, however it ends.
  const std::string lock_path = options_.state_path + ".lock";
  lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", lock_path, ": ", strerror(errno)));
  }
  if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("state file ", options_.state_path, " is in use by another quantd run"));
  }
  absl::StatusOr<std::unique_ptr<store::JobStore>> store =
      store::JobStore::Open(options_.state_path);
  if (!store.ok()) return store.status();
  store_ = std::move(*store);
  const std::string request_id = RunRequestId(spec_);
  absl::StatusOr<std::vector<store::JobRow>> jobs = store_->ListJobs(std::nullopt, 0, 1000);
  if (!jobs.ok()) return jobs.status();
  for (const store::JobRow& job : *jobs) {
    if (job.request_id == request_id) continue;
    std::string what;
    absl::StatusOr<JobSpec> other = ParseJobSpec(job.spec_json, "state");
    if (other.ok())
      what = absl::StrCat(" (source ", other->source, ", output ", other->output, ")");
    return absl::FailedPreconditionError(absl::StrCat("state file ", options_.state_path,
                                                      " belongs to a different job spec", what,
                                                      "; use another --state file for this spec"));
  }
  absl::StatusOr<int64_t> id = store_->CreateJob(request_id, JobSpecToJson(spec_), NowMs());
  if (!id.ok()) return id.status();
  job_id_ = *id;
  owner_ = absl::StrCat("quantd-run:", getpid());
  return absl::OkStatus();
}

absl::Status Runner::FailJob(const absl::Status& status, const std::string& reason) {
  if (absl::Status s = store_->SetJobState(job_id_, JobState::kFailed, reason,
                                           std::string(status.message()), NowMs());
      !s.ok()) {
    return absl::Status(status.code(), absl::StrCat(status.message(),
                                                    " (and recording the "
                                                    "failure failed: ",
                                                    s.message(), ")"));
  }
  return status;
}

absl::Status Runner::Prepare() {
  absl::StatusOr<std::unique_ptr<checkpoint::CheckpointDir>> source =
      checkpoint::CheckpointDir::Open(spec_.source);
  if (!source.ok()) return source.status();
  source_ = std::move(*source);
  absl::StatusOr<TensorInventory> inventory = BuildInventory(*source_);
  if (!inventory.ok()) return inventory.status();
  inventory_ = std::move(*inventory);
  absl::StatusOr<Plan> plan = BuildPlan(spec_, *source_, inventory_);
  if (!plan.ok()) return plan.status();
  plan_ = std::move(*plan);
  if (!store_->HasPlan(job_id_)) {
    if (absl::Status s = PlanJob(); !s.ok()) return s;
  }
  absl::StatusOr<std::vector<store::TaskRow>> tasks = store_->ListTasks(job_id_);
  if (!tasks.ok()) return tasks.status();
  stored_tasks_ = std::move(*tasks);
  if (absl::Status s = CheckPlanUnchanged(plan_, stored_tasks_); !s.ok()) return s;
  absl::StatusOr<std::vector<store::AmaxRow>> amax = store_->ListAmax(job_id_);
  if (!amax.ok()) return amax.status();
  for (const store::AmaxRow& row : *amax) {
    if (row.kind == "input") input_amax_[row.module] = static_cast<float>(row.value);
  }
  for (const std::string& dir : {spec_.output, spec_.materialize_bf16}) {
    std::error_code ec;
    if (!dir.empty() && !std::filesystem::create_directories(dir, ec) && ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create directory ", dir, ": ", ec.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Runner::PlanJob() {
  if (spec_.kv_cache == KvCache::kFp8) {
    return absl::FailedPreconditionError(
        "kv_cache fp8 needs calibrated KV-cache scales: use kv_cache fp8_cast or none; "
        "calibration is not built yet");
  }
  std::vector<store::AmaxRow> rows;
  if (!spec_.calibration.amax_file.empty()) {
    absl::StatusOr<std::vector<store::AmaxRow>> loaded =
        LoadAmaxFile(spec_.calibration.amax_file, inventory_);
    if (!loaded.ok()) return loaded.status();
    rows = std::move(*loaded);
  }
  if (spec_.weight_format == WeightFormat::kNvfp4 && rows.empty()) {
    absl::StatusOr<std::vector<store::AmaxRow>> stored = store_->ListAmax(job_id_);
    if (!stored.ok()) return stored.status();
    if (stored->empty()) {
      return absl::FailedPreconditionError(
          "weight_format nvfp4 needs input amax: set calibration.amax_file or use w4a16_nvfp4; "
          "calibration is not built yet");
    }
  }
  if (absl::Status s = CheckDiskSpace(spec_, plan_); !s.ok()) return s;
  // Amax rows from a file carry no sample count, so merging them twice (a crash before SetPlan)
  // changes nothing.
  if (absl::Status s = store_->MergeAmax(job_id_, rows); !s.ok()) return s;
  if (absl::Status s = store_->SetPlan(job_id_, plan_.stages); !s.ok()) return s;
  int64_t tasks = 0;
  for (const store::StagePlan& stage : plan_.stages) tasks += stage.tasks.size();
  const std::string message = absl::StrCat(
      "planned ", plan_.recipe.modules.size(), " NVFP4 modules in ", tasks, " tasks; ",
      plan_.source_bytes, " source bytes -> about ", plan_.output_bytes, " output bytes");
  progress_.Message(message);
  return store_->AddEvent(job_id_, "plan", message, NowMs());
}

absl::Status Runner::StartWorkers() {
  std::vector<std::string> devices = options_.devices;
  if (devices.empty()) devices = spec_.devices;
  if (devices.empty()) devices = {"auto"};
  const int workers = std::max(1, options_.workers);
  for (int i = 0; i < workers; ++i) {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
        MakeBackend(devices[i % devices.size()], options_.cpu_threads);
    if (!backend.ok()) return backend.status();
    backends_.push_back(std::move(*backend));
  }
  progress_.Message(absl::StrCat("running on ", workers, " worker(s), ", backends_[0]->name()));
  for (int i = 0; i < workers; ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(backends_[i].get()); });
  }
  return absl::OkStatus();
}

void Runner::StopWorkers() {
  work_.Close();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void Runner::WorkerLoop(kernels::Backend* backend) {
  while (std::optional<Work> work = work_.Pop()) {
    std::atomic<uint64_t> reported{0};
    const uint64_t half = static_cast<uint64_t>(work->task.bytes_total) / 2;
    const bool kill_mid = work->kill_mid;
    StageContext ctx;
    ctx.spec = &spec_;
    ctx.source = source_.get();
    ctx.inventory = &inventory_;
    ctx.backend = backend;
    ctx.input_amax = &input_amax_;
    ctx.cancelled = cancel_;
    ctx.add_progress = [this, &reported, half, kill_mid](uint64_t n) {
      const uint64_t total = reported.fetch_add(n, std::memory_order_relaxed) + n;
      progress_.AddBytes(n);
      if (kill_mid && total >= half) KillSelf();
    };
    absl::StatusOr<TaskOutput> output = RunTask(ctx, work->task);
    if (work->kill_written && output.ok()) KillSelf();
    const uint64_t bytes = reported.load(std::memory_order_relaxed);
    done_.Push(Done{std::move(*work), std::move(output), bytes});
  }
}

absl::StatusOr<TaskOutput> Runner::RunTask(const StageContext& ctx,
                                           const store::TaskRow& task) const {
  const std::string& kind = task.stage_kind;
  if (kind == "inspect") return RunInspectTask(spec_, stored_tasks_);
  if (kind == "export") return RunExportTask(ctx, plan_);
  if (kind == "dequant") {
    absl::StatusOr<DequantTask> payload = ParseDequantTask(task.payload_json);
    if (!payload.ok()) return payload.status();
    return RunDequantTask(ctx, *payload);
  }
  if (kind == "quantize" || kind == "verify") {
    absl::StatusOr<ShardTask> payload = ParseShardTask(task.payload_json);
    if (!payload.ok()) return payload.status();
    return kind == "quantize" ? RunQuantizeTask(ctx, *payload) : RunVerifyTask(ctx, *payload);
  }
  return absl::UnimplementedError(absl::StrCat("quantd run cannot run ", kind, " tasks"));
}

absl::Status Runner::StartTask(store::TaskRow task, const store::TaskLease& lease) {
  if (task.stage_kind != current_stage_) {
    absl::StatusOr<std::vector<store::StageProgress>> stages = store_->Progress(job_id_);
    if (!stages.ok()) return stages.status();
    for (const store::StageProgress& p : *stages) {
      if (p.stage_id != task.stage_id) continue;
      progress_.BeginStage(p.kind, p.tasks_total, p.tasks_done, p.bytes_total, p.bytes_done);
    }
    current_stage_ = task.stage_kind;
  }
  Work work{std::move(task), lease};
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
  leases_[work.task.id] = lease;
  work_.Push(std::move(work));
  return absl::OkStatus();
}

absl::Status Runner::Record(Done done, std::optional<absl::Status>* failure) {
  const store::TaskRow& task = done.work.task;
  const store::TaskLease& lease = done.work.lease;
  leases_.erase(task.id);
  const int64_t now = NowMs();
  if (done.output.ok()) {
    if (!done.output->stats.empty()) {
      if (absl::Status s = store_->PutTensorStats(job_id_, done.output->stats); !s.ok()) return s;
    }
    if (absl::Status s =
            store_->CompleteTask(lease, done.output->path, static_cast<int64_t>(done.output->bytes),
                                 done.output->sha256, now);
        !s.ok()) {
      return s;
    }
    std::string message = absl::StrCat(TaskLabel(task), " done");
    if (!done.output->path.empty()) {
      absl::StrAppend(&message, ": ", done.output->path, ", ", done.output->bytes, " bytes");
    }
    if (absl::Status s = store_->AddEvent(job_id_, "task_done", message, now); !s.ok()) return s;
    progress_.TaskDone(task.name, static_cast<uint64_t>(task.bytes_total), done.reported);
    if (kill_when_done_.count(task.id) != 0) KillSelf();
    return absl::OkStatus();
  }
  progress_.TaskAbandoned(done.reported);
  const absl::Status& error = done.output.status();
  // Interrupted by the cancel flag: the task stays leased and is requeued when the run stops.
  if (error.code() == absl::StatusCode::kCancelled && cancel_->load()) return absl::OkStatus();
  // Stage errors usually start with the shard's name already.
  const std::string message =
      absl::StrCat(absl::StartsWith(error.message(), task.name) ? task.stage_kind : TaskLabel(task),
                   ": ", error.message());
  if (const std::optional<int64_t> delay_ms = RetryDelayMs(error.code(), task.attempt)) {
    if (absl::Status s = store_->FailTask(lease, message, false, now + *delay_ms, now); !s.ok()) {
      return s;
    }
    const std::string line = absl::StrCat(message, "; retrying in ", *delay_ms / 1000,
                                          " s (attempt ", task.attempt, " of ", kMaxAttempts, ")");
    progress_.Message(line);
    return store_->AddEvent(job_id_, "task_retry", line, now);
  }
  if (absl::Status s = store_->FailTask(lease, message, true, 0, now); !s.ok()) return s;
  progress_.Message(absl::StrCat("failed: ", message));
  if (!failure->has_value()) *failure = absl::Status(error.code(), message);
  return store_->AddEvent(job_id_, "task_failed", message, now);
}

absl::Status Runner::RenewLeases() {
  for (auto& [id, lease] : leases_) {
    if (absl::Status s = store_->RenewLease(lease, NowMs(), kLeaseMs); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Runner::AllStagesSucceeded() {
  absl::StatusOr<std::vector<store::StageProgress>> stages = store_->Progress(job_id_);
  if (!stages.ok()) return stages.status();
  for (const store::StageProgress& p : *stages) {
    if (p.state != store::StageState::kSucceeded) return false;
  }
  return true;
}

absl::Status Runner::Loop() {
  const int workers = static_cast<int>(workers_.size());
  std::optional<absl::Status> failure;  // the first permanent task error
  bool stopping = false;
  int64_t last_renew_ms = NowMs();
  while (true) {
    if (cancel_->load()) stopping = true;
    while (!stopping && !failure.has_value() && static_cast<int>(leases_.size()) < workers) {
      store::TaskLease lease;
      absl::StatusOr<std::optional<store::TaskRow>> task =
          store_->LeaseNextTask(job_id_, owner_, NowMs(), kLeaseMs, &lease);
      if (!task.ok()) return task.status();
      if (!task->has_value()) break;
      if (absl::Status s = StartTask(std::move(**task), lease); !s.ok()) return s;
    }
    if (leases_.empty()) {
      absl::StatusOr<bool> finished = AllStagesSucceeded();
      if (!finished.ok()) return finished.status();
      if (*finished) break;
      if (stopping) {
        progress_.EndStage();
        absl::StatusOr<int> requeued = store_->RequeueJobLeases(job_id_, NowMs());
        if (!requeued.ok()) return requeued.status();
        if (absl::Status s =
                store_->SetJobState(job_id_, JobState::kPaused, "interrupted", "", NowMs());
            !s.ok()) {
          return s;
        }
        return absl::CancelledError(
            "interrupted; the job is PAUSED: run the same command again to resume");
      }
      if (failure.has_value()) {
        progress_.EndStage();
        return FailJob(*failure, "task_failed");
      }
    }
    // Results come back here; with nothing running this only waits out a retry back-off.
    if (std::optional<Done> done = done_.PopFor(kWakeEvery)) {
      if (absl::Status s = Record(std::move(*done), &failure); !s.ok()) return s;
    }
    if (NowMs() - last_renew_ms >= kRenewEveryMs) {
      if (absl::Status s = RenewLeases(); !s.ok()) return s;
      last_renew_ms = NowMs();
    }
    progress_.Tick();
  }
  progress_.EndStage();
  int swept = 0;
  for (const std::string& dir : {spec_.output, spec_.materialize_bf16}) {
    absl::StatusOr<int> n = SweepTmpFiles(dir);
    if (!n.ok()) return n.status();
    swept += *n;
  }
  if (swept > 0) {
    if (absl::Status s = store_->AddEvent(
            job_id_, "sweep", absl::StrCat("removed ", swept, " stale .tmp file(s)"), NowMs());
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = store_->SetJobState(job_id_, JobState::kSucceeded, "", "", NowMs());
      !s.ok()) {
    return s;
  }
  progress_.Message(absl::StrCat("job ", job_id_, " SUCCEEDED: ", spec_.output));
  return absl::OkStatus();
}

absl::Status Runner::Run() {
  absl::StatusOr<std::optional<KillHook>> hook = ParseKillHook(getenv("QUANTD_TEST_KILL_AT"));
  if (!hook.ok()) return hook.status();
  kill_hook_ = *hook;
  if (absl::Status s = OpenJob(); !s.ok()) return s;
  absl::StatusOr<store::JobRow> job = store_->GetJob(job_id_);
  if (!job.ok()) return job.status();
  if (job->state == JobState::kSucceeded) {
    progress_.Message(absl::StrCat("job ", job_id_, " already SUCCEEDED: ", spec_.output));
    return absl::OkStatus();
  }
  if (job->state == JobState::kCancelled) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id_, " in ", options_.state_path, " was cancelled"));
  }
  const bool resumed = job->state != JobState::kPending;
  if (absl::Status s = store_->SetJobState(job_id_, JobState::kRunning,
                                           resumed ? "resumed" : "started", "", NowMs());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Prepare(); !s.ok()) return FailJob(s, "cannot_start");
  absl::StatusOr<int> requeued = store_->RequeueJobLeases(job_id_, NowMs());
  if (!requeued.ok()) return requeued.status();
  absl::StatusOr<int> reset = store_->ResetFailedTasks(job_id_, NowMs());
  if (!reset.ok()) return reset.status();
  if (resumed) {
    int64_t done = 0;
    for (const store::TaskRow& t : stored_tasks_) done += t.state == store::TaskState::kDone;
    progress_.Message(absl::StrCat("resuming job ", job_id_, ": ", done, " of ",
                                   stored_tasks_.size(), " tasks done, ", *requeued,
                                   " interrupted and ", *reset, " failed task(s) to redo"));
  }
  if (absl::Status s = StartWorkers(); !s.ok()) return FailJob(s, "cannot_start");
  absl::Status s = Loop();
  StopWorkers();
  return s;
}

}  // namespace

std::optional<int64_t> RetryDelayMs(absl::StatusCode code, int attempt) {
  const bool transient = code == absl::StatusCode::kUnavailable ||
                         code == absl::StatusCode::kResourceExhausted ||
                         code == absl::StatusCode::kCancelled;
  if (!transient || attempt >= kMaxAttempts) return std::nullopt;
  return int64_t{1000} << attempt;
}

std::string RunRequestId(const JobSpec& spec) {
  checkpoint::Sha256 sha;
  const std::string json = JobSpecToJson(spec);
  sha.Update(json.data(), json.size());
  return absl::StrCat("run:", sha.HexDigest());
}

absl::Status RunJob(const RunOptions& options) { return Runner(options).Run(); }

absl::StatusOr<std::vector<store::AmaxRow>> LoadAmaxFile(const std::string& path,
                                                         const TensorInventory& inventory) {
  absl::StatusOr<std::string> text = checkpoint::ReadFile(path);
  if (!text.ok()) return text.status();
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a JSON object {module: input_amax}"));
  }
  std::set<std::string> modules;
  for (const LinearModule& m : inventory.linears) modules.insert(m.name);
  std::vector<store::AmaxRow> rows;
  for (const auto& [module, value] : j.items()) {
    if (modules.count(module) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", module, " is not a linear module of the source checkpoint"));
    }
    const double v = value.is_number() ? value.get<double>() : NAN;
    if (!isfinite(v) || v < 0 || v > FLT_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": amax of ", module, " is ", value.dump(), "; expected a finite float32 >= 0"));
    }
    rows.push_back(store::AmaxRow{module, "input", static_cast<float>(v), 0});
  }
  return rows;
}

absl::Status CheckPlanUnchanged(const Plan& plan, const std::vector<store::TaskRow>& stored) {
  const std::string prefix =
      "the source checkpoint changed since the job was planned (or the plan was built by another "
      "quantd version): ";
  size_t k = 0;
  for (const store::StagePlan& stage : plan.stages) {
    for (size_t i = 0; i < stage.tasks.size(); ++i, ++k) {
      const store::TaskPlan& t = stage.tasks[i];
      if (k >= stored.size()) {
        return absl::FailedPreconditionError(
            absl::StrCat(prefix, stage.kind, " task ", t.name, " is new"));
      }
      const store::TaskRow& s = stored[k];
      if (s.stage_kind != stage.kind || s.name != t.name) {
        return absl::FailedPreconditionError(absl::StrCat(prefix, "expected ", s.stage_kind,
                                                          " task ", s.name, ", the source gives ",
                                                          stage.kind, " task ", t.name));
      }
      if (s.payload_json != t.payload_json || s.bytes_total != t.bytes_total) {
        return absl::FailedPreconditionError(absl::StrCat(
            prefix, stage.kind, " task ", t.name, " now covers different tensors or bytes (",
            t.bytes_total, " bytes, stored ", s.bytes_total, ")"));
      }
    }
  }
  if (k != stored.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(prefix, stored[k].stage_kind, " task ", stored[k].name, " is gone"));
  }
  return absl::OkStatus();
}

}  // namespace quantd::pipeline
