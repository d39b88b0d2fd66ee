// The verify stage on real NVFP4 output shards that the test writes itself with the CPU kernels
// (the tiny V4 fixture cast losslessly, the tiny V3 fixture requantized from FP8 with partial
// 128-blocks, a BF16 module large enough to be decoded in two chunks): every shard passes, and
// each module's statistics equal those of a scalar oracle built only from formats.h. A broken
// shard fails with every violation listed; cancellation and progress are honoured. The outputs,
// exported, pass VerifyCheckpoint. Runs on the CPU backend, and on CUDA when a device is present.
#include "server/pipeline/stages/verify_stage.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/backends.h"
#include "kernels/formats.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/checkpoint/sha256.h"
#include "server/checkpoint/source_weight.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/fixture/fixture.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stages/export_stage.h"
#include "server/pipeline/stages/quantize_stage.h"
#include "server/pipeline/stages/verify_rules.h"
#include "tests/unit/stage_dirs.h"

namespace quantd::pipeline {

using checkpoint::BuildInventory;
using checkpoint::FindLinear;
using checkpoint::LinearModule;
using checkpoint::TensorFormat;
using checkpoint::TensorInventory;

using job::ExpertCast;
using job::ExportFormat;
using job::JobSpec;
using job::ParseJobSpec;

namespace {

namespace fs = std::filesystem;
using checkpoint::Dtype;
using checkpoint::TensorView;

// A tensor of an output shard being written.
struct OutTensor {
  checkpoint::TensorSpec spec;
  std::string bytes;
};

std::string F32Bytes(float f) { return std::string(reinterpret_cast<const char*>(&f), 4); }

float F32At(const TensorView& v) {
  float f;
  memcpy(&f, v.data, 4);
  return f;
}

// Source element i of a linear module, as the quantizer sees it (formats.h only).
float SourceValue(const LinearModule& m, const TensorView& w, const TensorView* s, int64_t i) {
  const int64_t cols = m.in_features;
  const int64_t r = i / cols, c = i % cols;
  switch (m.format) {
    case TensorFormat::kBf16:
      return formats::Bf16ToFloat(reinterpret_cast<const uint16_t*>(w.data)[i]);
    case TensorFormat::kFp8BlockE8m0:
    case TensorFormat::kFp8BlockF32: {
      const int64_t si = (r / 128) * s->shape[1] + c / 128;
      const float scale = m.format == TensorFormat::kFp8BlockE8m0
                              ? formats::E8m0ToFloat(s->data[si])
                              : reinterpret_cast<const float*>(s->data)[si];
      return formats::Bf16ToFloat(formats::FloatToBf16(formats::E4m3ToFloat(w.data[i]) * scale));
    }
    case TensorFormat::kMxfp4: {
      const uint8_t byte = w.data[i / 2];
      const uint8_t code = (i % 2 == 0) ? (byte & 0xF) : (byte >> 4);
      return formats::Bf16ToFloat(formats::FloatToBf16(
          formats::E2m1ToFloat(code) * formats::E8m0ToFloat(s->data[r * cols / 32 + c / 32])));
    }
    default:
      ADD_FAILURE() << "unexpected source format for " << m.name;
      return 0;
  }
}

class VerifyStageTest : public testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam() && kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    auto backend = GetParam() ? kernels::MakeCudaBackend(0) : kernels::MakeCpuBackend({});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
    auto cpu = kernels::MakeCpuBackend({});
    ASSERT_TRUE(cpu.ok());
    cpu_ = std::move(*cpu);
    const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
    root_ = (fs::path(testing::TempDir()) /
             absl::StrCat("verify_stage_test_", GetParam() ? "cuda_" : "cpu_", getpid()))
                .string();
    root_ += std::string("_") + std::to_string(std::hash<std::string>()(info->name()));
    fs::remove_all(root_);
    src_ = root_ + "/src";
    out_ = root_ + "/out";
    fs::create_directories(out_);
  }
  void TearDown() override { fs::remove_all(root_); }

