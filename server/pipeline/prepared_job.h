// PreparedJob: everything running one job's tasks needs, built once each time a process (the
// daemon or `quantd run`) starts or resumes the job: the opened source checkpoint, its tensor
// inventory, the plan and the amax table. Read-only afterwards, so worker threads share it.
//
// It is built in two phases, so that the thread owning the store never waits on files:
//   Load (the source phase, any thread, files only, never the store): re-checks that the job's
//     paths resolve as they did at submit, opens the source, builds inventory and plan; on the
//     first start reads calibration.amax_file and checks free disk space; on later starts
//     refuses to continue when the plan differs from the stored one (the source changed) and
//     hashes the output of every DONE task against its recorded size and SHA-256; claims the
//     output directories (OutputMarker); creates a calibrating job's JobCalibration (its work
//     and spill directories) and finds where its calibration resumes (below).
//   Attach (the store phase, on the store's thread): stores the plan (first start), requeues the
//     DONE tasks whose output Load found gone or changed (with the done tasks that depend on
//     them, so they are rebuilt) and reads the amax table.
// A Load whose job stopped meanwhile is simply destroyed: it wrote nothing but its markers and
// the job's work directory (a later Load cleans what it finds there).
//
// A calibrating job (stages/calibrate_stage.h) also owns its calibration::JobCalibration. Its
// activations between layers live in this process, except at a layer boundary, where a layer's
// outputs are also checkpointed on disk (calibration/layer_checkpoint.h). A later start whose
// calibration is unfinished resumes after the last layer L whose every slice is DONE with a
// checkpoint that exists and matches its recorded size and SHA-256 (Load verifies and loads it;
// the calibrate layer tasks' outputs are checked there, not with the other outputs): Attach
// requeues the done layer tasks after L, and with them the done tasks depending on them (quantize
// shards of those layers, amax_out), and logs the layer it resumes from. Without such a layer it
// resumes from layer 0 on the stored tokens. Tasks up to L keep their committed amax rows; a
// rerun task replaces its own, measuring what its first run measured (the same tokens, batches and
// inputs), so the result equals an uninterrupted run.
// Likewise a job that evaluates (stages/evaluate_stage.h) owns its evaluation::JobEvaluation,
// with layer checkpoints of its own (both models' outputs, "<work_dir>/evaluate-layers"): a later
// start whose evaluate stage is unfinished resumes after the last evaluate layer whose checkpoint
// verifies (Load verifies and loads it, JobEvaluation::Resume; the evaluate layer tasks' outputs
// are checked there, not with the other outputs), Attach requeues the done evaluate tasks after
// it (the head and gate included) and logs the layer; without one, from layer 0.
//
// Tasks are dispatched to the stage of their kind in the job's StageRegistry (RunTask) and
// completed with that stage's Record in the same transaction (CompleteTask).
#ifndef QUANTD_SERVER_PIPELINE_PREPARED_JOB_H_
#define QUANTD_SERVER_PIPELINE_PREPARED_JOB_H_

#include <stdint.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/calibration/job_calibration.h"
#include "server/calibration/layer_checkpoint.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/compute/device.h"
#include "server/evaluation/job_evaluation.h"
#include "server/job/job_spec.h"
#include "server/pipeline/output_marker.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"
#include "server/pipeline/stage_registry.h"
#include "server/pipeline/stored_job.h"
#include "server/store/job_store.h"

namespace quantd::pipeline {

inline constexpr int kMaxAttempts = 3;

// After a task's attempt `attempt` (from 1) failed with `code`: the back-off before the next
// attempt, or nullopt when the error is permanent (the job fails). Unavailable, ResourceExhausted
// and Cancelled (without a cancel request) are transient: 2 s, then 4 s, then permanent.
std::optional<int64_t> RetryDelayMs(absl::StatusCode code, int attempt);

class PreparedJob {
 public:
  // The source phase (any thread; reads files, never the store) of job `stored`, read from the
  // store by ReadStoredJob. Claims the output directories: created when absent; refused when
  // they hold files quantd did not write and the job would replace one of them; a directory
  // without a marker that holds only done outputs of this job (an earlier release wrote no
  // marker) is adopted. Errors name the file, tensor or field; the caller fails the job with
  // them. A DeepSeek-V4 source's config.json is held against its tensors first
  // (model/v4_config_check.h), and the plan against `limits`. `stages` must outlive the
  // PreparedJob. Every input it reads is named for the thread's budget (base::ScopedInput), so
  // an exception while reading one names it.
  static absl::StatusOr<std::unique_ptr<PreparedJob>> Load(
      const job::JobSpec& spec, StoredJob stored, const PlanLimits& limits = {},
      const StageRegistry& stages = BuiltinStages());

