// Stage: one kind of work of a conversion job (inspect, quantize, verify, ...), as a type. A stage
// plans its tasks from the job and its source, runs one task on a device, and records what a task
// produced in the transaction that marks the task done. The stages a job can have are listed once,
// in stage_registry.cc; adding a stage is one file under stages/ plus one line there.
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
#include "server/store/job_store.h"

namespace quantd::calibration {
class JobCalibration;  // calibration/job_calibration.h
}  // namespace quantd::calibration
namespace quantd::evaluation {
class JobEvaluation;  // evaluation/job_evaluation.h
}  // namespace quantd::evaluation

namespace quantd::pipeline {

// The file a DONE task of the job recorded when it was marked done (store::TaskRow output_*).
struct RecordedOutput {
  std::string path;
  int64_t bytes = 0;
  std::string sha256;  // hex
};

// What one task reads while it runs: the job (shared read-only by every worker) and the task's
// own hooks.
struct StageContext {
  const job::JobSpec* spec = nullptr;
  const checkpoint::CheckpointDir* source = nullptr;  // opened once per run
  const checkpoint::TensorInventory* inventory = nullptr;  // of `source`
  const Plan* plan = nullptr;                         // the job's plan
  // The directories the job writes, opened once when it was claimed (checkpoint/dir_handle.h):
  // every file of the output, the BF16 copy and calibration.amax_out is created, renamed and
  // removed beneath these handles, never through the spec's paths. Null when the spec has no
  // such path.
  // The source directory as resolved at submit, opened once (export copies its files from it).
  const checkpoint::DirHandle* source_dir = nullptr;            // spec.source
  const checkpoint::DirHandle* output_dir = nullptr;            // spec.output
  const checkpoint::DirHandle* materialize_bf16_dir = nullptr;  // spec.materialize_bf16
  const checkpoint::DirHandle* amax_out_dir = nullptr;  // the directory of calibration.amax_out
  // calibration.amax_out existed when the job was loaded (so admission let the job replace it);
  // a file that appears there later is another writer's, never replaced without overwrite.
  bool amax_out_existed = false;
  const std::vector<store::TaskRow>* stored_tasks = nullptr;  // the plan as stored
  kernels::Backend* backend = nullptr;  // the kernels of the device the task runs on
  // Calibrated max |input| per quantized module (the amax table), for input_scale.
  const std::map<std::string, float>* input_amax = nullptr;
  // A calibrating job's runtime state (activations, tokens, amax so far); nullptr otherwise.
  calibration::JobCalibration* calibration = nullptr;
  // A job's evaluate-stage state (activations, figures so far); nullptr when it does not evaluate.
  evaluation::JobEvaluation* evaluation = nullptr;
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

struct TaskOutput {
  std::string path;      // the file the task wrote ("" when it wrote none)
  uint64_t bytes = 0;    // its size
  std::string sha256;    // its SHA-256, hex
  // Per-tensor error against the source, recorded by the stage's Record.
  std::vector<store::TensorStatsRow> stats;
  // Amax contribution (calibrate tasks; calibration/amax_rows.h), recorded by the stage's Record.
  std::vector<store::AmaxRow> amax;
  int64_t calibrated_tokens = 0;    // token rows a calibrate task moved through its layer
  double calibration_seconds = 0;   // and the wall time it took (metrics)
  // Evaluate tasks (stages/evaluate_stage.h), recorded by that stage's Record: a layer's figures,
  // the job's figures (the head task); and the token rows the task moved (metrics).
  std::optional<store::EvaluationLayerRow> evaluation_layer;
  std::optional<store::EvaluationRow> evaluation;
  int64_t evaluated_tokens = 0;
  // For people: appended to the task's "done" event (a layer task's seconds of load, decode,
  // forward and record); "" for none.
  std::string summary;
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

  // Records what the task produced besides its file (statistics, amax contributions) inside the
  // transaction that marks it DONE: both commit or neither does, and a repeated completion does
  // not record twice. Default: nothing to record.
  virtual absl::Status Record(store::TaskRecord& /*txn*/, const store::TaskRow& /*task*/,
                              const TaskOutput& /*output*/) const {
    return absl::OkStatus();
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
