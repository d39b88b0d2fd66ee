// JobStore: the durable record of jobs, their stages and tasks, events, calibration amax rows and
// per-tensor statistics, in one SQLite file.
//
// Tasks are handed out as leases with an expiry (TaskLease), never as "this thread owns that
// shard": a worker completes a task by presenting its lease, a completion from a lease that was
// lost (expired and re-leased) is refused, and a second completion of the same attempt is a no-op.
// Remote workers (DESIGN.md "Beyond one node") can use the same calls through the coordinator.
//
// Not thread-safe: one thread owns the store (the daemon's store thread or quantd run's main
// thread; a read-only second store, OpenReadOnly, belongs to its own thread); times are Unix milliseconds passed in by the caller, which keeps tests deterministic.
#ifndef QUANTD_SERVER_STORE_JOB_STORE_H_
#define QUANTD_SERVER_STORE_JOB_STORE_H_

#include <stddef.h>
#include <stdint.h>

#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/compute/requirement.h"
#include "server/store/sqlite_db.h"

namespace quantd::store {

enum class JobState { kPending, kRunning, kPaused, kSucceeded, kFailed, kCancelled };
enum class StageState { kPending, kRunning, kSucceeded, kFailed };
enum class TaskState { kPending, kLeased, kDone, kFailed };

// "PENDING", "RUNNING", ... as stored and as the API spells them.
const char* JobStateName(JobState s);
std::optional<JobState> ParseJobState(const std::string& name);
const char* StageStateName(StageState s);
const char* TaskStateName(TaskState s);
bool IsTerminal(JobState s);

// The most bytes of a stored message: a job's or task's last error, an event, a quality gate's
// message. A longer one is cut (at a UTF-8 character boundary, with a note of its size) when it is
// written, and rows an older release wrote longer are cut the same way when read, so that no job,
// page of jobs or event list grows with what an input made an error say.
inline constexpr size_t kMaxStoredMessageBytes = 4096;
// `message` as the store keeps it: unchanged when at most kMaxStoredMessageBytes, else cut so that
// it is, ending in "... (<size> bytes in all)".
std::string CapStoredMessage(std::string message);

struct JobRow {
  int64_t id = 0;
  std::string request_id;  // "" when the client gave none
  std::string spec_json;
  JobState state = JobState::kPending;
  std::string reason;
  std::string error;
  int64_t created_ms = 0;
  int64_t updated_ms = 0;
  std::optional<int64_t> started_ms;
  std::optional<int64_t> finished_ms;
};

// What JobStore::DeleteJob requires of the job's state, checked in the deleting transaction.
enum class DeletePrecondition {
  kNotRunning,  // any state but RUNNING (DeleteJob)
  kFinished,    // SUCCEEDED, FAILED or CANCELLED (history retention: a job resumed since it was
                // selected is kept)
};

// A task named in a plan: task `task` of the stage of kind `stage`.
struct TaskRef {
  std::string stage;
  std::string task;

  bool operator==(const TaskRef&) const = default;
};

// One unit of work as the planner describes it.
struct TaskPlan {
  std::string name;          // e.g. output shard file name; unique within its stage
  std::string payload_json;  // what the stage needs
  int64_t bytes_total = 0;   // bytes it will process
  std::string label;         // for people, e.g. "shard 3 of 12"; "" when the name says it
  compute::DeviceRequirement requirement;  // the device it must run on
  // Tasks of this or earlier stages that must be DONE before this one is leased.
  std::vector<TaskRef> depends_on;
};

struct StagePlan {
  std::string kind;  // a kind of the stage registry (pipeline/stage_registry.h)
  std::vector<TaskPlan> tasks;
};

struct TaskRow {
  int64_t id = 0;
  int64_t job_id = 0;
  int64_t stage_id = 0;
  std::string stage_kind;
  int64_t ordinal = 0;
  std::string name;
  std::string payload_json;
  int64_t bytes_total = 0;
  std::string label;                       // TaskPlan::label
  compute::DeviceRequirement requirement;  // where the scheduler may place it
  TaskState state = TaskState::kPending;
  int attempt = 0;
  std::string lease_owner;
  std::optional<int64_t> lease_expires_ms;
  std::string output_path;
  std::optional<int64_t> output_bytes;
  std::string output_sha256;
  std::string error;
  // The lease owner of the attempt that completed the task, or that failed it for good
  // (lease_owner's form: "worker:<name>", "quantd:<pid>"); kept when the task is requeued, until
  // an attempt of it ends again. "" when none has (or it ended before schema version 4).
  std::string ran_by;
};

// Proof that a worker holds a task: the task, the attempt it started, and who holds it.
struct TaskLease {
  int64_t task_id = 0;
  int attempt = 0;
  std::string owner;
  int64_t expires_ms = 0;
};

// A file that a DONE task recorded as its output (TaskRow::output_path, output_bytes,
// output_sha256).
struct RecordedOutput {
  int64_t job_id = 0;
  int64_t bytes = 0;
  std::string sha256;
};

struct StageProgress {
  int64_t stage_id = 0;
  std::string kind;
  StageState state = StageState::kPending;
  int64_t tasks_total = 0;
  int64_t tasks_done = 0;
  int64_t bytes_total = 0;
  int64_t bytes_done = 0;  // bytes_total of the done tasks
  std::optional<int64_t> started_ms;
  std::optional<int64_t> finished_ms;
  int64_t task_attempts = 0;  // attempts started over the stage's tasks
};

// How many DONE tasks of one stage one lease owner ran (TaskRow::ran_by).
struct StageRunner {
  int64_t stage_id = 0;
  std::string ran_by;
  int64_t tasks = 0;