  void OpenSource(const std::string& extra_spec) {
    auto source = checkpoint::CheckpointDir::Open(src_);
    ASSERT_TRUE(source.ok()) << source.status();
    source_ = std::move(*source);
    auto inventory = BuildInventory(*source_);
    ASSERT_TRUE(inventory.ok()) << inventory.status();
    inventory_ = std::move(*inventory);
    auto spec = ParseJobSpec(
        "{\"source\": \"" + src_ + "\", \"output\": \"" + out_ + "\"" + extra_spec + "}", "test");
    ASSERT_TRUE(spec.ok()) << spec.status();
    spec_ = *spec;
    auto plan = BuildPlan(spec_, *source_, inventory_);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = *plan;
    for (const LinearModule& m : inventory_.linears) linears_[m.name] = &m;
    for (const store::StagePlan& stage : plan_.stages) {
      if (stage.kind != "verify") continue;
      for (const store::TaskPlan& t : stage.tasks) {
        auto task = ParseShardTask(t.payload_json);
        ASSERT_TRUE(task.ok());
        tasks_.push_back(*task);
        task_bytes_.push_back(static_cast<uint64_t>(t.bytes_total));
      }
    }
  }

  void MakeFixture(fixture::Arch arch, const std::string& extra_spec) {
    auto summary = fixture::WriteFixture(fixture::MakeConfig(arch, fixture::Preset::kTiny), 11,
                                         src_, {});
    ASSERT_TRUE(summary.ok()) << summary.status();
    OpenSource(extra_spec);
  }

  // The module's weight decoded to BF16 by the CPU kernels.
  std::vector<uint16_t> DecodeBf16(const LinearModule& m) {
    const TensorView* w = source_->Find(m.tensors[0]);
    const TensorView* s = m.tensors.size() > 1 ? source_->Find(m.tensors[1]) : nullptr;
    std::vector<uint16_t> out(static_cast<size_t>(m.out_features * m.in_features));
    const kernels::DenseOut dst{out.data(), kernels::FloatType::kBF16};
    if (m.format == TensorFormat::kBf16) {
      memcpy(out.data(), w->data, w->size);
    } else if (m.format == TensorFormat::kMxfp4) {
      EXPECT_TRUE(cpu_->Mxfp4Dequant({w->data, s->data, m.out_features, m.in_features}, dst).ok());
    } else {
      EXPECT_TRUE(cpu_->Fp8BlockDequant({w->data, s->data,
                                         m.format == TensorFormat::kFp8BlockE8m0
                                             ? kernels::Fp8ScaleType::kE8M0
                                             : kernels::Fp8ScaleType::kF32,
                                         m.out_features, m.in_features},
                                        dst)
                      .ok());
    }
    return out;
  }

