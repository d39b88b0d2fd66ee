// Verify: re-reads one output shard, checks it against the plan and the export rules, then
// measures each NVFP4 module against the source. The reference is the source as the quantizer
// saw it (shard_io.h DecodeWeight: FP8-block and MXFP4 weights decoded to BF16, BF16 and F32
// weights as stored); the output is decoded as readers do (Nvfp4Dequant with weight_scale_2, or
// 1 / weight_global_scale for compressed-tensors), in row chunks, so that the float32 copies
// stay bounded by a chunk.
#include "server/pipeline/stages/verify_stage.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "kernels/formats.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/pipeline/stages/export_stage.h"
#include "server/pipeline/stages/quantize_stage.h"
#include "server/pipeline/stages/shard_io.h"
#include "server/pipeline/stages/verify_rules.h"
#include "server/pipeline/tensor_inventory.h"

namespace quantd::pipeline {
namespace {

using checkpoint::Dtype;
using checkpoint::TensorView;

// Output elements decoded and compared per chunk: 16 MiB of float32 on each side.
constexpr int64_t kChunkElements = int64_t{1} << 22;

// The shard holds exactly the planned tensors, with the planned dtypes and shapes.
void CheckShardContents(const StageContext& ctx, const ShardTask& task,
                        const std::map<std::string, const LinearModule*>& linears,
                        const checkpoint::SafetensorsFile& shard,
                        std::vector<Violation>* out) {
  struct Expected {
    Dtype dtype;
    std::vector<int64_t> shape;
  };
  std::map<std::string, Expected> expected;
  for (const std::string& name : task.copy_tensors) {
    const TensorView* src = ctx.source->Find(name);
    if (src != nullptr) expected[name] = {src->dtype, src->shape};
  }
  for (const std::string& module : task.modules) {
    auto it = linears.find(module);
    if (it == linears.end()) continue;
    for (const OutputTensor& t : Nvfp4ModuleTensors(*ctx.spec, module, it->second->out_features,
                                                    it->second->in_features)) {
      expected[t.name] = {t.dtype, t.shape};
    }
  }
  for (const std::string& module : task.bf16_modules) {
    const LinearModule* m = FindLinear(*ctx.inventory, module);
    if (m != nullptr) expected[module + ".weight"] = {Dtype::kBF16, {m->out_features, m->in_features}};
  }
  for (const auto& [name, want] : expected) {
    const TensorView* v = shard.Find(name);
    if (v == nullptr) {
      out->push_back({kRuleShardContents, name, "planned tensor is missing from the shard"});
    } else if (v->dtype != want.dtype || v->shape != want.shape) {
      out->push_back({kRuleShardContents, name,
                      absl::StrCat("is ", std::string(checkpoint::DtypeName(v->dtype)), " ",
                                   ShapeString(v->shape), ", planned ",
                                   std::string(checkpoint::DtypeName(want.dtype)), " ",
                                   ShapeString(want.shape))});
    }
  }
  for (const TensorView& v : shard.tensors()) {
    if (expected.count(v.name) == 0) {
      out->push_back({kRuleShardContents, v.name, "tensor is not in the plan for this shard"});
    }
  }
}

// A module written as BF16 must equal its source decoded the official way, bit for bit.
absl::Status CheckBf16Module(const StageContext& ctx, const std::string& module,
                             const TensorView& written, std::vector<Violation>* out) {
  absl::StatusOr<SourceWeight> w = FindSourceWeight(ctx, module);
  if (!w.ok()) return w.status();
  absl::StatusOr<HostWeight> decoded = DecodeWeightToHost(*ctx.backend, *w);
  if (!decoded.ok()) return decoded.status();
  const uint16_t* want = static_cast<const uint16_t*>(decoded->data);
  const uint16_t* got = reinterpret_cast<const uint16_t*>(written.data);
  const size_t n = decoded->dense.bytes / 2;
  for (size_t i = 0; i < n; ++i) {
    if (want[i] == got[i]) continue;
    out->push_back({kRuleShardContents, written.name,
                    absl::StrCat("BF16 weight differs from the decoded source at element ", i)});
    break;
  }
  ReleaseSource(ctx, *w);
  return absl::OkStatus();
}

// Rows [r0, r1) of the NVFP4 output as float32 into `got`.
absl::Status DecodeOutputRows(kernels::Backend& backend, const Nvfp4ModuleViews& m, int64_t cols,
                              int64_t r0, int64_t r1, float* got) {
  const size_t n = static_cast<size_t>((r1 - r0) * cols);
  kernels::Buffer data_holder, scales_holder;
  absl::StatusOr<const void*> data =
      ToBackend(backend, m.weight->data + r0 * cols / 2, n / 2, 1, &data_holder);
  if (!data.ok()) return data.status();
  absl::StatusOr<const void*> scales =
      ToBackend(backend, m.weight_scale->data + r0 * cols / kernels::kNvfp4BlockSize,
                n / kernels::kNvfp4BlockSize, 1, &scales_holder);
  if (!scales.ok()) return scales.status();
  kernels::Buffer out_holder;
  void* out = got;
  if (!ComputesOnHost(backend)) {
    absl::StatusOr<kernels::Buffer> buffer = backend.Allocate(n * sizeof(float));
    if (!buffer.ok()) return buffer.status();
    out_holder = std::move(*buffer);
    out = out_holder.data();
  }
  const kernels::Nvfp4Tensor src{static_cast<const uint8_t*>(*data),
                                 static_cast<const uint8_t*>(*scales), Nvfp4WeightScale2(m),
                                 r1 - r0, cols};
  absl::Status s = backend.Nvfp4Dequant(src, {out, kernels::FloatType::kF32});
  if (!s.ok() || out == got) return s;
  return backend.CopyToHost(got, out, n * sizeof(float));
}

// Error statistics of one module: the source decoded whole (shard_io.h DecodeWeight, as the
// quantize stage decodes it), the output decoded and compared in row chunks.
absl::StatusOr<store::TensorStatsRow> ModuleStats(const StageContext& ctx,
                                                  const std::string& module,
                                                  const Nvfp4ModuleViews& out) {
  absl::StatusOr<SourceWeight> source = FindSourceWeight(ctx, module);
  if (!source.ok()) return source.status();
  absl::StatusOr<HostWeight> decoded = DecodeWeightToHost(*ctx.backend, *source);
  if (!decoded.ok()) return decoded.status();
  const void* ref_data = decoded->data;
  const bool bf16 = decoded->dense.tensor.type == kernels::FloatType::kBF16;

  const int64_t rows = decoded->dense.tensor.rows;
  const int64_t cols = decoded->dense.tensor.cols;
  const int64_t chunk_rows = std::max<int64_t>(1, kChunkElements / cols);
  std::vector<float> ref, got;
  ErrorStats stats;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t r1 = std::min(rows, r0 + chunk_rows);
    const int64_t n = (r1 - r0) * cols;
    ref.resize(static_cast<size_t>(n));
    got.resize(static_cast<size_t>(n));
    const float* ref_rows;
    if (bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(ref_data) + r0 * cols;
      for (int64_t i = 0; i < n; ++i) ref[i] = formats::Bf16ToFloat(src[i]);
      ref_rows = ref.data();
    } else {
      ref_rows = static_cast<const float*>(ref_data) + r0 * cols;
    }
    absl::Status s = DecodeOutputRows(*ctx.backend, out, cols, r0, r1, got.data());
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(out.name, ": ", s.message()));
    stats.Add(ref_rows, got.data(), n);
  }
  return stats.Row(source->weight->name);
}

}  // namespace