  bool operator==(const StageRunner&) const = default;
};

struct EventRow {
  int64_t id = 0;
  int64_t at_ms = 0;
  std::string kind;
  std::string message;
};

struct AmaxRow {
  std::string module;
  std::string kind;  // "input" | "kv"
  double value = 0;
  int64_t samples = 0;
};

// One task's amax contribution as stored (TaskRecord::PutTaskAmax).
struct TaskAmaxRow {
  int64_t task_id = 0;
  AmaxRow amax;
};

struct TensorStatsRow {
  std::string tensor;
  double rel_rmse = 0;
  double sqnr_db = 0;
  double max_abs_err = 0;

  bool operator==(const TensorStatsRow&) const = default;
};

// One decoder layer's figures of the evaluate stage (pipeline/stages/evaluate_stage.h): the
// hidden-state SQNR of the quantized model against the source as its sums (evaluation/sqnr.h), so
// that an exact +inf dB (noise 0) round-trips. A NaN sum is stored as NULL and read back as NaN.
struct EvaluationLayerRow {
  int64_t layer = 0;
  double free_running_signal = 0;  // the quantized model on its own activations
  double free_running_noise = 0;
  double teacher_forced_signal = 0;  // the quantized layer on the source's activations
  double teacher_forced_noise = 0;
  double seconds = 0;  // the task's wall time
};

// The evaluate stage's job-level figures (evaluation/next_token_metrics.h) and the quality gate's
// verdict. NaN figures are stored as NULL and read back as NaN.
struct EvaluationRow {
  int64_t samples = 0;  // held-out samples
  int64_t tokens = 0;
  std::string numerics;   // "official" | "math"
  int64_t positions = 0;  // compared (KL, top-1)
  int64_t predicted = 0;  // with a next token (perplexity)
  double mean_kl = 0;
  double p99_kl = 0;
  double max_kl = 0;
  double top1_agreement = 0;
  double source_ppl = 0;
  double quantized_ppl = 0;
  double ppl_ratio = 0;
  bool gate_passed = true;
  std::string gate_message;  // "" when passed
  double seconds = 0;        // the stage's tasks' wall time
};

// What a device can take: LeaseNextTask leases only a task whose requirement fits.
struct DeviceCapacity {
  bool gpu = true;  // a CUDA device: tasks requiring a GPU may run here
  int64_t memory_bytes = std::numeric_limits<int64_t>::max();  // device memory free for the task
};

// The open transaction in which CompleteTask marks a task DONE, handed to the stage to record
// what the task produced besides its file (pipeline/stage.h Stage::Record): it commits together
// with the completion, or not at all. Only CompleteTask creates one.
class TaskRecord {
 public:
  int64_t job_id() const { return job_id_; }
  int64_t task_id() const { return task_id_; }
  // Per-tensor error statistics; a tensor's row replaces the one an earlier run wrote.
  absl::Status PutTensorStats(const std::vector<TensorStatsRow>& rows);
  // This task's amax contribution (ListAmax merges it into the job's amax): it replaces what an
  // earlier run of the same task contributed, so a task that runs twice never counts twice.
  absl::Status PutTaskAmax(const std::vector<AmaxRow>& rows);
  // This task's evaluation figures for one decoder layer; they replace what an earlier run of the
  // task (or another task of the job for the same layer) wrote.
  absl::Status PutEvaluationLayer(const EvaluationLayerRow& row);
  // The job's evaluation figures, written by this task; they replace the job's earlier ones.
  absl::Status PutEvaluation(const EvaluationRow& row);

