// Stage: one kind of work of a conversion job (inspect, quantize, verify, ...), as a type. A stage
// plans its tasks from the job and its source, runs one task on a device, and records what a task
// produced in the transaction that marks the task done. The stages a job can have are listed once,
// in stage_registry.cc; adding a stage is one file under stages/ plus one line there. A stage that
// keeps state for a job between its tasks (calibrate's activations, evaluate's figures) keeps it
// in a StageJob of its own type (OpenJob): the engine opens, attaches, informs and destroys it
// without knowing what it holds, hands it to the stage's tasks, and asks the stage, never the
// payload, how its running tasks stand.
//
// Stages never hold the JobStore: the scheduler leases a task once its dependencies are done, runs
// it (several at once on worker threads, so Run must be thread-safe) and completes it with the
// stage's Record. A stage writes only `<file>.tmp` and renames it into place when complete
// (checkpoint/atomic_file.h, SafetensorsWriter), so re-running an interrupted task is harmless.
//
// Errors from Run: InvalidArgument / DataLoss for bad input (a corrupt shard, a tensor that breaks a
// rule: permanent, the message names the file and the tensor), Unavailable / ResourceExhausted for
// transient conditions (EAGAIN, ENOSPC: retried with back-off), Cancelled when `cancelled` was set
// (the task is requeued as interrupted). A permanent error fails the job with reason "task_failed",
// or with the reason it carries (WithJobReason: e.g. the evaluate stage's QUALITY_GATE).
#ifndef QUANTD_SERVER_PIPELINE_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGE_H_

#include <stdint.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/dir_handle.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/compute/device.h"
#include "server/job/job_spec.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stored_job.h"
#include "server/store/job_store.h"