  // The NVFP4 tensors of one fusion group (or lone module), as the spec's format names them:
  // MXFP4 cast losslessly unless the spec says requantize, everything else decoded to BF16 and
  // quantized against the group's amax. Input scale `input_scale` for the whole group.
  void QuantizeGroup(const std::vector<std::string>& group, float input_scale,
                     std::vector<OutTensor>* out) {
    const bool lossless = linears_.at(group[0])->format == TensorFormat::kMxfp4 &&
                          spec_.expert_cast == ExpertCast::kLossless;
    std::vector<std::vector<uint16_t>> decoded;
    float amax = 0;
    int kmax = -127;
    for (const std::string& name : group) {
      const LinearModule& m = *linears_.at(name);
      if (lossless) {
        const TensorView* w = source_->Find(m.tensors[0]);
        const TensorView* s = source_->Find(m.tensors[1]);
        auto k = cpu_->Mxfp4MaxExponent({w->data, s->data, m.out_features, m.in_features});
        ASSERT_TRUE(k.ok());
        kmax = std::max(kmax, *k);
        continue;
      }
      decoded.push_back(DecodeBf16(m));
      auto a = cpu_->AbsMax(
          {decoded.back().data(), kernels::FloatType::kBF16, m.out_features, m.in_features});
      ASSERT_TRUE(a.ok());
      amax = std::max(amax, *a);
    }
    for (size_t i = 0; i < group.size(); ++i) {
      const LinearModule& m = *linears_.at(group[i]);
      std::string data(static_cast<size_t>(m.out_features * m.in_features / 2), '\0');
      std::string scales(static_cast<size_t>(m.out_features * m.in_features / 16), '\0');
      float scale_2 = 0;
      const kernels::Nvfp4Out dst{reinterpret_cast<uint8_t*>(data.data()),
                                  reinterpret_cast<uint8_t*>(scales.data()), &scale_2};
      if (lossless) {
        const TensorView* w = source_->Find(m.tensors[0]);
        const TensorView* s = source_->Find(m.tensors[1]);
        ASSERT_TRUE(
            cpu_->Mxfp4ToNvfp4({w->data, s->data, m.out_features, m.in_features}, kmax, dst).ok());
      } else {
        ASSERT_TRUE(cpu_->Nvfp4Quantize({decoded[i].data(), kernels::FloatType::kBF16,
                                         m.out_features, m.in_features},
                                        amax, dst)
                        .ok());
      }
      const bool ct = spec_.export_format == ExportFormat::kCompressedTensors;
      for (const OutputTensor& t :
           Nvfp4ModuleTensors(spec_, m.name, m.out_features, m.in_features)) {
        std::string bytes;
        const std::string leaf = t.name.substr(t.name.rfind('.') + 1);
        if (leaf == "weight" || leaf == "weight_packed") bytes = data;
        if (leaf == "weight_scale") bytes = scales;
        if (leaf == "weight_scale_2" || leaf == "weight_global_scale") {
          bytes = F32Bytes(ct ? 1.0f / scale_2 : scale_2);
        }
        if (leaf == "input_scale" || leaf == "input_global_scale") {
          bytes = F32Bytes(ct ? 1.0f / input_scale : input_scale);
        }
        out->push_back({{t.name, t.dtype, t.shape}, bytes});
      }
    }
  }

  // Writes every output shard the plan names; `mutate` may edit a shard's tensors first.
  void WriteOutputs(
      const std::function<void(const std::string&, std::vector<OutTensor>&)>& mutate = {}) {
    int group_index = 0;
    for (const ShardTask& task : tasks_) {
      std::vector<OutTensor> tensors;
      for (const std::string& name : task.copy_tensors) {
        const TensorView* v = source_->Find(name);
        tensors.push_back({{name, v->dtype, v->shape},
                           std::string(reinterpret_cast<const char*>(v->data), v->size)});
      }
      std::set<std::string> grouped;
      for (const auto& g : task.fusion_groups) grouped.insert(g.begin(), g.end());
      std::vector<std::vector<std::string>> groups = task.fusion_groups;
      for (const std::string& m : task.modules) {
        if (grouped.count(m) == 0) groups.push_back({m});
      }
      for (const auto& g : groups) {
        QuantizeGroup(g, 0.125f * static_cast<float>(1 + group_index++ % 5), &tensors);
      }
      for (const std::string& name : task.bf16_modules) {
        const LinearModule& m = *FindLinear(inventory_, name);
        const std::vector<uint16_t> bf16 = DecodeBf16(m);
        tensors.push_back({{name + ".weight", checkpoint::Dtype::kBF16,
                            {m.out_features, m.in_features}},
                           std::string(reinterpret_cast<const char*>(bf16.data()),
                                       bf16.size() * 2)});
      }
      if (mutate) mutate(task.shard, tensors);
      std::vector<checkpoint::TensorSpec> specs;
      for (const OutTensor& t : tensors) specs.push_back(t.spec);
      auto w = checkpoint::SafetensorsWriter::Create(out_ + "/" + task.shard, specs);
      ASSERT_TRUE(w.ok()) << w.status();
      for (const OutTensor& t : tensors) {
        ASSERT_TRUE((*w)->WriteTensor(t.spec.name, t.bytes.data(), t.bytes.size()).ok());
      }
      ASSERT_TRUE((*w)->Finish().ok());
      recorded_[task.shard] = {out_ + "/" + task.shard, static_cast<int64_t>((*w)->total_bytes()),
                               (*w)->sha256()};
    }
  }