 private:
  friend class JobStore;
  TaskRecord(SqliteDb& db, int64_t job_id, int64_t task_id)
      : db_(db), job_id_(job_id), task_id_(task_id) {}

  SqliteDb& db_;           // inside CompleteTask's transaction
  const int64_t job_id_;   // the job of the task
  const int64_t task_id_;  // the task being completed
};

// How JobStore::Open treats the file; the defaults open or create it, as `quantd run` does.
struct StoreOpenOptions {
  // A missing or 0-byte file is FailedPrecondition instead of a new, empty store (the daemon sets
  // this when its state dir holds other files, unless started with --init).
  bool must_exist = false;
  // Before anything else: PRAGMA quick_check; damage is DataLoss naming the file and what to
  // restore. After the migrations: a copy of the checked database at `backup_path`.
  bool check_integrity = false;
  std::string backup_path;  // "" = no backup
};

class JobStore {
 public:
  // Opens or creates the database at `path` and applies the built-in migrations.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path,
                                                        const StoreOpenOptions& options = {});
  // A second connection to a store another JobStore has opened (and migrated): its reads see the
  // last committed state while the writer works (WAL), and every write fails. Reads that must
  // agree with each other go in one db().ReadTransaction.
  static absl::StatusOr<std::unique_ptr<JobStore>> OpenReadOnly(const std::string& path);

  // Creates a PENDING job. With a non-empty request_id that already names a job, returns that
  // job's id and sets *created = false (idempotent submission).
  absl::StatusOr<int64_t> CreateJob(const std::string& request_id, const std::string& spec_json,
                                    int64_t now_ms, bool* created = nullptr);
  absl::StatusOr<JobRow> GetJob(int64_t job_id);
  // The job submitted with `request_id` (non-empty), nullopt when none.
  absl::StatusOr<std::optional<JobRow>> FindJobByRequestId(const std::string& request_id);
  // Jobs with id > after_id (paging), optionally in one state, ascending id, at most `limit`.
  absl::StatusOr<std::vector<JobRow>> ListJobs(std::optional<JobState> state, int64_t after_id,
                                               int limit);
  // Deletes a job and everything it owns when its state meets `precondition` at the moment of
  // the delete (FailedPrecondition otherwise).
  absl::Status DeleteJob(int64_t job_id,
                         DeletePrecondition precondition = DeletePrecondition::kNotRunning);

  // Moves the job to `state`, enforcing the job model's transitions (FailedPrecondition
  // otherwise), and records an event. Entering RUNNING sets started_ms the first time; entering a
  // terminal state sets finished_ms.
  absl::Status SetJobState(int64_t job_id, JobState state, const std::string& reason,
                           const std::string& error, int64_t now_ms);

  // Stores the job's stages (in display order) and tasks with their dependency edges. Only once
  // per job; every stage needs >= 1 task, stage kinds must differ, task names must be unique
  // within their stage, and a dependency must name a task of the same or an earlier stage
  // (InvalidArgument naming it otherwise). The store does not interpret stage kinds.
  absl::Status SetPlan(int64_t job_id, const std::vector<StagePlan>& stages);
  bool HasPlan(int64_t job_id);
  // The dependency edges of the job's tasks: (task id, id of a task it depends on), ascending.
  absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ListDependencies(int64_t job_id);

