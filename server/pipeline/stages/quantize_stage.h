// Writes one output shard into spec.output: the task's copy_tensors unchanged and its modules as
// NVFP4 (spec.export_format's tensor names, plan.h Nvfp4ModuleTensors), fusion groups sharing one
// weight_scale_2 and one input_scale. MXFP4 experts use the lossless cast unless
// spec.expert_cast is requantize. While a module's source and quantized values are in memory it
// measures the error of the output against the source (verify_rules.h ErrorStats): the source as
// the quantizer saw it (checkpoint/source_weight.h DecodeWeight), the output decoded as readers
// decode the file (Nvfp4Dequant with weight_scale_2, or 1 / weight_global_scale). The verify stage
// proves that the file holds exactly these bytes (its recorded SHA-256).
#ifndef QUANTD_SERVER_PIPELINE_STAGES_QUANTIZE_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGES_QUANTIZE_STAGE_H_

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

class QuantizeStage final : public Stage {
 public:
  static constexpr std::string_view kKind = "quantize";

  std::string_view kind() const override { return kKind; }
  // One task per output shard (payload ShardTask), after inspect: it reads the source, so it
  // does not wait for the BF16 copy. In a calibrating job also after the calibrate tasks of its
  // modules' layers (calibrate_stage.h CalibrateDependencies).
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput& input) const override;
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                 const StageContext& ctx) const override;
  // A `full` job whose stored quantize tasks cover a `*.attn.wo_a` module was planned with recipe
  // revision 1 (pipeline/recipe.h): it resumes with that revision, so its plan stays the same.
  void AdaptSpec(const std::vector<store::TaskRow>& stored, job::JobSpec& spec) const override;
  // The per-module error statistics (TaskOutput::stats), with the task.
  absl::Status Record(store::TaskRecord& txn, const store::TaskRow& task,
                      const TaskOutput& output) const override;
};

// Elements per step of a host backend's quantize pipeline: each module is decoded, quantized and
// compared with its decoded output this many elements at a time (whole FP8 blocks), so the step
// stays in a core's L2 cache. The bytes written do not depend on it.
inline constexpr int64_t kQuantizeHostStepElements = int64_t{1} << 17;

// The body of a quantize task: the shard's file and one statistics row per quantized module
// (named after its source weight tensor). `host_step_elements` > 0 (tests take small steps).
absl::StatusOr<TaskOutput> RunQuantizeTask(
    const StageContext& ctx, const ShardTask& task,
    int64_t host_step_elements = kQuantizeHostStepElements);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_QUANTIZE_STAGE_H_