  // The stage's context; recorded_output answers for the quantize tasks from recorded_.
  StageContext Context() {
    StageContext ctx;
    ctx.spec = &spec_;
    ctx.source = source_.get();
    ctx.inventory = &inventory_;
    ctx.backend = backend_.get();
    ctx.input_amax = &input_amax_;
    testing_util::OpenStageDirs(&ctx);
    ctx.recorded_output = [this](std::string_view kind,
                                 const std::string& name) -> std::optional<RecordedOutput> {
      auto it = recorded_.find(name);
      if (kind != QuantizeStage::kKind || it == recorded_.end()) return std::nullopt;
      return it->second;
    };
    return ctx;
  }

  // Statistics of one module from formats.h alone: the source decoded as the quantizer saw it,
  // the output decoded as readers do.
  store::TensorStatsRow Oracle(const checkpoint::SafetensorsFile& shard, const LinearModule& m,
                               int64_t* exact) {
    const TensorView* w = source_->Find(m.tensors[0]);
    const TensorView* s = m.tensors.size() > 1 ? source_->Find(m.tensors[1]) : nullptr;
    const bool ct = spec_.export_format == ExportFormat::kCompressedTensors;
    const TensorView* q = shard.Find(m.name + (ct ? ".weight_packed" : ".weight"));
    const TensorView* qs = shard.Find(m.name + ".weight_scale");
    const TensorView* g = shard.Find(m.name + (ct ? ".weight_global_scale" : ".weight_scale_2"));
    const float scale_2 = ct ? 1.0f / F32At(*g) : F32At(*g);
    double ref_sq = 0, err_sq = 0, max_abs = 0;
    const int64_t cols = m.in_features;
    for (int64_t i = 0; i < m.out_features * cols; ++i) {
      const double ref = SourceValue(m, *w, s, i);
      const uint8_t byte = q->data[i / 2];
      const uint8_t code = (i % 2 == 0) ? (byte & 0xF) : (byte >> 4);
      const double got = formats::Nvfp4Decode(code, qs->data[(i / cols) * (cols / 16) + (i % cols) / 16],
                                              scale_2);
      ref_sq += ref * ref;
      err_sq += (got - ref) * (got - ref);
      max_abs = std::max(max_abs, std::fabs(got - ref));
    }
    *exact += err_sq == 0;
    store::TensorStatsRow row;
    row.tensor = m.tensors[0];
    row.rel_rmse = err_sq == 0 ? 0 : std::sqrt(err_sq / ref_sq);
    row.sqnr_db = err_sq == 0 ? INFINITY : 10 * std::log10(ref_sq / err_sq);
    row.max_abs_err = max_abs;
    return row;
  }