namespace quantd::pipeline {

class StageJob;

// The file a DONE task of the job recorded when it was marked done (store::TaskRow output_*).
struct RecordedOutput {
  std::string path;
  int64_t bytes = 0;
  std::string sha256;  // hex
  // The completion was recorded by this process, which hashed the bytes as it wrote them and
  // fsynced them; false for one read from the store (an earlier process's, a resumed job's).
  bool written_by_this_process = false;
};

// What one task reads while it runs: the job (shared read-only by every worker) and the task's
// own hooks.
struct StageContext {
  const job::JobSpec* spec = nullptr;
  const checkpoint::CheckpointDir* source = nullptr;  // opened once per run
  const checkpoint::TensorInventory* inventory = nullptr;  // of `source`
  const Plan* plan = nullptr;                         // the job's plan
  // The directories the job writes, opened once when it was claimed (checkpoint/dir_handle.h):
  // every file of the output and the BF16 copy is created, renamed and removed beneath these
  // handles, never through the spec's paths (a stage that writes elsewhere opens its directory
  // in its StageJob: calibrate's calibration.amax_out). Null when the spec has no such path.
  // The source directory as resolved at submit, opened once (export copies its files from it).
  const checkpoint::DirHandle* source_dir = nullptr;            // spec.source
  const checkpoint::DirHandle* output_dir = nullptr;            // spec.output
  const checkpoint::DirHandle* materialize_bf16_dir = nullptr;  // spec.materialize_bf16
  const std::string* work_dir = nullptr;  // the job's own directory (stored_job.h JobWorkDir)
  const std::vector<store::TaskRow>* stored_tasks = nullptr;  // the plan as stored
  kernels::Backend* backend = nullptr;  // the kernels of the device the task runs on
  // Max |input| per quantized module from the store (calibration.amax_file, the constant recipe
  // or an earlier run's rows), for input_scale when no stage of the job measures it.
  const std::map<std::string, float>* input_amax = nullptr;
  // The job object of the task's own stage (Stage::OpenJob); nullptr for a stateless stage. Only
  // that stage knows its type.
  StageJob* job = nullptr;
  // The job object of stage `kind` of this job; nullptr when that stage opened none (a stage that
  // reads another's state, e.g. quantize the calibrate stage's amax, asks through that stage's
  // header, which knows the type).
  std::function<StageJob*(std::string_view kind)> job_of;
  // Called with the number of source bytes just processed (for progress); thread-safe. Each call,
  // with 0 bytes too, is the task's heartbeat: a task silent for a whole lease (60 s) loses it.
  std::function<void(uint64_t)> add_progress;
  // Set when the job is being cancelled or the process is stopping; checked between tensors.
  const std::atomic<bool>* cancelled = nullptr;
  // The file the DONE task (stage kind, task name) of this job recorded, nullopt when that task
  // is not done or wrote no file; thread-safe. Verify checks the bytes it reads back against it.
  std::function<std::optional<RecordedOutput>(std::string_view kind, const std::string& name)>
      recorded_output;
};

// The status payload that names the job's failure reason (its value, e.g. "QUALITY_GATE").
inline constexpr absl::string_view kJobReasonPayload = "quantd.dev/job_reason";

// `error` carrying the job's failure reason `reason`.
inline absl::Status WithJobReason(absl::Status error, std::string_view reason) {
  error.SetPayload(kJobReasonPayload, absl::Cord(absl::string_view(reason.data(), reason.size())));
  return error;
}

// The failure reason `error` carries, or "task_failed".
inline std::string JobReasonOf(const absl::Status& error) {
  const auto reason = error.GetPayload(kJobReasonPayload);
  return reason.has_value() ? std::string(*reason) : std::string("task_failed");
}

// What a task produced besides its file, in the type of its stage (e.g. a calibrate task's amax
// rows): the stage's Record stores it and its StageJob::TaskDone takes it in. Only that stage
// knows the type.
class StageResult {
 public:
  virtual ~StageResult() = default;
};

// A figure a task adds to one of the daemon's task metrics, named as metrics/metrics.h serves it
// (a counter's increment, a histogram's observation).
struct TaskFigure {
  std::string metric;  // "quantd_calibrated_tokens_total"
  double value = 0;
};

struct TaskOutput {
  std::string path;      // the file the task wrote ("" when it wrote none)
  uint64_t bytes = 0;    // its size
  std::string sha256;    // its SHA-256, hex
  // Per-tensor error against the source, recorded by the stage's Record.
  std::vector<store::TensorStatsRow> stats;
  // The stage's own result (recorded by its Record); nullptr for none.
  std::unique_ptr<const StageResult> result;
  // Added to the task metrics once the task's completion is committed.
  std::vector<TaskFigure> figures;
  // For people: appended to the task's "done" event (a layer task's seconds of load, decode,
  // forward and record); "" for none.
  std::string summary;
};

// What a stage's job object starts from (Stage::OpenJob), in the source phase of a (re)start:
// any thread, files only, never the store.
struct StageJobInput {
  const job::JobSpec* spec = nullptr;  // as PreparedJob resumes it (Stage::AdaptSpec)
  const StoredJob* stored = nullptr;   // the store's view of the job when the start began
  // The job's source as the start opened it: a stage's job that reads the source keeps this one
  // (its shards are mapped once per job, not once per reader).
  std::shared_ptr<const checkpoint::CheckpointDir> source;
  // The DONE tasks whose output the start found gone or changed: the store phase requeues them.
  const std::set<int64_t>* changed_outputs = nullptr;
};

// What a stage's job object attaches to in the store phase of a (re)start (StageJob::Attach), on
// the store's thread.
struct StageJobAttach {
  store::JobStore* store = nullptr;
  int64_t job_id = 0;
  int64_t now_ms = 0;
  const std::function<void(const std::string&)>* log = nullptr;  // the start's log; may be empty
  // The job's tasks as stored now; listed again by whoever requeues some of them.
  std::vector<store::TaskRow>* tasks = nullptr;
};

// The state one stage keeps for one job in this process between its tasks (activations in
// memory, layer checkpoints, figures so far), made by Stage::OpenJob when the job (re)starts and
// destroyed, releasing it all, when the job stops in this process. Thread-safe: the worker
// threads run the stage's tasks against it while the scheduler reports completions.
class StageJob {
 public:
  virtual ~StageJob() = default;

