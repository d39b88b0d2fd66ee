#include "server/pipeline/stages/quantize_stage.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/checkpoint/source_weight.h"
#include "server/pipeline/stages/calibrate_stage.h"
#include "server/pipeline/recipe.h"
#include "server/pipeline/stages/input_scales.h"
#include "server/pipeline/stages/inspect_stage.h"
#include "server/pipeline/stages/shard_output.h"
#include "server/pipeline/stages/verify_rules.h"

namespace quantd::pipeline {

using checkpoint::BackendMxfp4;
using checkpoint::DecodeWeightRows;
using checkpoint::DenseWeight;
using checkpoint::FindLinear;
using checkpoint::FindSourceWeight;
using checkpoint::LinearModule;
using checkpoint::NaturalLess;
using checkpoint::ReleaseSource;
using checkpoint::SourceWeight;
using checkpoint::StageMxfp4;
using checkpoint::TensorFormat;
using checkpoint::ToHost;
using checkpoint::WeightError;

using job::ExpertCast;
using job::ExportFormat;
using job::JobSpec;
using job::WeightFormat;

namespace {

// Elements per step on a backend with its own memory: each kernel launch has plenty of work, and
// the step's decoded rows (8 MiB of BF16) and their float32 decoding for the statistics (16 MiB,
// also staged in host memory) stay small next to a large tensor.
constexpr int64_t kDeviceStepElements = int64_t{1} << 22;

// Which tensor of an NVFP4 module an output tensor is: Nvfp4ModuleTensors' order, in both
// export formats (values, block scales, global scale, input scale).
enum class Part { kValues = 0, kBlockScales = 1, kGlobalScale = 2, kInputScale = 3 };

// One tensor of the output shard and where its bytes come from.
struct OutputEntry {
  checkpoint::TensorSpec spec;
  const checkpoint::TensorView* source = nullptr;  // a copied tensor: its source bytes
  std::string module;                              // an NVFP4 tensor: its module...
  Part part = Part::kValues;                       // ...and which of its tensors
  std::string bf16_module;  // a module written as its BF16-decoded weight (ShardTask::bf16_modules)
};

// A quantized module whose tensors are not all written yet.
struct QuantizedModule {
  kernels::Buffer values;     // packed E2M1 [out, in/2], backend memory
  kernels::Buffer scales;     // E4M3 block scales [out, in/16], backend memory
  float scale_2 = 0.0f;       // weight_scale_2
  int unwritten = 0;          // its output tensors still to write
  uint64_t source_bytes = 0;  // of its source tensors, reported once it is written
};

// One run of a quantize task: the output shard written tensor by tensor in header order,
// quantizing each fusion group (or lone module) when its first tensor is due.
class QuantizeRun {
 public:
  QuantizeRun(const StageContext& ctx, const ShardTask& task, int64_t host_step_elements)
      : ctx_(ctx), task_(task), backend_(*ctx.backend), host_step_elements_(host_step_elements) {}

  absl::StatusOr<TaskOutput> Run();