  // Runs every quantize task (input amax 1 + i % 5 for the i-th module) and compares the
  // statistics it measured with the oracle's decode of the file it wrote, then verifies the file;
  // returns how many modules decode exactly.
  int64_t QuantizeAndVerifyAgainstOracle() {
    int i = 0;
    for (const LinearModule& m : inventory_.linears) input_amax_[m.name] = 1.0f + i++ % 5;
    int64_t exact = 0, modules = 0;
    for (size_t t = 0; t < tasks_.size(); ++t) {
      const ShardTask& task = tasks_[t];
      absl::StatusOr<TaskOutput> quantized = RunQuantizeTask(Context(), task);
      EXPECT_TRUE(quantized.ok()) << quantized.status();
      if (!quantized.ok()) continue;
      recorded_[task.shard] = {quantized->path, static_cast<int64_t>(quantized->bytes),
                               quantized->sha256};
      auto shard = checkpoint::SafetensorsFile::Open(out_ + "/" + task.shard);
      EXPECT_TRUE(shard.ok());
      std::map<std::string, store::TensorStatsRow> stats;
      for (const store::TensorStatsRow& row : quantized->stats) stats[row.tensor] = row;
      EXPECT_EQ(stats.size(), task.modules.size());
      for (const std::string& module : task.modules) {
        const store::TensorStatsRow want = Oracle(**shard, *linears_.at(module), &exact);
        EXPECT_EQ(stats.count(want.tensor), 1u) << want.tensor;
        if (stats.count(want.tensor) == 0) continue;
        const store::TensorStatsRow& got = stats.at(want.tensor);
        EXPECT_NEAR(got.rel_rmse, want.rel_rmse, 1e-12 * want.rel_rmse) << want.tensor;
        if (std::isinf(want.sqnr_db)) {
          EXPECT_EQ(got.sqnr_db, want.sqnr_db) << want.tensor;
        } else {
          EXPECT_NEAR(got.sqnr_db, want.sqnr_db, 1e-9) << want.tensor;
        }
        EXPECT_EQ(got.max_abs_err, want.max_abs_err) << want.tensor;
        ++modules;
      }

      uint64_t progress = 0;
      StageContext ctx = Context();
      ctx.add_progress = [&](uint64_t n) { progress += n; };
      absl::StatusOr<TaskOutput> verified = RunVerifyTask(ctx, task);
      EXPECT_TRUE(verified.ok()) << verified.status();
      if (!verified.ok()) continue;
      EXPECT_EQ(progress, task_bytes_[t]) << task.shard;
      EXPECT_EQ(verified->path, "");
      EXPECT_TRUE(verified->stats.empty());
    }
    EXPECT_GT(modules, 0);
    return exact;
  }

  // Exports the outputs and checks them as `quantd verify` would.
  void ExportAndVerifyCheckpoint(const std::string& layout, const std::string& algo) {
    absl::StatusOr<TaskOutput> exported = RunExportTask(Context(), plan_);
    ASSERT_TRUE(exported.ok()) << exported.status();
    absl::StatusOr<VerifyReport> report = VerifyCheckpoint(out_);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->ok()) << FormatVerifyReport(*report);
    EXPECT_EQ(report->layout, layout);
    EXPECT_EQ(report->quant_algo, algo);
    EXPECT_EQ(report->nvfp4_modules, static_cast<int64_t>(plan_.recipe.modules.size()));
  }

  std::unique_ptr<kernels::Backend> backend_;  // runs the stage
  std::unique_ptr<kernels::Backend> cpu_;      // writes the outputs
  std::string root_, src_, out_;
  std::unique_ptr<checkpoint::CheckpointDir> source_;
  TensorInventory inventory_;
  JobSpec spec_;
  Plan plan_;
  std::map<std::string, const LinearModule*> linears_;
  std::vector<ShardTask> tasks_;
  std::vector<uint64_t> task_bytes_;
  std::map<std::string, float> input_amax_;             // quantize tasks' input amax
  std::map<std::string, RecordedOutput> recorded_;      // by shard: what quantize recorded
};

TEST_P(VerifyStageTest, V4ExpertsCastLosslessly) {
  MakeFixture(fixture::Arch::kDeepseekV4, "");
  // Every block of the fixture's experts fits E4M3's window, so every module decodes exactly.
  EXPECT_EQ(QuantizeAndVerifyAgainstOracle(), static_cast<int64_t>(plan_.recipe.modules.size()));
  ExportAndVerifyCheckpoint("modelopt-mixed", "MIXED_PRECISION");
}

TEST_P(VerifyStageTest, V3FullRequantizedCompressedTensors) {
  MakeFixture(fixture::Arch::kDeepseekV3,
              ", \"recipe\": \"full\", \"export_format\": \"compressed-tensors\"");
  EXPECT_LT(QuantizeAndVerifyAgainstOracle(), static_cast<int64_t>(plan_.recipe.modules.size()));
  ExportAndVerifyCheckpoint("compressed-tensors", "NVFP4");
}