  // The store phase of a (re)start, once, after the plan is stored and the changed outputs are
  // requeued: applies where OpenJob found the stage resumes (requeueing its done tasks after
  // that point, and logging it) and restores what the stage keeps from its stored rows.
  virtual absl::Status Attach(StageJobAttach& /*attach*/) { return absl::OkStatus(); }

  // A task of the stage completed with `output`, its completion committed (never before, so the
  // state never runs ahead of the store).
  virtual void TaskDone(const store::TaskRow& /*task*/, const TaskOutput& /*output*/) {}

  // FailedPrecondition naming the spec field when a directory the stage writes for the job,
  // opened by OpenJob, was renamed or replaced since (checked around every task of the job).
  virtual absl::Status CheckDirsUnchanged() const { return absl::OkStatus(); }
};

class Stage {
 public:
  virtual ~Stage() = default;

  // The stage's name, stored with the job and used as the metric label ("quantize").
  virtual std::string_view kind() const = 0;

  // The stage's tasks for this job, in display order, each with its label, device requirement and
  // the tasks it depends on (of this or earlier stages in the registry). Empty when the job does
  // not need the stage.
  virtual absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const = 0;

  // Runs one task of this stage on `device`; ctx.backend is the device's kernels.
  virtual absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                         const StageContext& ctx) const = 0;

  // Records what the task produced besides its file (statistics, TaskOutput::result) inside the
  // transaction that marks it DONE: both commit or neither does, and a repeated completion does
  // not record twice. Default: nothing to record.
  virtual absl::Status Record(store::TaskRecord& /*txn*/, const store::TaskRow& /*task*/,
                              const TaskOutput& /*output*/) const {
    return absl::OkStatus();
  }

  // The stage's state for one job (a StageJob of its own type), opened in the source phase of
  // every (re)start of the job, before any of its tasks runs: it creates what the stage keeps in
  // the job's work directory and, on a later start, finds from input.stored and its files where
  // the stage resumes. nullptr (the default): the stage keeps no state between tasks, or the job
  // does not need the stage. Errors fail the job, naming the file or field.
  virtual absl::StatusOr<std::unique_ptr<StageJob>> OpenJob(const StageJobInput& /*input*/) const {
    return nullptr;
  }

  // On a later start of a planned job: `spec` adapted to the plan stored by an earlier release
  // (e.g. a stage that release did not have switches itself off when `stored` has none of its
  // tasks), before anything is planned from it. Default: nothing.
  virtual void AdaptSpec(const std::vector<store::TaskRow>& /*stored*/,
                         job::JobSpec& /*spec*/) const {}

  // Whether the recorded output of the stage's DONE `task` is checked by the stage's own resume
  // (OpenJob) rather than hashed with the job's other outputs at a restart: a layer checkpoint,
  // removed on purpose once a later one is written. Default: false.
  virtual bool ChecksOwnOutput(const store::TaskRow& /*task*/) const { return false; }

  // What the stage's task bytes count in its progress (StageProgress.unit): "bytes", or e.g.
  // "tokens" for a stage whose tasks move token rows through a model.
  virtual std::string_view progress_unit() const { return "bytes"; }

  // Where the stage is, for people (StageProgress.step, `quantd run`), given its tasks running now
  // in this process (maybe none): e.g. "layer 3 of 8"; "" (the default) to say nothing.
  virtual std::string ProgressStep(const std::vector<const store::TaskRow*>& /*running*/) const {
    return "";
  }

  // Bytes the stage's layer checkpoints (calibration/layer_checkpoint.h) take at most at once in
  // the job's work directory, for `tasks`, its Plan(input). Default: it keeps none.
  virtual absl::StatusOr<uint64_t> CheckpointBytes(
      const PlanInput& /*input*/, const std::vector<store::TaskPlan>& /*tasks*/) const {
    return 0;
  }
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGE_H_
