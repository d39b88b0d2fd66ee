// The runtime state of one calibrating job in this process (owned by its pipeline::PreparedJob,
// shared by the worker threads running its calibrate and quantize tasks; thread-safe):
//   - the source as a DeepSeek-V4 model (on first use, by the first calibrate task), over the
//     job's own opened source (its shards mapped once per job);
//   - the job's tokens (calibration and held-out samples), read once from the job's tokens file
//     and checked against the SHA-256 the tokens task recorded;
//   - the activations between layers (ActivationStore, host budget then spill files);
//   - the layer checkpoints (layer_checkpoint.h, "<work_dir>/calibrate-layers"): the outputs of
//     a layer kept on disk at a boundary, so that a restart resumes after it (Resume);
//   - the amax measured so far: the rows of every finished calibrate task, merged as
//     JobStore::ListAmax merges them (max amax, summed tokens), from which a quantize task
//     exports the input amax of its finished layers. A task that runs again replaces its rows,
//     here as in the store, so its tokens are never counted twice.
//
// It is created by the source phase of a (re)start (PreparedJob::Load, off the store's thread: it
// creates the work and spill directories, and Resume hashes checkpoints), then restored from the
// store by the store phase (Restore). The scheduler reports each finished calibrate task
// (OnTaskDone, after its completion is committed); once every slice of layer L is done, layer
// L-1's activations are released; once every slice of L is committed with a checkpoint, the
// earlier layers' checkpoints are removed; once the last layer is done, every checkpoint is.
#ifndef QUANTD_SERVER_CALIBRATION_JOB_CALIBRATION_H_
#define QUANTD_SERVER_CALIBRATION_JOB_CALIBRATION_H_

#include <stdint.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/calibration/activation_store.h"
#include "server/calibration/amax_table.h"
#include "server/calibration/calibration_tokens.h"
#include "server/calibration/layer_checkpoint.h"
#include "server/job/job_spec.h"
#include "server/model/v4_weights.h"
#include "server/store/job_store.h"

namespace quantd::calibration {

// Host memory the activations may take when the spec sets no host_memory_bytes: a quarter of
// the machine's memory.
int64_t DefaultActivationBudget();

class JobCalibration {
 public:
  // `source`: the job's source as the job opened it (Checkpoint() refuses without one).
  // `work_dir`: the job's own directory for the tokens file, spill files and checkpoints
  // (created). `host_budget_bytes`: the spec's host_memory_bytes, 0 = DefaultActivationBudget().
  // `now_ms`: the checkpoints' clock.
  static absl::StatusOr<std::unique_ptr<JobCalibration>> Create(
      const job::JobSpec& spec, std::shared_ptr<const checkpoint::CheckpointDir> source,
      const std::string& work_dir, int64_t host_budget_bytes, MonotonicMs now_ms = SteadyNowMs);

  // The source as a V4 model, made on the first call.
  absl::StatusOr<const model::V4Checkpoint*> Checkpoint() ABSL_LOCKS_EXCLUDED(mu_);

  // The job's own directory (pipeline::JobWorkDir).
  const std::string& work_dir() const { return work_dir_; }
  // The job's tokens file ("<work_dir>/tokens.bin").
  const std::string& tokens_path() const { return tokens_path_; }
  // The tokens file's samples, read on the first call after the tokens task finished.
  absl::StatusOr<std::shared_ptr<const JobTokens>> Tokens(int64_t vocab) ABSL_LOCKS_EXCLUDED(mu_);

  ActivationStore& activations() { return *activations_; }
  LayerCheckpoints& checkpoints() { return *checkpoints_; }

  // At a restart, before Restore (files only): where calibration resumes among the stored
  // calibrate tasks (ResumeLayers over the layer tasks): the resume layer's checkpointed outputs
  // are put into activations(), the other checkpoints removed. The caller requeues
  // ResumePoint::requeue.
  ResumePoint Resume(const std::vector<store::TaskRow>& tasks);
  // At (re)start: the tasks' amax rows already stored for the job (JobStore::ListTaskAmax; those
  // of a requeued task stay until its rerun replaces them), and the done calibrate tasks (their
  // payloads and outputs).
  void Restore(const std::vector<store::TaskAmaxRow>& rows,
               const std::vector<store::TaskRow>& tasks) ABSL_LOCKS_EXCLUDED(mu_);
  // A calibrate task's completion was committed with `amax` (its rows, replacing those of an
  // earlier run of the task) and its output (a layer task's checkpoint manifest, or "").
  void OnTaskDone(const store::TaskRow& task, const std::vector<store::AmaxRow>& amax,
                  const std::string& output_path, const std::string& output_sha256)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The table of the rows so far (FromAmaxRows of the merged rows).
  AmaxTable Table() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  JobCalibration(const job::JobSpec& spec, std::shared_ptr<const checkpoint::CheckpointDir> source,
                 std::string work_dir,
                 std::unique_ptr<ActivationStore> activations,
                 std::unique_ptr<LayerCheckpoints> checkpoints);
  // Merges `rows` (kind "input") into amax_.
  void MergeRows(const std::vector<store::AmaxRow>& rows) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets task `task_id`'s rows: merged into amax_, or amax_ rebuilt when they replace earlier
  // ones.
  void PutTaskRows(int64_t task_id, std::vector<store::AmaxRow> rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const job::JobSpec spec_;                           // the job's spec (source, calibration)
  const std::shared_ptr<const checkpoint::CheckpointDir> source_;  // the job's, opened once
  const std::string work_dir_;                        // the job's own directory
  const std::string tokens_path_;                     // in the work directory
  const std::unique_ptr<ActivationStore> activations_;  // thread-safe itself
  const std::unique_ptr<LayerCheckpoints> checkpoints_;  // thread-safe itself

  mutable absl::Mutex mu_;  // guards the members below
  std::unique_ptr<model::V4Checkpoint> ckpt_ ABSL_GUARDED_BY(mu_);  // opened on first use
  std::string tokens_sha256_ ABSL_GUARDED_BY(mu_);  // recorded by the tokens task; "" before
  std::shared_ptr<const JobTokens> tokens_ ABSL_GUARDED_BY(mu_);  // read on first use
  // Task id -> the rows of its last run.
  std::map<int64_t, std::vector<store::AmaxRow>> task_amax_ ABSL_GUARDED_BY(mu_);
  // Module row (kind "input") -> {max amax, summed tokens} over task_amax_.
  std::map<std::string, store::AmaxRow> amax_ ABSL_GUARDED_BY(mu_);
  // Layer -> its slices done in this process (or before it, from Restore).
  std::map<int64_t, std::set<int64_t>> done_ ABSL_GUARDED_BY(mu_);
  // Layer -> its slices committed in this process with a checkpoint.
  std::map<int64_t, std::set<int64_t>> checkpointed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_JOB_CALIBRATION_H_