TEST_P(VerifyStageTest, LargeBf16ModuleDecodedInChunks) {
  // 4224 x 1024: the stage decodes 4096 rows, then 128.
  const int64_t rows = 4224, cols = 1024;
  fs::create_directories(src_);
  std::string bytes;
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = std::sin(0.001f * static_cast<float>(i)) * static_cast<float>(1 + i / cols % 7);
    const uint16_t b = formats::FloatToBf16(v);
    bytes.append(reinterpret_cast<const char*>(&b), 2);
  }
  auto w = checkpoint::SafetensorsWriter::Create(
      src_ + "/model.safetensors", {{"model.layers.0.mlp.down_proj.weight", Dtype::kBF16,
                                     {rows, cols}}});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->WriteTensor("model.layers.0.mlp.down_proj.weight", bytes.data(),
                                bytes.size()).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  ASSERT_TRUE(checkpoint::WriteFileAtomically(src_ + "/config.json",
                                              "{\"model_type\": \"llama\"}").ok());
  OpenSource(", \"include\": [\"model.layers.*\"], \"weight_format\": \"w4a16_nvfp4\"");
  EXPECT_EQ(QuantizeAndVerifyAgainstOracle(), 0);
  ExportAndVerifyCheckpoint("modelopt", "W4A16_NVFP4");
}

TEST_P(VerifyStageTest, BrokenShardFailsListingEveryViolation) {
  MakeFixture(fixture::Arch::kDeepseekV4, "");
  const std::string a = "layers.1.ffn.experts.2.w2";
  const std::string b = "layers.1.ffn.experts.3.w2";
  std::string broken_shard;
  WriteOutputs([&](const std::string& shard, std::vector<OutTensor>& tensors) {
    bool here = false;
    for (OutTensor& t : tensors) {
      if (t.spec.name == a + ".weight_scale") {
        t.bytes[3] = 0x7F;
        here = true;
      }
    }
    if (!here) return;
    broken_shard = shard;
    std::erase_if(tensors, [&](const OutTensor& t) { return t.spec.name == b + ".input_scale"; });
    tensors.push_back({{"stray", Dtype::kF32, {}}, F32Bytes(1)});
  });
  ASSERT_FALSE(broken_shard.empty());
  for (const ShardTask& task : tasks_) {
    absl::StatusOr<TaskOutput> out = RunVerifyTask(Context(), task);
    if (task.shard != broken_shard) {
      EXPECT_TRUE(out.ok()) << out.status();
      continue;
    }
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(out.status().message(),
              absl::StrCat(out_, "/", task.shard, ": 4 export rule violation(s):\n",
                           "[shard-contents] ", b, ".input_scale: planned tensor is missing from "
                           "the shard\n",
                           "[shard-contents] stray: tensor is not in the plan for this shard\n",
                           "[weight-scale-bytes] ", a, ": weight_scale has 1 NaN, 0 zero and 0 "
                           "negative byte(s); the first is 0x7f at [0, 3]\n",
                           "[input-scale] ", b, ": has no input_scale in a W4A4 checkpoint "
                           "(readers load it as 0)\n"));
  }
}

TEST_P(VerifyStageTest, Bf16ModuleMustEqualTheDecodedSource) {
  // V4 full recipe in the plain ModelOpt layout: mtp.* stays out of NVFP4 and is written as BF16.
  MakeFixture(fixture::Arch::kDeepseekV4, ", \"recipe\": \"full\"");
  std::string victim, broken_shard;
  for (const ShardTask& task : tasks_) {
    if (victim.empty() && !task.bf16_modules.empty()) {
      victim = task.bf16_modules.front();
      broken_shard = task.shard;
    }
  }
  ASSERT_FALSE(victim.empty());
  WriteOutputs([&](const std::string& shard, std::vector<OutTensor>& tensors) {
    if (shard != broken_shard) return;
    for (OutTensor& t : tensors) {
      if (t.spec.name == victim + ".weight") t.bytes[2 * 5 + 1] ^= 0x01;  // element 5, high byte
    }
  });
  for (const ShardTask& task : tasks_) {
    absl::StatusOr<TaskOutput> out = RunVerifyTask(Context(), task);
    if (task.shard != broken_shard) {
      EXPECT_TRUE(out.ok()) << out.status();
      continue;
    }
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(out.status().message(),
              absl::StrCat(out_, "/", task.shard, ": 1 export rule violation(s):\n",
                           "[shard-contents] ", victim,
                           ".weight: BF16 weight differs from the decoded source at element 5\n"));
  }
}

