// calibrate: layer-wise W4A4 calibration inside the job (DESIGN.md "Calibration"), when the job
// writes NVFP4 input scales from calibration data: weight_format nvfp4, calibration.mode data, a
// data set and no amax_file (calibration/calibrate_task.h names the tasks):
//   - "tokens" tokenizes the calibration set with the source's tokenizer.json and stores the ids
//     in the job's work directory; its output SHA-256 is recorded, so a resumed job calibrates on
//     exactly these tokens;
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
// Quantize tasks depend only on the slices of the layers their shard's modules belong to
// (CalibrateDependencies), and export their input amax from the finished layers' rows
// (CalibratedInputAmax), which gives the same values as an export after the last layer.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_CALIBRATE_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_CALIBRATE_STAGE_H_

#include <stdint.h>

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

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

// The input amax a quantize task of `task` uses in a calibrating job: the export
// (calibration/export_amax.h) of the finished calibrate tasks' rows. FailedPrecondition when one
// of the task's layers reached no routed expert and so takes the model's max, which is known only
// after the last layer (uncalibrated model_max plans for it).
absl::StatusOr<std::map<std::string, float>> CalibratedInputAmax(const StageContext& ctx,
                                                                 const ShardTask& task);

class CalibrateStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "calibrate";

  std::string_view kind() const override { return kKind; }
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  // Two boundaries of every calibration token (the tokens task's count).
  absl::StatusOr<uint64_t> CheckpointBytes(
      const PlanInput& input, const std::vector<store::TaskPlan>& tasks) const override;
  // Needs ctx.calibration (the job's calibration::JobCalibration).
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
  // The task's amax rows (TaskOutput::amax) replace those of an earlier run of it.
  absl::Status Record(store::TaskRecord& txn, const store::TaskRow& task,
                      const TaskOutput& output) const override;
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_CALIBRATE_STAGE_H_