  // The store phase (the store's thread), once per Load. `log` receives the planning summary and
  // the requeued outputs.
  absl::Status Attach(store::JobStore& store, int64_t now_ms,
                      const std::function<void(const std::string&)>& log);

  // Runs one task of the job on `device` with the stage of its kind. `add_progress` receives
  // processed source bytes (thread-safe); the task stops with Cancelled between tensors once
  // `cancelled` is true. Unimplemented for a kind the registry does not know.
  absl::StatusOr<TaskOutput> RunTask(const store::TaskRow& task, compute::Device& device,
                                     const std::atomic<bool>* cancelled,
                                     std::function<void(uint64_t)> add_progress) const;

  // Marks the leased task DONE with `output` and its stage's Record, in one transaction
  // (store::JobStore::CompleteTask).
  absl::Status CompleteTask(store::JobStore& store, const store::TaskLease& lease,
                            const store::TaskRow& task, const TaskOutput& output,
                            int64_t now_ms) const;

  // Removes the *.tmp files interrupted tasks left directly in the output directories, passing
  // over those that were there before quantd claimed the directory. Returns how many.
  absl::StatusOr<int> SweepTmpFiles() const;

  const job::JobSpec& spec() const { return spec_; }
  const Plan& plan() const { return plan_; }

 private:
  PreparedJob() = default;
  absl::Status PlanJob(store::JobStore& store, int64_t now_ms,
                       const std::function<void(const std::string&)>& log);
  // Creates evaluation_ and finds where it resumes (Load; see above).
  absl::Status LoadEvaluation();
  // Applies the evaluate resume point (requeues, log) and restores evaluation_'s figures from the
  // store (Attach).
  absl::Status StartEvaluation(store::JobStore& store, int64_t job_id, int64_t now_ms,
                               const std::function<void(const std::string&)>& log);
  // The ids of changed_outputs_.
  std::set<int64_t> ChangedTaskIds() const;
  // Claims spec_.output and spec_.materialize_bf16 (Load).
  absl::Status ClaimOutputDirs();
  // FailedPrecondition naming the field when the source or a directory the job writes (output,
  // materialize_bf16, the directory of calibration.amax_out) is no longer at its path
  // (checkpoint::DirHandle::CheckUnchanged).
  absl::Status CheckDirsUnchanged() const;
  // StageContext::recorded_output: completed_ first, then the DONE rows of stored_tasks_.
  std::optional<RecordedOutput> RecordedOutputOf(std::string_view kind,
                                                 const std::string& name) const;
  // Creates calibration_ and finds where it resumes (Load; see above).
  // Whether calibration.amax_out existed when the job was first loaded (kept in the work dir).
  absl::StatusOr<bool> AmaxOutExisted() const;
  absl::Status LoadCalibration();
  // Applies the resume point (requeues, log) and restores calibration_ from the tasks' stored
  // amax rows (Attach; a requeue leaves a task's rows in place until its rerun replaces them).
  absl::Status StartCalibration(store::JobStore& store, int64_t job_id, int64_t now_ms,
                                const std::function<void(const std::string&)>& log);

  // What ApplyResumePoint stores and logs for one layer-wise stage.
  struct ResumeMessages {
    std::string reason;     // stored with the requeued tasks
    std::string requeued;   // logged after "requeued <count> "
    std::string unchanged;  // logged when nothing is requeued; "": nothing
  };
  // Applies a layer-wise stage's resume point (Attach): logs its rejected checkpoints, requeues
  // resume.requeue and logs it (or logs messages.unchanged), and lists stored_tasks_ again.
  absl::Status ApplyResumePoint(store::JobStore& store, int64_t job_id,
                                const calibration::ResumePoint& resume,
                                const ResumeMessages& messages, int64_t now_ms,
                                const std::function<void(const std::string&)>& log);

