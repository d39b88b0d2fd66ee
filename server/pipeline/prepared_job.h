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
//     output directories (OutputMarker); opens each stage's job object (Stage::OpenJob: a stage
//     that keeps state between its tasks creates it and finds where it resumes).
//   Attach (the store phase, on the store's thread): stores the plan (first start), requeues the
//     DONE tasks whose output Load found gone or changed (with the done tasks that depend on
//     them, so they are rebuilt), reads the amax table and attaches each stage's job object
//     (StageJob::Attach: it applies its resume point and restores itself from the store).
// A Load whose job stopped meanwhile is simply destroyed: it wrote nothing but its markers and
// the job's work directory (a later Load cleans what it finds there).
//
// Tasks are dispatched to the stage of their kind in the job's StageRegistry (RunTask, with the
// stage's job object) and completed with that stage's Record in the same transaction
// (CompleteTask), after which the stage's job object is told (StageJob::TaskDone). The stages'
// job objects live as long as the PreparedJob.
#ifndef QUANTD_SERVER_PIPELINE_PREPARED_JOB_H_
#define QUANTD_SERVER_PIPELINE_PREPARED_JOB_H_

#include <stdint.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string_view>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/compute/device.h"
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

  // A remote worker's view of a planned job (`quantd worker`): the source phase of Load without
  // the store's part, from what the coordinator sent: `stored` (its stored plan, which must
  // equal the plan built here from the source: the worker sees the same source), `amax` (the
  // job's amax table). Joins the output directories the coordinator claimed
  // (OutputMarker::Join) instead of claiming them, opens no stage job objects (the coordinator
  // hands remote workers only jobs whose stages keep none: keeps_stage_state) and is never
  // attached: its tasks run with RunTask and their results travel back to the coordinator.
  static absl::StatusOr<std::unique_ptr<PreparedJob>> OpenForWorker(
      const job::JobSpec& spec, StoredJob stored, const std::vector<store::AmaxRow>& amax,
      const PlanLimits& limits = {}, const StageRegistry& stages = BuiltinStages());

  // Whether some stage opened a job object (Stage::OpenJob): its state lives in this process.
  bool keeps_stage_state() const { return !stage_jobs_.empty(); }
  // A remote worker: `done`, a task the coordinator recorded DONE since OpenForWorker, is what
  // StageContext::recorded_output answers for it. Thread-safe.
  void NoteRecorded(const store::TaskRow& done) const;

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
  // (store::JobStore::CompleteTask). `written_here`: a worker of this process ran the task, so
  // the file it recorded was hashed by this process as it was written
  // (RecordedOutput::written_by_this_process); false for a remote worker's.
  absl::Status CompleteTask(store::JobStore& store, const store::TaskLease& lease,
                            const store::TaskRow& task, const TaskOutput& output, int64_t now_ms,
                            bool written_here = true) const;

  // Removes the *.tmp files interrupted tasks left directly in the output directories, passing
  // over those that were there before quantd claimed the directory. Returns how many.
  absl::StatusOr<int> SweepTmpFiles() const;

  const job::JobSpec& spec() const { return spec_; }
  const Plan& plan() const { return plan_; }

 private:
  PreparedJob() = default;
  // The source phase both Load and OpenForWorker begin with: opens the source (re-checking its
  // path), builds the inventory and the plan.
  static absl::StatusOr<std::unique_ptr<PreparedJob>> LoadSource(const job::JobSpec& spec,
                                                                 StoredJob stored,
                                                                 const PlanLimits& limits,
                                                                 const StageRegistry& stages);
  absl::Status PlanJob(store::JobStore& store, int64_t now_ms,
                       const std::function<void(const std::string&)>& log);
  // The job object stage `kind` opened; nullptr when it opened none.
  StageJob* StageJobOf(std::string_view kind) const;
  // The ids of changed_outputs_.
  std::set<int64_t> ChangedTaskIds() const;
  // Claims spec_.output and spec_.materialize_bf16 (Load).
  absl::Status ClaimOutputDirs();
  // FailedPrecondition naming the field when the source or a directory the job writes (output,
  // materialize_bf16, one a stage's job object opened) is no longer at its path
  // (checkpoint::DirHandle::CheckUnchanged).
  absl::Status CheckDirsUnchanged() const;
  // StageContext::recorded_output: completed_ first, then the DONE rows of stored_tasks_.
  std::optional<RecordedOutput> RecordedOutputOf(std::string_view kind,
                                                 const std::string& name) const;

  const StageRegistry* stages_ = nullptr;              // the stages tasks are dispatched to
  job::JobSpec spec_;                                  // the job's spec
  StoredJob stored_;                                   // the store's view when Load began
  // The source checkpoint, opened once (and shared with the stages' jobs: StageJobInput::source).
  std::shared_ptr<const checkpoint::CheckpointDir> source_;
  checkpoint::TensorInventory inventory_;              // of source_
  Plan plan_;                                          // rebuilt from spec + source on every start
  std::vector<store::AmaxRow> file_amax_;  // calibration.amax_file, read by Load on the first start
  // DONE tasks whose output Load found gone or changed, with the reason: Attach requeues them.
  std::vector<std::pair<int64_t, std::string>> changed_outputs_;
  std::vector<store::TaskRow> stored_tasks_;  // the stored plan after Attach (the inspect task)
  std::map<std::string, float> input_amax_;   // the amax table, kind "input"
  checkpoint::DirHandle source_dir_;  // spec_.source as resolved at submit, opened by Load
  std::vector<std::unique_ptr<OutputMarker>> markers_;  // claims on output / materialize_bf16
  // The handles of the claimed directories (owned by markers_; null when not in the spec): every
  // file of the job there is written beneath them.
  const checkpoint::DirHandle* output_dir_ = nullptr;
  const checkpoint::DirHandle* materialize_bf16_dir_ = nullptr;
  // The job objects the stages opened (Stage::OpenJob), by stage kind; fixed after Load, each
  // thread-safe itself.
  std::map<std::string, std::unique_ptr<StageJob>, std::less<>> stage_jobs_;
  // The files of the tasks CompleteTask marked DONE in this process, by (stage kind, task name).
  mutable absl::Mutex completed_mu_;
  mutable std::map<std::pair<std::string, std::string>, RecordedOutput> completed_
      ABSL_GUARDED_BY(completed_mu_);
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
// are those whose stage in `stages` checks them itself (Stage::ChecksOwnOutput: a layer
// checkpoint, removed on purpose once a later layer is checkpointed).
absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> FindChangedOutputs(
    const std::vector<store::TaskRow>& tasks, const StageRegistry& stages = BuiltinStages());

// OK when `plan` has exactly the stages and tasks (names, payloads, bytes) stored for the job;
// otherwise names the first difference (the source changed since the job was planned).
absl::Status CheckPlanUnchanged(const Plan& plan, const std::vector<store::TaskRow>& stored);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_PREPARED_JOB_H_