 private:
  // Finds every source tensor, resolves input scales and lays out the header (entries_).
  absl::Status Prepare();
  // Appends one output tensor, quantizing its module's group first when it is not pending.
  absl::Status WriteEntry(checkpoint::SafetensorsWriter& writer, const OutputEntry& entry);
  // Quantizes every member of `group` into pending_, sharing weight_scale_2.
  absl::Status QuantizeGroup(const std::vector<std::string>& group);
  // MXFP4 members cast losslessly with the group's largest E8M0 exponent.
  absl::Status CastLossless(const std::vector<const SourceWeight*>& members);
  // Members decoded to BF16 (or read as BF16/F32) and quantized against the group's amax.
  absl::Status QuantizeDecoded(const std::vector<const SourceWeight*>& members);
  // Output buffers for `w`, registered in pending_.
  absl::StatusOr<kernels::Nvfp4Out> NewOutput(const SourceWeight& w);
  // Rows of `w` per step, in whole FP8 blocks: about host_step_elements_ on a host backend;
  // about kDeviceStepElements on a backend with its own memory.
  int64_t RowsPerStep(const SourceWeight& w) const;
  // Rows [r0, r1) of `w` decoded (DecodeWeightRows, into step_rows_ when it is free), and with
  // `amax` their max |x| folded in. A step that fails (a NaN scale, a non-finite value) is done
  // again over the whole tensor, so that the error names the element by its row in the tensor
  // rather than in the step. Done with the rows, the caller hands them back (EndStep).
  absl::StatusOr<DenseWeight> DecodeStep(const SourceWeight& w, int64_t r0, int64_t r1,
                                         float* amax);
  void EndStep(DenseWeight& step) { step_rows_ = std::move(step.holder); }
  // Adds to *stats the error of rows [r0, r0 + ref.rows) of `w`'s quantized values (pending_)
  // against `ref`, those rows as they were quantized from (or, for a lossless cast, as
  // DecodeWeightRows decodes the source).
  absl::Status AddStats(const SourceWeight& w, int64_t r0, const DenseWeight& ref,
                        ErrorStats* stats);

  const StageContext& ctx_;                                        // spec, source, amax, hooks
  const ShardTask& task_;                                          // the shard to write
  kernels::Backend& backend_;                                      // where kernels run
  const int64_t host_step_elements_;  // kQuantizeHostStepElements, unless a test asks for less
  std::map<std::string, SourceWeight> weights_;                    // module -> source tensors
  std::map<std::string, const std::vector<std::string>*> groups_;  // member -> its fusion group
  InputScales input_scales_;                                       // empty for W4A16
  std::vector<OutputEntry> entries_;                               // header order
  std::map<std::string, QuantizedModule> pending_;                 // quantized, not yet written
  std::vector<store::TensorStatsRow> stats_;                       // one per quantized module
  std::vector<float> stats_rows_;  // AddStats: output rows decoded to float32, one step
  kernels::Buffer step_rows_;      // a step's decoded rows, reused by the next step
  kernels::Buffer device_rows_;    // AddStats' float32 rows on a backend with its own memory
  std::vector<uint8_t> staging_;  // host copy of backend output (backends on device memory)
};

absl::Status QuantizeRun::Prepare() {
  const JobSpec& spec = *ctx_.spec;
  for (const std::string& name : task_.copy_tensors) {
    const checkpoint::TensorView* t = ctx_.source->Find(name);
    if (t == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(task_.shard, ": tensor ", name, " is missing from ", ctx_.source->dir()));
    }
    OutputEntry e;
    e.spec = {name, t->dtype, t->shape};
    e.source = t;
    entries_.push_back(std::move(e));
  }
  for (const std::string& module : task_.modules) {
    absl::StatusOr<SourceWeight> w = FindSourceWeight(*ctx_.source, *ctx_.inventory, module);
    if (!w.ok()) return w.status();
    const std::vector<OutputTensor> tensors =
        Nvfp4ModuleTensors(spec, module, w->module->out_features, w->module->in_features);
    for (size_t i = 0; i < tensors.size(); ++i) {
      OutputEntry e;
      e.spec = {tensors[i].name, tensors[i].dtype, tensors[i].shape};
      e.module = module;
      e.part = static_cast<Part>(i);
      entries_.push_back(std::move(e));
    }
    weights_[module] = std::move(*w);
  }
  for (const std::string& module : task_.bf16_modules) {
    const LinearModule* m = FindLinear(*ctx_.inventory, module);
    if (m == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(task_.shard, ": planned module ", module, " is not in the source"));
    }
    OutputEntry e;
    e.spec = {module + ".weight", checkpoint::Dtype::kBF16, {m->out_features, m->in_features}};
    e.bf16_module = module;
    entries_.push_back(std::move(e));
  }
  for (const std::vector<std::string>& group : task_.fusion_groups) {
    for (const std::string& member : group) {
      if (weights_.count(member) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(task_.shard, ": fusion group member ",
                                                       member, " is not a module of the task"));
      }
      groups_[member] = &group;
    }
  }
  if (spec.weight_format == WeightFormat::kNvfp4) {
    // A calibrating job exports the input amax of the layers calibrated so far (its own are).
    std::map<std::string, float> calibrated;
    const bool calibrates = Calibrates(ctx_);
    if (calibrates) {
      absl::StatusOr<std::map<std::string, float>> amax = CalibratedInputAmax(ctx_, task_);
      if (!amax.ok()) return amax.status();
      calibrated = std::move(*amax);
    }
    absl::StatusOr<InputScales> scales =
        ResolveInputScales(task_, calibrates ? &calibrated : ctx_.input_amax);
    if (!scales.ok()) {
      return absl::Status(scales.status().code(),
                          absl::StrCat(task_.shard, ": ", scales.status().message()));
    }
    input_scales_ = std::move(*scales);
  }
  std::sort(entries_.begin(), entries_.end(), [](const OutputEntry& a, const OutputEntry& b) {
    return NaturalLess(a.spec.name, b.spec.name);
  });
  return absl::OkStatus();
}

