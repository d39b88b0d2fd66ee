// calibrate: layer-wise W4A4 calibration inside the job (DESIGN.md "Calibration"), when the job
// writes NVFP4 input scales from calibration data: weight_format nvfp4, calibration.mode data, a
// data set and no amax_file (calibration/calibrate_task.h names the tasks):
//   - "tokens" tokenizes the calibration set (and the held-out samples of a job that evaluates)
//     with the source's tokenizer.json and stores the ids in the job's work directory
//     (job_tokens.h); its output SHA-256 is recorded, so a resumed job calibrates on exactly
//     these tokens. Planning reads no data: the tasks are sized by the spec's bound (samples x
//     seq_len), and a layer task's progress counts its slice's tokens as its share of it;
//   - "layer<L>.slice<S>": decoder layer L over slice S of the batches (a contiguous run of whole
//     batches: calibration/calibrate_layer.h), one slice per device of spec.devices (kAutoSlices
//     when "auto"); every slice of layer L depends on every slice of layer L-1 (layer 0 on
//     "tokens"). Its amax rows (calibration/amax_rows.h) are committed with its completion;
//     its output activations go to the job's ActivationStore and, at a layer boundary, to a
//     layer checkpoint (calibration/layer_checkpoint.h: when calibration.checkpoint_seconds
//     passed since the last one, or the output is spilled already) whose manifest is the task's
//     recorded output, so that a restart resumes after the last checkpointed layer;
//   - "amax_out" writes calibration.amax_out after the last layer (only when it is set).
// Task bytes are calibration tokens: progress, tokens/s and the ETA count tokens.
//
// The stage keeps each calibrating job's calibration::JobCalibration (its activations between
// layers, tokens and amax so far) in its StageJob (OpenJob). Its activations between layers live
// in this process, except at a layer boundary, where a layer's outputs are also checkpointed on
// disk (calibration/layer_checkpoint.h). A later start whose calibration is unfinished resumes
// after the last layer L whose every slice is DONE with a checkpoint that exists and matches its
// recorded size and SHA-256 (OpenJob verifies and loads it; the layer tasks' outputs are checked
// there, not with the job's other outputs: ChecksOwnOutput): Attach requeues the done layer tasks
// after L, and with them the done tasks depending on them (quantize shards of those layers,
// amax_out), and logs the layer it resumes from. Without such a layer it resumes from layer 0 on
// the stored tokens. Tasks up to L keep their committed amax rows; a rerun task replaces its own,
// measuring what its first run measured (the same tokens, batches and inputs), so the result
// equals an uninterrupted run.
//
// Quantize tasks depend only on the slices of the layers their shard's modules belong to
// (CalibrateDependencies), and export their input amax from the finished layers' rows
// (CalibratedInputAmax), which gives the same values as an export after the last layer.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_CALIBRATE_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_CALIBRATE_STAGE_H_

#include <stdint.h>

#include <map>
#include <optional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/calibration/calibration_tokens.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::model {
struct V4Checkpoint;  // model/v4_weights.h
}  // namespace quantd::model

namespace quantd::pipeline {

// Slices per layer when spec.devices is "auto" (the plan cannot know the daemon's workers).
inline constexpr int64_t kAutoSlices = 2;

// Whether the job calibrates in a calibrate stage.
bool NeedsCalibration(const job::JobSpec& spec);

// The layer tasks' shape: decoder layers and slices per layer (0 layers: no calibration).
struct CalibrationLayout {
  int64_t layers = 0;
  int64_t slices = 0;
};
absl::StatusOr<CalibrationLayout> PlanCalibrationLayout(const PlanInput& input);

// Bytes the layer checkpoints of a layer-wise stage over the source model take at most on disk:
// two boundaries (calibration/layer_checkpoint.h), each holding `tokens` token rows of hc_mult x
// hidden_size float32 for each of `models` models.
absl::StatusOr<uint64_t> LayerCheckpointBytes(const PlanInput& input, int64_t tokens,
                                              int64_t models);

// The calibrate tasks a quantize task of `task` waits for: every slice of each layer one of its
// NVFP4 modules belongs to ("layers.<L>."); of every layer when a module lies outside the decoder
// layers or calibration.uncalibrated is model_max (the fill needs the whole model).
std::vector<store::TaskRef> CalibrateDependencies(const CalibrationLayout& layout,
                                                  const job::JobSpec& spec, const ShardTask& task);

// Whether the job calibrates in its calibrate stage (that stage opened its job: ctx.job_of).
bool Calibrates(const StageContext& ctx);

// The source as a DeepSeek-V4 model, opened once for the job by its calibrate stage (the evaluate
// stage runs the same source). Internal when the job does not calibrate.
absl::StatusOr<const model::V4Checkpoint*> CalibrationSource(const StageContext& ctx);

// The job's tokens as its tokens task stored them (read once; the evaluate stage's held-out
// samples are there). FailedPrecondition before that task finished; `vocab`: the source's.
absl::StatusOr<std::shared_ptr<const calibration::JobTokens>> CalibrationTokens(
    const StageContext& ctx, int64_t vocab);

// The input amax a quantize task of `task` uses in a calibrating job: the export
// (calibration/export_amax.h) of the finished calibrate tasks' rows. FailedPrecondition when one
// of the task's layers reached no routed expert and so takes the model's max, which is known only
// after the last layer (uncalibrated model_max plans for it).
absl::StatusOr<std::map<std::string, float>> CalibratedInputAmax(const StageContext& ctx,
                                                                 const ShardTask& task);

// What the calibrate stage's stored rows say, for reports (they never read its payloads):
// The decoder layers the stage of a job with stored `tasks` calibrates; nullopt when it plans none.
std::optional<int64_t> CalibratedLayers(const std::vector<store::TaskRow>& tasks);
// Whether the stage succeeded, among a job's `stages` (store::JobStore::Progress).
bool CalibrationSucceeded(const std::vector<store::StageProgress>& stages);
// The stage's wall time in seconds, start to end, among `stages`; 0 when it has not ended.
double CalibrationSeconds(const std::vector<store::StageProgress>& stages);

class CalibrateStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "calibrate";

  std::string_view kind() const override { return kKind; }
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  // Two boundaries of every calibration token (the tokens task's bound).
  absl::StatusOr<uint64_t> CheckpointBytes(
      const PlanInput& input, const std::vector<store::TaskPlan>& tasks) const override;
  // Needs the job the stage opened (OpenJob).
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
  // The task's amax rows (its result) replace those of an earlier run of it.
  absl::Status Record(store::TaskRecord& txn, const store::TaskRow& task,
                      const TaskOutput& output) const override;
  // A calibrating job's calibration: its work and spill directories, calibration.amax_out's
  // directory, and on a later start where it resumes (above).
  absl::StatusOr<std::unique_ptr<StageJob>> OpenJob(const StageJobInput& input) const override;
  // The layer tasks, whose output is a layer checkpoint.
  bool ChecksOwnOutput(const store::TaskRow& task) const override;
  std::string_view progress_unit() const override { return "tokens"; }
  // "layer L of N" (1-based) for the earliest layer of the running layer tasks; "" without one.
  std::string ProgressStep(const std::vector<const store::TaskRow*>& running) const override;
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_CALIBRATE_STAGE_H_