TEST_P(VerifyStageTest, CancelledWhileReadingBack) {
  MakeFixture(fixture::Arch::kDeepseekV4, "");
  WriteOutputs();
  const std::atomic<bool> cancelled{true};
  StageContext ctx = Context();
  ctx.cancelled = &cancelled;
  for (const ShardTask& task : tasks_) {
    if (task.modules.empty()) continue;
    absl::StatusOr<TaskOutput> out = RunVerifyTask(ctx, task);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kCancelled) << out.status();
  }
}

TEST_P(VerifyStageTest, BytesThatDifferFromTheRecordedOnesFailWithDataLoss) {
  MakeFixture(fixture::Arch::kDeepseekV4, "");
  WriteOutputs();
  const ShardTask& task = tasks_.front();
  const std::string path = out_ + "/" + task.shard;
  ASSERT_TRUE(RunVerifyTask(Context(), task).ok());

  // One bit of the last byte, a tensor's data that no export rule reads.
  const std::string recorded_sha = recorded_.at(task.shard).sha256;
  const uintmax_t size = fs::file_size(path);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char last = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(last ^ 1));
  }
  absl::StatusOr<std::string> sha = checkpoint::Sha256File(path);
  ASSERT_TRUE(sha.ok());
  absl::StatusOr<TaskOutput> out = RunVerifyTask(Context(), task);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(out.status().message(),
            absl::StrCat(path, ": read back, its ", size, " bytes are not the ", size,
                         " bytes the quantize task wrote (SHA-256 ", *sha, ", recorded ",
                         recorded_sha, ")"));

  recorded_.erase(task.shard);
  out = RunVerifyTask(Context(), task);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(out.status().message(),
            absl::StrCat(path, ": the quantize task of ", task.shard, " recorded no output"));
}

TEST_P(VerifyStageTest, BytesThisProcessHashedAsItWroteThemAreNotHashedAgainUnlessDeep) {
  MakeFixture(fixture::Arch::kDeepseekV4, "");
  WriteOutputs();
  const ShardTask& task = tasks_.front();
  const std::string path = out_ + "/" + task.shard;
  recorded_.at(task.shard).written_by_this_process = true;
  absl::StatusOr<TaskOutput> out = RunVerifyTask(Context(), task);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->summary, "size checked; its bytes were hashed as they were written");

  // One bit of the last byte, which no export rule reads: only a re-hash sees it.
  const uintmax_t size = fs::file_size(path);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char last = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(last ^ 1));
  }
  EXPECT_TRUE(RunVerifyTask(Context(), task).ok());
  spec_.verify.deep = true;
  out = RunVerifyTask(Context(), task);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss) << out.status();
  spec_.verify.deep = false;
  recorded_.at(task.shard).written_by_this_process = false;
  out = RunVerifyTask(Context(), task);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss) << out.status();

  // A size that differs from the recorded one is seen without a re-hash.
  recorded_.at(task.shard).written_by_this_process = true;
  recorded_.at(task.shard).bytes = static_cast<int64_t>(size) + 1;
  out = RunVerifyTask(Context(), task);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(out.status().message(), absl::StrCat(path, ": ", size,
                                                 " bytes, but the quantize task wrote ", size + 1));
}

TEST_P(VerifyStageTest, ARehashSaysHowManyBytesItRead) {
  MakeFixture(fixture::Arch::kDeepseekV4, "");
  WriteOutputs();
  const ShardTask& task = tasks_.front();
  absl::StatusOr<TaskOutput> out = RunVerifyTask(Context(), task);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->summary, absl::StrCat("read back and re-hashed ",
                                       fs::file_size(out_ + "/" + task.shard), " bytes"));
}

INSTANTIATE_TEST_SUITE_P(Backends, VerifyStageTest, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& p) {
                           return p.param ? "cuda" : "cpu";
                         });

}  // namespace
}  // namespace quantd::pipeline