absl::StatusOr<kernels::Nvfp4Out> QuantizeRun::NewOutput(const SourceWeight& w) {
  const size_t n = static_cast<size_t>(w.module->out_features * w.module->in_features);
  QuantizedModule q;
  absl::StatusOr<kernels::Buffer> values = backend_.Allocate(n / 2);
  if (!values.ok()) return WeightError(w, values.status());
  absl::StatusOr<kernels::Buffer> scales = backend_.Allocate(n / kernels::kNvfp4BlockSize);
  if (!scales.ok()) return WeightError(w, scales.status());
  q.values = std::move(*values);
  q.scales = std::move(*scales);
  q.unwritten = static_cast<int>(
      Nvfp4ModuleTensors(*ctx_.spec, w.module->name, w.module->out_features, w.module->in_features)
          .size());
  q.source_bytes = w.module->bytes;
  QuantizedModule& slot = pending_[w.module->name] = std::move(q);
  return kernels::Nvfp4Out{slot.values.as<uint8_t>(), slot.scales.as<uint8_t>(), &slot.scale_2};
}

int64_t QuantizeRun::RowsPerStep(const SourceWeight& w) const {
  const int64_t rows = w.module->out_features;
  const int64_t elements = backend_.host_memory() ? host_step_elements_ : kDeviceStepElements;
  const bool fp8 = w.module->format == TensorFormat::kFp8BlockE8m0 ||
                   w.module->format == TensorFormat::kFp8BlockF32;
  const int64_t unit = fp8 ? kernels::kFp8BlockSize : 1;
  const int64_t units = std::max<int64_t>(1, elements / (unit * w.module->in_features));
  return std::min(rows, units * unit);
}

absl::StatusOr<DenseWeight> QuantizeRun::DecodeStep(const SourceWeight& w, int64_t r0,
                                                     int64_t r1, float* amax) {
  const auto decode = [&](int64_t begin, int64_t end) -> absl::StatusOr<DenseWeight> {
    ASSIGN_OR_RETURN(DenseWeight d, DecodeWeightRows(backend_, w, begin, end,
                                                     std::move(step_rows_)));
    if (amax == nullptr) return d;
    absl::StatusOr<float> a = backend_.AbsMax(d.tensor);
    if (!a.ok()) return WeightError(w, a.status());
    *amax = std::max(*amax, *a);
    return d;
  };
  absl::StatusOr<DenseWeight> step = decode(r0, r1);
  if (step.ok() || (r0 == 0 && r1 == w.module->out_features)) return step;
  float whole_amax = 0.0f;
  if (amax != nullptr) amax = &whole_amax;
  absl::StatusOr<DenseWeight> whole = decode(0, w.module->out_features);
  return whole.ok() ? step.status() : whole.status();
}