  // Leases the next runnable task: a PENDING task (not_before_ms <= now) whose dependencies are
  // all DONE and whose requirement fits `capacity`, the first in display order (stage, then task
  // ordinal). Independent tasks of any stages may run at once. nullopt when nothing is runnable.
  absl::StatusOr<std::optional<TaskRow>> LeaseNextTask(int64_t job_id, const std::string& owner,
                                                       int64_t now_ms, int64_t lease_ms,
                                                       TaskLease* lease,
                                                       const DeviceCapacity& capacity = {});
  absl::Status RenewLease(TaskLease& lease, int64_t now_ms, int64_t lease_ms);
  // Marks the leased task DONE with its output, recording the lease's owner as its ran_by, and runs `record` (when given) in the same
  // transaction; finishes the stage when it was the last task. If `record` fails nothing is
  // written and its error is returned. A repeated completion of the same attempt is OK and does
  // not run `record` again; a lost lease is FailedPrecondition.
  absl::Status CompleteTask(const TaskLease& lease, const std::string& output_path,
                            int64_t output_bytes, const std::string& output_sha256,
                            int64_t now_ms,
                            const std::function<absl::Status(TaskRecord&)>& record = nullptr);
  // Returns DONE tasks whose output is gone or changed to PENDING, with every DONE task that
  // depends on them (directly or not), and reopens their stages; `reason` becomes their error and
  // an event. Returns how many tasks were requeued.
  absl::StatusOr<int> RequeueDoneTasks(int64_t job_id, const std::vector<int64_t>& task_ids,
                                       const std::string& reason, int64_t now_ms);
  // Records a failed attempt. permanent: the task and its stage become FAILED (the lease's owner
  // becomes the task's ran_by). Otherwise the task returns to PENDING and is not leased again before
  // retry_at_ms (its ran_by stays what it was).
  absl::Status FailTask(const TaskLease& lease, const std::string& error, bool permanent,
                        int64_t retry_at_ms, int64_t now_ms);
  // Returns LEASED tasks whose lease expired before now to PENDING. Returns how many.
  absl::StatusOr<int> RequeueExpiredLeases(int64_t now_ms);
  // Returns every LEASED task of the job to PENDING (a restarted process held them). Returns how many.
  absl::StatusOr<int> RequeueJobLeases(int64_t job_id, int64_t now_ms);
  // Returns FAILED tasks and stages of the job to PENDING (resume after the input was fixed).
  absl::StatusOr<int> ResetFailedTasks(int64_t job_id, int64_t now_ms);

  absl::StatusOr<std::vector<StageProgress>> Progress(int64_t job_id);
  // Who ran the job's DONE tasks, per stage: by stage (display order), then owner. Tasks without
  // a recorded runner are left out.
  absl::StatusOr<std::vector<StageRunner>> ListStageRunners(int64_t job_id);
  // What DONE tasks of any job recorded writing at `output_path`, by task id: how quantd knows
  // that it wrote a file (a job's calibration.amax_out, scheduler/admission.cc).
  absl::StatusOr<std::vector<RecordedOutput>> FindRecordedOutputs(const std::string& output_path);
  absl::StatusOr<std::vector<TaskRow>> ListTasks(int64_t job_id);

  absl::Status AddEvent(int64_t job_id, const std::string& kind, const std::string& message,
                        int64_t now_ms);
  absl::StatusOr<std::vector<EventRow>> ListEvents(int64_t job_id, int64_t after_id);
  // Events of the job of one kind (e.g. "task_retry").
  absl::StatusOr<int64_t> CountEvents(int64_t job_id, const std::string& kind);

  // Max-merges job-level amax rows (value = max, samples = sum) for the job.
  absl::Status MergeAmax(int64_t job_id, const std::vector<AmaxRow>& rows);
  // The job's amax: its job-level rows max-merged with every task's contribution (TaskRecord).
  absl::StatusOr<std::vector<AmaxRow>> ListAmax(int64_t job_id);
  // The job's task contributions alone (TaskRecord::PutTaskAmax), by task id then module, kind.
  absl::StatusOr<std::vector<TaskAmaxRow>> ListTaskAmax(int64_t job_id);
  absl::StatusOr<std::vector<TensorStatsRow>> ListTensorStats(int64_t job_id);
  // The job's per-layer evaluation figures, by layer.
  absl::StatusOr<std::vector<EvaluationLayerRow>> ListEvaluationLayers(int64_t job_id);
  // The job's evaluation figures; nullopt before the evaluate stage recorded them.
  absl::StatusOr<std::optional<EvaluationRow>> GetEvaluation(int64_t job_id);

  SqliteDb& db() { return *db_; }

 private:
  explicit JobStore(std::unique_ptr<SqliteDb> db) : db_(std::move(db)) {}

  std::unique_ptr<SqliteDb> db_;  // this store's connection; used by one thread at a time
};

}  // namespace quantd::store

#endif  // QUANTD_SERVER_STORE_JOB_STORE_H_