  const StageRegistry* stages_ = nullptr;              // the stages tasks are dispatched to
  job::JobSpec spec_;                                  // the job's spec
  StoredJob stored_;                                   // the store's view when Load began
  std::unique_ptr<checkpoint::CheckpointDir> source_;  // the source checkpoint, opened once
  checkpoint::TensorInventory inventory_;              // of source_
  Plan plan_;                                          // rebuilt from spec + source on every start
  std::vector<store::AmaxRow> file_amax_;  // calibration.amax_file, read by Load on the first start
  // DONE tasks whose output Load found gone or changed, with the reason: Attach requeues them.
  std::vector<std::pair<int64_t, std::string>> changed_outputs_;
  std::vector<store::TaskRow> stored_tasks_;  // the stored plan after Attach (the inspect task)
  std::map<std::string, float> input_amax_;   // the amax table, kind "input"
  checkpoint::DirHandle source_dir_;  // spec_.source as resolved at submit, opened by Load
  std::vector<std::unique_ptr<OutputMarker>> markers_;  // claims on output / materialize_bf16
  // The handles of the claimed directories (owned by markers_; null when not in the spec) and of
  // calibration.amax_out's directory: every file of the job there is written beneath them.
  const checkpoint::DirHandle* output_dir_ = nullptr;
  const checkpoint::DirHandle* materialize_bf16_dir_ = nullptr;
  checkpoint::DirHandle amax_out_dir_;
  // calibration.amax_out was there when the job was first loaded (admission accepted replacing it).
  bool amax_out_existed_ = false;
  // A calibrating job's runtime state (stages/calibrate_stage.h); nullptr otherwise. Thread-safe.
  std::unique_ptr<calibration::JobCalibration> calibration_;
  // The files of the tasks CompleteTask marked DONE in this process, by (stage kind, task name).
  mutable absl::Mutex completed_mu_;
  mutable std::map<std::pair<std::string, std::string>, RecordedOutput> completed_
      ABSL_GUARDED_BY(completed_mu_);
  // Where its calibration resumes, found by Load on a later start; applied by Attach.
  calibration::ResumePoint calibration_resume_;
  // A job's evaluate-stage state (stages/evaluate_stage.h); nullptr otherwise. Thread-safe.
  std::unique_ptr<evaluation::JobEvaluation> evaluation_;
  // Where its evaluate stage resumes, found by Load on a later start; applied by Attach.
  calibration::ResumePoint evaluation_resume_;
};

// Largest calibration.amax_file read (one entry per linear module: ~10 MB for DeepSeek-V4).
inline constexpr uint64_t kMaxAmaxFileBytes = 64ull << 20;

// Reads calibration.amax_file: a JSON object {module: input_amax}. Every value must be a finite
// float32 >= 0 and every module a linear module of `inventory`. Errors name the file and the
// module, but never quote a key that is not a module name, nor a value. The file must lie inside
// `roots` (the job's source_roots, judged by the file opened; nullopt: anywhere).
absl::StatusOr<std::vector<store::AmaxRow>> LoadAmaxFile(
    const std::string& path, const checkpoint::TensorInventory& inventory,
    const checkpoint::SourceRoots& roots);

// The DONE tasks among `tasks` whose output file is missing, or whose size or SHA-256 differs
// from the recorded ones, with the reason for each (one line). Tasks whose output is a directory
// (export) or nothing are not checked here: they are redone when a task they depend on is; nor
// are calibrate or evaluate layer tasks, whose output is a layer checkpoint that is removed on
// purpose once a later layer is checkpointed (the stage's resume checks them).
absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> FindChangedOutputs(
    const std::vector<store::TaskRow>& tasks);

// OK when `plan` has exactly the stages and tasks (names, payloads, bytes) stored for the job;
// otherwise names the first difference (the source changed since the job was planned).
absl::Status CheckPlanUnchanged(const Plan& plan, const std::vector<store::TaskRow>& stored);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_PREPARED_JOB_H_