absl::Status QuantizeRun::AddStats(const SourceWeight& w, int64_t r0, const DenseWeight& ref,
                                   ErrorStats* stats) {
  const QuantizedModule& q = pending_.at(w.module->name);
  // weight_scale_2 as readers get it back from the file: compressed-tensors stores its reciprocal.
  const bool modelopt = ctx_.spec->export_format == ExportFormat::kModelOpt;
  const float scale_2 = modelopt ? q.scale_2 : 1.0f / (1.0f / q.scale_2);
  const int64_t rows = ref.tensor.rows;
  const int64_t cols = ref.tensor.cols;
  const size_t n = static_cast<size_t>(rows * cols);
  std::vector<uint8_t> ref_staging;
  absl::StatusOr<const void*> ref_host = ToHost(backend_, ref.tensor.data, ref.bytes, &ref_staging);
  if (!ref_host.ok()) return WeightError(w, ref_host.status());
  if (stats_rows_.size() < n) stats_rows_.resize(n);
  float* got = stats_rows_.data();
  void* dst = got;
  if (!backend_.host_memory()) {
    if (device_rows_.size() < n * sizeof(float)) {
      absl::StatusOr<kernels::Buffer> buffer = backend_.Allocate(n * sizeof(float));
      if (!buffer.ok()) return WeightError(w, buffer.status());
      device_rows_ = std::move(*buffer);
    }
    dst = device_rows_.data();
  }
  const kernels::Nvfp4Tensor out{q.values.as<uint8_t>() + r0 * cols / 2,
                                 q.scales.as<uint8_t>() + r0 * cols / kernels::kNvfp4BlockSize,
                                 scale_2, rows, cols};
  absl::Status s = backend_.Nvfp4Dequant(out, {dst, kernels::FloatType::kF32});
  if (s.ok() && dst != got) s = backend_.CopyToHost(got, dst, n * sizeof(float));
  if (!s.ok()) return WeightError(w, s);
  if (ref.tensor.type == kernels::FloatType::kBF16) {
    stats->AddBf16(static_cast<const uint16_t*>(*ref_host), got, static_cast<int64_t>(n));
  } else {
    stats->Add(static_cast<const float*>(*ref_host), got, static_cast<int64_t>(n));
  }
  return absl::OkStatus();
}

absl::Status QuantizeRun::CastLossless(const std::vector<const SourceWeight*>& members) {
  std::vector<BackendMxfp4> sources;
  int kmax = -127;
  for (const SourceWeight* w : members) {
    absl::StatusOr<BackendMxfp4> src = StageMxfp4(backend_, *w);
    if (!src.ok()) return src.status();
    absl::StatusOr<int> k = backend_.Mxfp4MaxExponent(src->tensor);
    if (!k.ok()) return WeightError(*w, k.status());
    kmax = std::max(kmax, *k);
    sources.push_back(std::move(*src));
  }
  for (size_t i = 0; i < members.size(); ++i) {
    const SourceWeight& w = *members[i];
    absl::StatusOr<kernels::Nvfp4Out> out = NewOutput(w);
    if (!out.ok()) return out.status();
    // The count of requantized 16-blocks has no field in TaskOutput yet.
    absl::StatusOr<int64_t> requantized = backend_.Mxfp4ToNvfp4(sources[i].tensor, kmax, *out);
    if (!requantized.ok()) return WeightError(w, requantized.status());
    ErrorStats stats;
    const int64_t rows = w.module->out_features;
    for (int64_t r0 = 0, step = RowsPerStep(w); r0 < rows; r0 += step) {
      ASSIGN_OR_RETURN(DenseWeight decoded, DecodeStep(w, r0, std::min(rows, r0 + step), nullptr));
      RETURN_IF_ERROR(AddStats(w, r0, decoded, &stats));
      EndStep(decoded);
    }
    stats_.push_back(stats.Row(w.weight->name));
  }
  return absl::OkStatus();
}

