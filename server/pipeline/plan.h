// The plan of a conversion job: its stages and, for each, the tasks (units of work) with the
// payload a stage needs to run one and the tasks it waits for. Built once when a job starts, from
// the job spec and the source checkpoint's headers: BuildPlan lays out the output shards
// (PlanInput), then every stage of the registry plans its tasks from that (stage.h); the plan is
// stored in the JobStore and tasks are leased once their dependencies are done. The built-in
// stages (stage_registry.cc), in display order, and what their tasks wait for:
//
//   inspect    1 task      re-reads the source headers and checks disk space before any write
//   dequant    1 / shard   (materialize_bf16 only) source shard -> BF16 shard of the same name;
//                          after inspect
//   calibrate  1 + 1 / (layer, slice) (+ 1)   (W4A4 calibrating on data: stages/calibrate_stage.h)
//                          the calibration tokens, after inspect; decoder layer L over one slice
//                          of the batches, after every slice of layer L-1 (layer 0: the tokens);
//                          calibration.amax_out, after the last layer
//   quantize   1 / shard   output shard: tensors copied unchanged + modules written as NVFP4;
//                          after inspect (not after the BF16 copy) and, when the job calibrates,
//                          every slice of the layers its modules belong to
//   export     1 task      index.json, config.json, hf_quant_config.json, tokenizer files; after
//                          every quantize and dequant task
//   verify     1 / shard   re-reads an output shard: export rules and error statistics; after the
//                          quantize task of its shard
//   evaluate   1 / layer + head + gate   (a job calibrating on data: stages/evaluate_stage.h) the
//                          output against its source on held-out samples, one task after the
//                          other: layer 0 after export and every verify task
//
// Output shards mirror the source shards, except that a fusion group (modules that must share
// weight_scale_2 and input_scale) is always written whole into the shard of its first member.
#ifndef QUANTD_SERVER_PIPELINE_PLAN_H_
#define QUANTD_SERVER_PIPELINE_PLAN_H_

#include <stdint.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/job/job_spec.h"
#include "server/pipeline/recipe.h"
#include "server/store/job_store.h"

namespace quantd::pipeline {

// Payload of a dequant task.
struct DequantTask {
  std::string shard;  // source shard file name = output file name
};

// Payload of a quantize task (and of the verify task of the same output shard).
struct ShardTask {
  std::string shard;                                   // output shard file name
  std::vector<std::string> copy_tensors;               // source tensors written unchanged
  std::vector<std::string> modules;                    // linear modules written as NVFP4
  std::vector<std::vector<std::string>> fusion_groups; // subsets of `modules` sharing scales
  // FP8 / MXFP4 linear modules the recipe leaves alone, written as `<module>.weight` BF16 without
  // their scales because the layout cannot describe them otherwise (export_layout.h).
  std::vector<std::string> bf16_modules;
};

std::string ToJson(const DequantTask& t);
std::string ToJson(const ShardTask& t);
absl::StatusOr<DequantTask> ParseDequantTask(const std::string& json_text);
absl::StatusOr<ShardTask> ParseShardTask(const std::string& json_text);

// Output tensor names and shapes of one NVFP4 module in the spec's export format: ModelOpt
// (weight U8 [o, i/2], weight_scale F8_E4M3 [o, i/16], weight_scale_2 F32 [], input_scale F32 []
// unless weights-only) or compressed-tensors (weight_packed, weight_scale, weight_global_scale
// [1], input_global_scale [1]).
struct OutputTensor {
  std::string name;
  checkpoint::Dtype dtype;
  std::vector<int64_t> shape;
};
std::vector<OutputTensor> Nvfp4ModuleTensors(const job::JobSpec& spec, const std::string& module,
                                             int64_t out_features, int64_t in_features);

// One output shard as the recipe lays it out.
struct OutputShard {
  ShardTask task;             // what the shard holds
  uint64_t source_bytes = 0;  // bytes of the source tensors it is made from
};

// What the stages plan from (Stage::Plan).
struct PlanInput {
  const job::JobSpec* spec = nullptr;
  const checkpoint::CheckpointDir* source = nullptr;
  const checkpoint::TensorInventory* inventory = nullptr;
  std::vector<OutputShard> output_shards;           // in file-name order
  std::map<std::string, uint64_t> source_shards;    // source shard file -> bytes of its tensors
};

// "shard 3 of 12" for the task at `index` (from 0) of `count`.
std::string ShardLabel(size_t index, size_t count);

struct Plan {
  std::vector<store::StagePlan> stages;
  uint64_t source_bytes = 0;  // bytes of all source shards' tensors
  uint64_t output_bytes = 0;  // estimated bytes of the NVFP4 checkpoint
  uint64_t bf16_bytes = 0;    // estimated bytes of the BF16 copy (0 without materialize_bf16)
  // Bytes the layer checkpoints of its stages (Stage::CheckpointBytes) take at most in the job's
  // work directory (0 when the job neither calibrates nor evaluates).
  uint64_t checkpoint_bytes = 0;
  RecipePlan recipe;          // what the recipe selected
};

// The recipe the spec names (built-in or include/exclude globs), plus the spec's exclusions.
absl::StatusOr<Recipe> RecipeForSpec(const job::JobSpec& spec,
                                     const checkpoint::TensorInventory& inventory);

class StageRegistry;  // stage_registry.h

// What one job's plan may hold.
struct PlanLimits {
  // Tasks in all stages (DeepSeek-V4-Pro calibrating on 8 devices and evaluating: about 1,000).
  int64_t max_tasks = 100'000;
};

// Builds the plan with the stages of `stages`, in their order. Fails with a clear message when the
// recipe selects nothing, a selected module's format cannot be quantized (only FP8-block,
// MXFP4, BF16 and F32 weights can), or the stages plan more than limits.max_tasks tasks (as soon
// as a stage's tasks pass it).
absl::StatusOr<Plan> BuildPlan(const job::JobSpec& spec, const checkpoint::CheckpointDir& source,
                               const checkpoint::TensorInventory& inventory,
                               const StageRegistry& stages, const PlanLimits& limits = {});
// The same with the built-in stages (BuiltinStages()).
absl::StatusOr<Plan> BuildPlan(const job::JobSpec& spec, const checkpoint::CheckpointDir& source,
                               const checkpoint::TensorInventory& inventory);

// Refuses, with the numbers, when the output (and BF16 copy, and the layer checkpoints in
// `work_dir`, the job's work directory) would not fit.
absl::Status CheckDiskSpace(const job::JobSpec& spec, const Plan& plan,
                            const std::string& work_dir);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_PLAN_H_