absl::StatusOr<std::vector<store::TaskPlan>> VerifyStage::Plan(const PlanInput& input) const {
  const store::TaskRef exported{std::string(ExportStage::kKind), std::string(ExportStage::kKind)};
  std::vector<store::TaskPlan> tasks;
  for (size_t i = 0; i < input.output_shards.size(); ++i) {
    const OutputShard& shard = input.output_shards[i];
    const store::TaskRef quantized{std::string(QuantizeStage::kKind), shard.task.shard};
    tasks.push_back({shard.task.shard, ToJson(shard.task), static_cast<int64_t>(shard.source_bytes),
                     ShardLabel(i, input.output_shards.size()), {}, {quantized, exported}});
  }
  return tasks;
}

absl::StatusOr<TaskOutput> VerifyStage::Run(const store::TaskRow& task, compute::Device&,
                                            const StageContext& ctx) const {
  ASSIGN_OR_RETURN(ShardTask payload, ParseShardTask(task.payload_json));
  return RunVerifyTask(ctx, payload);
}

absl::Status VerifyStage::Record(store::TaskRecord& txn, const store::TaskRow&,
                                 const TaskOutput& output) const {
  return txn.PutTensorStats(output.stats);
}

absl::StatusOr<TaskOutput> RunVerifyTask(const StageContext& ctx, const ShardTask& task) {
  const std::string path = absl::StrCat(ctx.spec->output, "/", task.shard);
  absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsFile>> shard =
      checkpoint::SafetensorsFile::Open(path);
  if (!shard.ok()) return shard.status();

  std::map<std::string, const LinearModule*> linears;
  for (const std::string& module : task.modules) {
    const LinearModule* m = FindLinear(*ctx.inventory, module);
    if (m == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(task.shard, ": planned module ", module, " is not in the source"));
    }
    linears[module] = m;
  }

  // Both files are mapped: what was read from them counts only while they are intact.
  const auto intact = [&] {
    absl::Status s = CheckSourceIntact(ctx);
    return s.ok() ? (*shard)->CheckIntact() : s;
  };
  std::vector<Violation> violations;
  CheckShardContents(ctx, task, linears, **shard, &violations);
  std::vector<const TensorView*> views;
  for (const TensorView& v : (*shard)->tensors()) views.push_back(&v);
  const std::vector<Nvfp4ModuleViews> modules = FindNvfp4Modules(views);
  CheckNvfp4Modules(modules, ctx.spec->weight_format == WeightFormat::kNvfp4, &violations);
  if (absl::Status s = intact(); !s.ok()) return s;
  if (!violations.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", violations.size(),
                                                   " export rule violation(s):\n",
                                                   FormatViolations(violations)));
  }

  std::map<std::string, const Nvfp4ModuleViews*> by_name;
  for (const Nvfp4ModuleViews& m : modules) by_name[m.name] = &m;
  TaskOutput output;
  for (const std::string& module : task.modules) {
    if (absl::Status s = CheckCancelled(ctx, task.shard); !s.ok()) return s;
    // CheckShardContents has seen every planned module's tensors with the right dtypes.
    absl::StatusOr<store::TensorStatsRow> row = ModuleStats(ctx, module, *by_name.at(module));
    if (!row.ok()) return row.status();
    output.stats.push_back(std::move(*row));
    const Nvfp4ModuleViews& out = *by_name.at(module);
    for (const TensorView* v : {out.weight, out.weight_scale}) (*shard)->ReleasePages(*v);
    for (const std::string& name : linears.at(module)->tensors) {
      ReleaseSource(ctx, ctx.source->Find(name));
    }
    AddProgress(ctx, linears.at(module)->bytes);
  }
  for (const std::string& module : task.bf16_modules) {
    if (absl::Status s = CheckCancelled(ctx, task.shard); !s.ok()) return s;
    const LinearModule* m = FindLinear(*ctx.inventory, module);
    if (m == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(task.shard, ": planned module ", module, " is not in the source"));
    }
    // CheckShardContents has seen the weight with the planned dtype and shape.
    const TensorView& written = *(*shard)->Find(module + ".weight");
    if (absl::Status s = CheckBf16Module(ctx, module, written, &violations); !s.ok()) return s;
    (*shard)->ReleasePages(written);
    AddProgress(ctx, m->bytes);
  }
  if (absl::Status s = intact(); !s.ok()) return s;
  if (!violations.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", violations.size(),
                                                   " export rule violation(s):\n",
                                                   FormatViolations(violations)));
  }
  uint64_t copied = 0;
  for (const std::string& name : task.copy_tensors) {
    const TensorView* src = ctx.source->Find(name);
    if (src != nullptr) copied += src->size;
  }
  AddProgress(ctx, copied);
  if (absl::Status s = intact(); !s.ok()) return s;
  return output;
}

}  // namespace quantd::pipeline