absl::Status QuantizeRun::QuantizeDecoded(const std::vector<const SourceWeight*>& members) {
  // The group's amax first (its members share weight_scale_2), then each member quantized and
  // compared step by step; a step's rows are decoded again rather than kept, so no member is
  // ever held decoded in whole.
  float amax = 0.0f;
  for (const SourceWeight* w : members) {
    const int64_t rows = w->module->out_features;
    for (int64_t r0 = 0, step = RowsPerStep(*w); r0 < rows; r0 += step) {
      ASSIGN_OR_RETURN(DenseWeight d, DecodeStep(*w, r0, std::min(rows, r0 + step), &amax));
      EndStep(d);
    }
  }
  for (const SourceWeight* w : members) {
    absl::StatusOr<kernels::Nvfp4Out> out = NewOutput(*w);
    if (!out.ok()) return out.status();
    ErrorStats stats;
    const int64_t rows = w->module->out_features;
    const int64_t cols = w->module->in_features;
    for (int64_t r0 = 0, step = RowsPerStep(*w); r0 < rows; r0 += step) {
      ASSIGN_OR_RETURN(DenseWeight d, DecodeStep(*w, r0, std::min(rows, r0 + step), nullptr));
      const kernels::Nvfp4Out rows_out{out->data + r0 * cols / 2,
                                       out->scales + r0 * cols / kernels::kNvfp4BlockSize,
                                       out->scale_2};
      if (absl::Status s = backend_.Nvfp4Quantize(d.tensor, amax, rows_out); !s.ok()) {
        return WeightError(*w, s);
      }
      RETURN_IF_ERROR(AddStats(*w, r0, d, &stats));
      EndStep(d);
    }
    stats_.push_back(stats.Row(w->weight->name));
  }
  return absl::OkStatus();
}

absl::Status QuantizeRun::QuantizeGroup(const std::vector<std::string>& group) {
  std::vector<const SourceWeight*> members;
  bool lossless = ctx_.spec->expert_cast == ExpertCast::kLossless;
  for (const std::string& name : group) {
    const SourceWeight& w = weights_.at(name);
    lossless = lossless && w.module->format == TensorFormat::kMxfp4;
    members.push_back(&w);
  }
  return lossless ? CastLossless(members) : QuantizeDecoded(members);
}

absl::Status QuantizeRun::WriteEntry(checkpoint::SafetensorsWriter& writer,
                                     const OutputEntry& entry) {
  if (!entry.bf16_module.empty()) {
    absl::Status s = AppendDecodedWeight(ctx_, writer, entry.bf16_module);
    if (!s.ok()) return s;
    AddProgress(ctx_, FindLinear(*ctx_.inventory, entry.bf16_module)->bytes);
    return absl::OkStatus();
  }
  if (entry.source != nullptr) {
    absl::Status s = AppendChunked(writer, entry.source->data, entry.source->size);
    if (!s.ok()) return s;
    ReleaseSource(*ctx_.source, entry.source);
    AddProgress(ctx_, entry.source->size);
    return absl::OkStatus();
  }
  if (pending_.count(entry.module) == 0) {
    auto group = groups_.find(entry.module);
    absl::Status s =
        group != groups_.end() ? QuantizeGroup(*group->second) : QuantizeGroup({entry.module});
    if (!s.ok()) return s;
  }
  QuantizedModule& q = pending_.at(entry.module);
  const bool modelopt = ctx_.spec->export_format == ExportFormat::kModelOpt;
  absl::Status status;
  switch (entry.part) {
    case Part::kValues:
    case Part::kBlockScales: {
      const kernels::Buffer& buffer = entry.part == Part::kValues ? q.values : q.scales;
      absl::StatusOr<const void*> host = ToHost(backend_, buffer.data(), buffer.size(), &staging_);
      status = host.ok() ? AppendChunked(writer, *host, buffer.size()) : host.status();
      break;
    }
    case Part::kGlobalScale: {
      // compressed-tensors stores the reciprocal (weight_global_scale = 1 / weight_scale_2).
      const float v = modelopt ? q.scale_2 : 1.0f / q.scale_2;
      status = writer.Append(&v, sizeof(v));
      break;
    }
    case Part::kInputScale: {
      const float s = input_scales_.scale.at(entry.module);
      const float v = modelopt ? s : 1.0f / s;
      status = writer.Append(&v, sizeof(v));
      break;
    }
  }
  if (!status.ok()) return status;
  if (--q.unwritten == 0) {
    ReleaseSource(*ctx_.source, weights_.at(entry.module));
    AddProgress(ctx_, q.source_bytes);
    pending_.erase(entry.module);
  }
  return absl::OkStatus();
}

absl::StatusOr<TaskOutput> QuantizeRun::Run() {
  if (absl::Status s = Prepare(); !s.ok()) return s;
  std::vector<checkpoint::TensorSpec> specs;
  for (const OutputEntry& e : entries_) specs.push_back(e.spec);
  absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsWriter>> writer =
      CreateShardWriter(ctx_.output_dir, task_.shard, std::move(specs));
  if (!writer.ok()) return writer.status();
  const std::string path = ctx_.output_dir->PathOf(task_.shard);
  for (const OutputEntry& e : entries_) {
    if (absl::Status s = CheckCancelled(ctx_, task_.shard); !s.ok()) return s;
    if (absl::Status s = WriteEntry(**writer, e); !s.ok()) return s;
  }
  absl::StatusOr<TaskOutput> output = FinishShard(ctx_, **writer, path);
  if (!output.ok()) return output.status();
  output->stats = std::move(stats_);
  return output;
}

}  // namespace

absl::StatusOr<std::vector<store::TaskPlan>> QuantizeStage::Plan(const PlanInput& input) const {
  const store::TaskRef inspect{std::string(InspectStage::kKind), std::string(InspectStage::kKind)};
  ASSIGN_OR_RETURN(const CalibrationLayout calibration, PlanCalibrationLayout(input));
  std::vector<store::TaskPlan> tasks;
  for (size_t i = 0; i < input.output_shards.size(); ++i) {
    const OutputShard& shard = input.output_shards[i];
    std::vector<store::TaskRef> depends_on = {inspect};
    for (store::TaskRef& ref : CalibrateDependencies(calibration, *input.spec, shard.task)) {
      depends_on.push_back(std::move(ref));
    }
    tasks.push_back({shard.task.shard, ToJson(shard.task), static_cast<int64_t>(shard.source_bytes),
                     ShardLabel(i, input.output_shards.size()), {}, std::move(depends_on)});
  }
  return tasks;
}

void QuantizeStage::AdaptSpec(const std::vector<store::TaskRow>& stored, JobSpec& spec) const {
  if (spec.recipe != job::RecipeKind::kFull) return;
  for (const store::TaskRow& row : stored) {
    if (row.stage_kind != kKind) continue;
    // A payload that does not parse is left to the replanning, which refuses the changed plan.
    absl::StatusOr<ShardTask> task = ParseShardTask(row.payload_json);
    if (!task.ok()) continue;
    for (const std::string& module : task->modules) {
      if (IsGroupedOutputProjection(module)) {
        spec.recipe_revision = 1;
        return;
      }
    }
  }
}

absl::StatusOr<TaskOutput> QuantizeStage::Run(const store::TaskRow& task, compute::Device&,
                                              const StageContext& ctx) const {
  ASSIGN_OR_RETURN(ShardTask payload, ParseShardTask(task.payload_json));
  return RunQuantizeTask(ctx, payload);
}

absl::Status QuantizeStage::Record(store::TaskRecord& txn, const store::TaskRow&,
                                   const TaskOutput& output) const {
  return txn.PutTensorStats(output.stats);
}

absl::StatusOr<TaskOutput> RunQuantizeTask(const StageContext& ctx, const ShardTask& task,
                                           int64_t host_step_elements) {
  if (host_step_elements <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host_step_elements ", host_step_elements, " is not positive"));
  }
  return QuantizeRun(ctx, task, host_step_elements).Run();
}

}  // namespace quantd::pipeline
