// The quantize stage on the tiny V4 and V3 fixtures: every task of BuildPlan's plan run with a
// CPU backend, the output shards re-read and checked against an independent computation with
// kernels/reference.h (decode to BF16, group amax, Nvfp4QuantizeRows; the lossless MXFP4 cast
// checked by decoding), plus the export-format variants, error paths and cancellation.
#include "server/pipeline/stages/quantize_stage.h"

#include <gtest/gtest.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>

#include "absl/strings/match.h"
#include "kernels/backends.h"
#include "kernels/formats.h"
#include "kernels/reference.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/checkpoint/sha256.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/fixture/fixture.h"
#include "server/pipeline/plan.h"
#include "tests/unit/stage_dirs.h"

namespace quantd::pipeline {

using checkpoint::BuildInventory;
using checkpoint::LinearModule;
using checkpoint::NaturalLess;
using checkpoint::TensorFormat;
using checkpoint::TensorInventory;

using job::ExpertCast;
using job::JobSpec;
using job::ParseJobSpec;
using job::WeightFormat;

namespace {

namespace fs = std::filesystem;
using checkpoint::TensorView;
using formats::FloatBits;

float ReadF32(const TensorView& t) {
  EXPECT_EQ(t.size, 4u) << t.name;
  if (t.size != 4) return std::numeric_limits<float>::quiet_NaN();
  float v;
  memcpy(&v, t.data, sizeof(v));
  return v;
}

std::vector<uint8_t> Bytes(const TensorView& t) { return {t.data, t.data + t.size}; }

// A source weight decoded with the reference kernels (BF16), or read as it is (BF16, F32).
struct RefDense {
  std::vector<uint8_t> bytes;
  kernels::DenseTensor tensor;
};

RefDense RefDecode(const checkpoint::CheckpointDir& src, const LinearModule& m) {
  const TensorView* w = src.Find(m.tensors[0]);
  RefDense d;
  d.tensor.rows = m.out_features;
  d.tensor.cols = m.in_features;
  const int64_t n = m.out_features * m.in_features;
  if (m.format == TensorFormat::kBf16 || m.format == TensorFormat::kF32) {
    d.bytes = Bytes(*w);
    d.tensor.type =
        m.format == TensorFormat::kBf16 ? kernels::FloatType::kBF16 : kernels::FloatType::kF32;
  } else {
    const TensorView* s = src.Find(m.tensors[1]);
    d.bytes.resize(static_cast<size_t>(n) * 2);
    const kernels::DenseOut out{d.bytes.data(), kernels::FloatType::kBF16};
    if (m.format == TensorFormat::kMxfp4) {
      kernels::Mxfp4Tensor t{w->data, s->data, m.out_features, m.in_features};
      EXPECT_EQ(kernels::reference::Mxfp4DequantRows(t, out, 0, t.rows), -1);
    } else {
      kernels::Fp8BlockTensor t{w->data, s->data,
                                m.format == TensorFormat::kFp8BlockE8m0
                                    ? kernels::Fp8ScaleType::kE8M0
                                    : kernels::Fp8ScaleType::kF32,
                                m.out_features, m.in_features};
      EXPECT_EQ(kernels::reference::Fp8BlockDequantRows(t, out, 0, t.rows), -1);
    }
  }
  d.tensor.data = d.bytes.data();
  return d;
}

// "<layer>/<gate_up|down>" for a routed expert, "" otherwise.
std::string ExpertKey(const std::string& module) {
  const size_t e = module.find(".experts.");
  if (e == std::string::npos) return "";
  const std::string leaf = module.substr(module.rfind('.') + 1);
  return module.substr(0, e) + ((leaf == "w2" || leaf == "down_proj") ? "/down" : "/gate_up");
}

// The input amax the rules give a module: its row, else its layer's max for its projection.
float ExpectedInputAmax(const std::string& module, const std::map<std::string, float>& table) {
  auto it = table.find(module);
  if (it != table.end()) return it->second;
  float m = 0.0f;
  for (const auto& [name, v] : table) {
    if (!ExpertKey(module).empty() && ExpertKey(name) == ExpertKey(module)) m = std::max(m, v);
  }
  EXPECT_GT(m, 0.0f) << module;
  return m;
}

bool LeftOutOfAmaxTable(const std::string& m) {
  for (const char* suffix :
       {"experts.3.w1", "experts.3.gate_proj", "experts.5.w2", "experts.5.down_proj"}) {
    const std::string s = suffix;
    if (m.size() >= s.size() && m.compare(m.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

// Every tensor of a set of output shards, by name.
struct Outputs {
  std::vector<std::unique_ptr<checkpoint::SafetensorsFile>> files;
  std::map<std::string, const TensorView*> by_name;

  const TensorView& at(const std::string& name) const {
    auto it = by_name.find(name);
    EXPECT_NE(it, by_name.end()) << name;
    static const TensorView kEmpty{};
    return it == by_name.end() ? kEmpty : *it->second;
  }
};

// One completed conversion: the plan, its quantize tasks and what each wrote.
struct RunResult {
  Plan plan;
  std::vector<ShardTask> tasks;
  Outputs outputs;
  double seconds = 0;
  int bf16_modules = 0;  // modules written as BF16 and checked against the reference decode
};

class QuantizeStageTest : public testing::TestWithParam<fixture::Arch> {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("quantd_quantize_test_" + std::to_string(getpid()) + "_" +
                                         std::to_string(static_cast<int>(GetParam())));
    fs::remove_all(base_);
    auto summary = fixture::WriteFixture(fixture::MakeConfig(GetParam(), fixture::Preset::kTiny), 7,
                                         (base_ / "src").string(), {});
    ASSERT_TRUE(summary.ok()) << summary.status();
    OpenSource(base_ / "src");
    auto backend = kernels::MakeCpuBackend({2, kernels::SimdLevel::kAuto});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
  }
  void TearDown() override { fs::remove_all(base_); }

  void OpenSource(const fs::path& dir) {
    auto source = checkpoint::CheckpointDir::Open(dir.string());
    ASSERT_TRUE(source.ok()) << source.status();
    source_ = std::move(*source);
    auto inventory = BuildInventory(*source_);
    ASSERT_TRUE(inventory.ok()) << inventory.status();
    inventory_ = std::move(*inventory);
  }

  bool IsV4() const { return GetParam() == fixture::Arch::kDeepseekV4; }

  JobSpec Spec(const std::string& out, const std::string& extra) {
    auto spec = ParseJobSpec("{\"source\": \"" + source_->dir() + "\", \"output\": \"" +
                                 (base_ / out).string() + "\"" + extra + "}",
                             "test");
    EXPECT_TRUE(spec.ok()) << spec.status();
    return *spec;
  }

  StageContext Context(const JobSpec& spec, const std::map<std::string, float>* amax) {
    StageContext ctx;
    ctx.spec = &spec;
    ctx.source = source_.get();
    ctx.inventory = &inventory_;
    ctx.backend = backend_.get();
    ctx.input_amax = amax;
    testing_util::OpenStageDirs(&ctx);
    return ctx;
  }

  // A deterministic amax per module of the plan, with some routed experts left out.
  static std::map<std::string, float> AmaxTable(const Plan& plan) {
    std::map<std::string, float> table;
    for (size_t i = 0; i < plan.recipe.modules.size(); ++i) {
      const std::string& m = plan.recipe.modules[i];
      if (!LeftOutOfAmaxTable(m)) table[m] = 0.5f + 0.25f * static_cast<float>(i % 13);
    }
    return table;
  }

  std::vector<store::TaskPlan> QuantizeTasks(const Plan& plan) {
    for (const store::StagePlan& s : plan.stages) {
      if (s.kind == "quantize") return s.tasks;
    }
    ADD_FAILURE() << "no quantize stage";
    return {};
  }

  // Runs every quantize task of the spec's plan and checks what each task must hold on its own:
  // the header (names, order, dtypes, shapes, metadata), copies byte-identical to the source,
  // TaskOutput (path, size, SHA-256) and the progress reported.
  RunResult RunAll(const JobSpec& spec, const std::map<std::string, float>* amax) {
    RunResult r;
    auto plan = BuildPlan(spec, *source_, inventory_);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok()) return r;
    r.plan = *plan;
    std::map<std::string, const LinearModule*> linears;
    for (const LinearModule& m : inventory_.linears) linears[m.name] = &m;
    std::vector<std::pair<store::TaskPlan, ShardTask>> tasks;
    for (const store::TaskPlan& tp : QuantizeTasks(*plan)) {
      auto task = ParseShardTask(tp.payload_json);
      EXPECT_TRUE(task.ok());
      std::atomic<uint64_t> progress{0};
      StageContext ctx = Context(spec, amax);
      ctx.add_progress = [&](uint64_t n) { progress += n; };
      const auto start = std::chrono::steady_clock::now();
      auto out = RunQuantizeTask(ctx, *task, step_elements_);
      r.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) return r;
      const std::string path = (fs::path(spec.output) / task->shard).string();
      EXPECT_EQ(out->path, path);
      EXPECT_EQ(out->bytes, fs::file_size(path));
      EXPECT_EQ(out->sha256, *checkpoint::Sha256File(path));
      EXPECT_EQ(progress.load(), static_cast<uint64_t>(tp.bytes_total)) << task->shard;
      EXPECT_FALSE(fs::exists(path + ".tmp"));
      tasks.emplace_back(tp, *task);
    }

    for (const auto& [tp, task] : tasks) {
      auto file = checkpoint::SafetensorsFile::Open((fs::path(spec.output) / task.shard).string());
      EXPECT_TRUE(file.ok()) << file.status();
      if (!file.ok()) return r;
      EXPECT_EQ((*file)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
      std::vector<checkpoint::TensorSpec> expected;
      for (const std::string& name : task.copy_tensors) {
        const TensorView* t = source_->Find(name);
        expected.push_back({name, t->dtype, t->shape});
      }
      for (const std::string& m : task.modules) {
        for (const OutputTensor& o :
             Nvfp4ModuleTensors(spec, m, linears.at(m)->out_features, linears.at(m)->in_features)) {
          expected.push_back({o.name, o.dtype, o.shape});
        }
      }
      for (const std::string& m : task.bf16_modules) {
        expected.push_back({m + ".weight", checkpoint::Dtype::kBF16,
                            {linears.at(m)->out_features, linears.at(m)->in_features}});
      }
      std::sort(expected.begin(), expected.end(),
                [](const auto& a, const auto& b) { return NaturalLess(a.name, b.name); });
      const auto& got = (*file)->tensors();
      EXPECT_EQ(got.size(), expected.size()) << task.shard;
      for (size_t i = 0; i < std::min(got.size(), expected.size()); ++i) {
        EXPECT_EQ(got[i].name, expected[i].name) << task.shard << " #" << i;
        EXPECT_EQ(got[i].dtype, expected[i].dtype) << got[i].name;
        EXPECT_EQ(got[i].shape, expected[i].shape) << got[i].name;
      }
      for (const std::string& name : task.copy_tensors) {
        const TensorView* src = source_->Find(name);
        const TensorView* dst = (*file)->Find(name);
        EXPECT_TRUE(dst != nullptr && src->size == dst->size &&
                    memcmp(src->data, dst->data, src->size) == 0)
            << name;
      }
      // Modules the layout cannot keep in FP8 / MXFP4: the reference decode, bit for bit.
      for (const std::string& m : task.bf16_modules) {
        const TensorView* dst = (*file)->Find(m + ".weight");
        EXPECT_TRUE(dst != nullptr && Bytes(*dst) == RefDecode(*source_, *linears.at(m)).bytes)
            << m;
        ++r.bf16_modules;
      }
      for (const TensorView& t : got) r.outputs.by_name[t.name] = &t;
      r.outputs.files.push_back(std::move(*file));
      r.tasks.push_back(task);
    }
    return r;
  }

  // Checks every NVFP4 module of a ModelOpt-format run against the reference computation.
  void CheckAgainstReference(const JobSpec& spec, const RunResult& r,
                             const std::map<std::string, float>* amax) {
    std::map<std::string, const LinearModule*> linears;
    for (const LinearModule& m : inventory_.linears) linears[m.name] = &m;
    const bool w4a4 = spec.weight_format == WeightFormat::kNvfp4;
    int lossless_modules = 0, quantized_modules = 0, filled = 0;
    for (const ShardTask& task : r.tasks) {
      std::vector<std::vector<std::string>> groups = task.fusion_groups;
      std::set<std::string> grouped;
      for (const auto& g : groups) grouped.insert(g.begin(), g.end());
      for (const std::string& m : task.modules) {
        if (grouped.count(m) == 0) groups.push_back({m});
      }
      for (const std::vector<std::string>& group : groups) {
        SCOPED_TRACE(group.front());
        bool lossless = spec.expert_cast == ExpertCast::kLossless;
        float weight_amax = 0.0f, input_amax = 0.0f;
        int kmax = -127;
        std::vector<RefDense> dense;
        for (const std::string& m : group) {
          const LinearModule& lm = *linears.at(m);
          lossless = lossless && lm.format == TensorFormat::kMxfp4;
          dense.push_back(RefDecode(*source_, lm));
          float a = 0.0f;
          ASSERT_EQ(kernels::reference::AbsMaxRows(dense.back().tensor, 0, lm.out_features, &a),
                    -1);
          weight_amax = std::max(weight_amax, a);
          if (lm.format == TensorFormat::kMxfp4) {
            kernels::Mxfp4Tensor t{source_->Find(lm.tensors[0])->data,
                                   source_->Find(lm.tensors[1])->data, lm.out_features,
                                   lm.in_features};
            uint8_t max_byte = 0;
            ASSERT_EQ(kernels::reference::Mxfp4MaxScaleRows(t, 0, t.rows, &max_byte), -1);
            kmax = std::max(kmax, max_byte - 127);
          }
          if (w4a4) {
            input_amax = std::max(input_amax, ExpectedInputAmax(m, *amax));
            filled += amax->count(m) == 0;
          }
        }
        for (size_t i = 0; i < group.size(); ++i) {
          const std::string& m = group[i];
          const LinearModule& lm = *linears.at(m);
          const TensorView& values = r.outputs.at(m + ".weight");
          const TensorView& scales = r.outputs.at(m + ".weight_scale");
          const float scale_2 = ReadF32(r.outputs.at(m + ".weight_scale_2"));
          if (w4a4) {
            EXPECT_EQ(FloatBits(ReadF32(r.outputs.at(m + ".input_scale"))),
                      FloatBits(input_amax / 2688.0f));
          } else {
            EXPECT_EQ(r.outputs.by_name.count(m + ".input_scale"), 0u);
          }
          // Fusion partners: identical weight_scale_2 and input_scale bytes.
          EXPECT_EQ(Bytes(r.outputs.at(m + ".weight_scale_2")),
                    Bytes(r.outputs.at(group.front() + ".weight_scale_2")));
          if (w4a4) {
            EXPECT_EQ(Bytes(r.outputs.at(m + ".input_scale")),
                      Bytes(r.outputs.at(group.front() + ".input_scale")));
          }
          if (lossless) {
            ++lossless_modules;
            CheckLossless(lm, values, scales, scale_2, kmax);
            continue;
          }
          ++quantized_modules;
          const float expected_scale_2 = formats::Nvfp4GlobalScale(weight_amax);
          EXPECT_EQ(FloatBits(scale_2), FloatBits(expected_scale_2));
          const size_t n = static_cast<size_t>(lm.out_features * lm.in_features);
          std::vector<uint8_t> ref_values(n / 2), ref_scales(n / 16);
          kernels::Nvfp4Out out{ref_values.data(), ref_scales.data(), nullptr};
          ASSERT_EQ(kernels::reference::Nvfp4QuantizeRows(dense[i].tensor, expected_scale_2, out, 0,
                                                          lm.out_features),
                    -1);
          EXPECT_EQ(Bytes(values), ref_values);
          EXPECT_EQ(Bytes(scales), ref_scales);
        }
      }
    }
    EXPECT_EQ(lossless_modules + quantized_modules, static_cast<int>(r.plan.recipe.modules.size()));
    if (w4a4) {
      EXPECT_GT(filled, 0);  // the fill rule was exercised
    }
    if (IsV4() && spec.expert_cast == ExpertCast::kLossless) {
      EXPECT_GT(lossless_modules, 0);
    }
  }

  // The lossless cast decodes to exactly the MXFP4 values wherever the block kept its nibbles;
  // requantized blocks have a finite, non-zero scale.
  void CheckLossless(const LinearModule& lm, const TensorView& values, const TensorView& scales,
                     float scale_2, int kmax) {
    EXPECT_EQ(FloatBits(scale_2), FloatBits(formats::Exp2Int(kmax - 8)));
    const int64_t rows = lm.out_features, cols = lm.in_features;
    std::vector<float> ours(static_cast<size_t>(rows * cols)), theirs(ours.size());
    kernels::Nvfp4Tensor nv{values.data, scales.data, scale_2, rows, cols};
    kernels::reference::Nvfp4DequantRows(nv, {ours.data(), kernels::FloatType::kF32}, 0, rows);
    const TensorView* scale_src = source_->Find(lm.tensors[1]);
    kernels::Mxfp4Tensor mx{source_->Find(lm.tensors[0])->data, scale_src->data, rows, cols};
    ASSERT_EQ(kernels::reference::Mxfp4DequantRows(mx, {theirs.data(), kernels::FloatType::kF32}, 0,
                                                   rows),
              -1);
    int64_t exact_blocks = 0;
    for (int64_t b = 0; b < rows * cols / 16; ++b) {
      const int64_t r = b * 16 / cols, c = b * 16 % cols;
      const int k = static_cast<int>(scale_src->data[r * (cols / 32) + c / 32]) - 127;
      if (k - kmax + 8 >= -9) {
        ++exact_blocks;
        for (int64_t j = b * 16; j < b * 16 + 16; ++j) {
          ASSERT_EQ(FloatBits(ours[j]), FloatBits(theirs[j])) << lm.name << " element " << j;
        }
      } else {
        EXPECT_FALSE(scales.data[b] == 0 || formats::E4m3IsNan(scales.data[b]));
      }
    }
    EXPECT_GT(exact_blocks, 0);
  }

  fs::path base_;
  std::unique_ptr<checkpoint::CheckpointDir> source_;
  int64_t step_elements_ = kQuantizeHostStepElements;  // RunAll's host_step_elements
  TensorInventory inventory_;
  std::unique_ptr<kernels::Backend> backend_;
};

TEST_P(QuantizeStageTest, OutputsMatchTheReferenceForEveryRecipeAndFormat) {
  // Steps of 512 elements: every tiny module takes several (an FP8-block one two of 128 rows),
  // so the stepwise decode, amax, quantize and statistics are checked against the whole-tensor
  // reference. The other tests run whole tiny modules in one step.
  step_elements_ = 512;
  double seconds = 0;
  for (const char* recipe : {"experts", "full"}) {
    SCOPED_TRACE(recipe);
    const std::string r = std::string(", \"recipe\": \"") + recipe + "\"";
    const JobSpec mo = Spec(std::string("mo-") + recipe, r);
    auto plan = BuildPlan(mo, *source_, inventory_);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const std::map<std::string, float> amax = AmaxTable(*plan);
    const RunResult mo_run = RunAll(mo, &amax);
    seconds += mo_run.seconds;
    CheckAgainstReference(mo, mo_run, &amax);
    // Only V4 experts keeps attention FP8 (MIXED_PRECISION); elsewhere it is written as BF16.
    if (IsV4() && std::string(recipe) == "experts") {
      EXPECT_EQ(mo_run.bf16_modules, 0);
    } else {
      EXPECT_GT(mo_run.bf16_modules, 0);
    }

    if (IsV4()) {  // MXFP4 experts decoded to BF16 and requantized instead of the lossless cast
      const JobSpec rq = Spec(std::string("rq-") + recipe, r + ", \"expert_cast\": \"requantize\"");
      const RunResult rq_run = RunAll(rq, &amax);
      seconds += rq_run.seconds;
      CheckAgainstReference(rq, rq_run, &amax);
    }

    // compressed-tensors: the same bytes, global scales stored as reciprocals.
    const JobSpec ct =
        Spec(std::string("ct-") + recipe, r + ", \"export_format\": \"compressed-tensors\"");
    const RunResult ct_run = RunAll(ct, &amax);
    seconds += ct_run.seconds;
    for (const std::string& m : mo_run.plan.recipe.modules) {
      EXPECT_EQ(Bytes(ct_run.outputs.at(m + ".weight_packed")),
                Bytes(mo_run.outputs.at(m + ".weight")));
      EXPECT_EQ(Bytes(ct_run.outputs.at(m + ".weight_scale")),
                Bytes(mo_run.outputs.at(m + ".weight_scale")));
      EXPECT_EQ(FloatBits(ReadF32(ct_run.outputs.at(m + ".weight_global_scale"))),
                FloatBits(1.0f / ReadF32(mo_run.outputs.at(m + ".weight_scale_2"))));
      EXPECT_EQ(FloatBits(ReadF32(ct_run.outputs.at(m + ".input_global_scale"))),
                FloatBits(1.0f / ReadF32(mo_run.outputs.at(m + ".input_scale"))));
    }

    // Weights only: no input scales, no amax table needed, the same weights.
    const JobSpec w4a16 =
        Spec(std::string("w4a16-") + recipe, r + ", \"weight_format\": \"w4a16_nvfp4\"");
    const RunResult w4a16_run = RunAll(w4a16, nullptr);
    seconds += w4a16_run.seconds;
    CheckAgainstReference(w4a16, w4a16_run, nullptr);
    for (const auto& [name, view] : w4a16_run.outputs.by_name) {
      EXPECT_EQ(name.find("input_scale"), std::string::npos) << name;
      EXPECT_EQ(Bytes(*view), Bytes(mo_run.outputs.at(name))) << name;
    }
  }
  std::printf("[ quantize ] %s tiny: all quantize tasks of %d runs in %.3f s\n",
              IsV4() ? "deepseek-v4" : "deepseek-v3", IsV4() ? 8 : 6, seconds);
}

TEST_P(QuantizeStageTest, ModuleWithoutAmaxFailsNamingItAndWritesNothing) {
  const JobSpec spec = Spec("out", ", \"recipe\": \"full\"");
  auto plan = BuildPlan(spec, *source_, inventory_);
  ASSERT_TRUE(plan.ok());
  std::map<std::string, float> amax = AmaxTable(*plan);
  const std::string victim = IsV4() ? "layers.1.attn.wo_b" : "model.layers.1.self_attn.o_proj";
  ASSERT_EQ(amax.erase(victim), 1u);
  for (const store::TaskPlan& tp : QuantizeTasks(*plan)) {
    auto task = ParseShardTask(tp.payload_json);
    ASSERT_TRUE(task.ok());
    if (std::find(task->modules.begin(), task->modules.end(), victim) == task->modules.end()) {
      continue;
    }
    auto out = RunQuantizeTask(Context(spec, &amax), *task);
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(out.status().message(),
              task->shard + ": module " + victim + " has no calibrated input amax");
    EXPECT_FALSE(fs::exists(base_ / "out" / task->shard));
    EXPECT_FALSE(fs::exists(base_ / "out" / (task->shard + ".tmp")));
    return;
  }
  FAIL() << victim << " is in no task";
}

TEST_P(QuantizeStageTest, CorruptScaleFailsNamingShardTensorAndElement) {
  // A copy of the source with one scale of one expert broken.
  const fs::path corrupt = base_ / "corrupt";
  fs::copy(base_ / "src", corrupt, fs::copy_options::recursive);
  const std::string module =
      IsV4() ? "layers.1.ffn.experts.3.w1" : "model.layers.1.mlp.experts.3.gate_proj";
  const std::string scale_name = IsV4() ? module + ".scale" : module + ".weight_scale_inv";
  const TensorView* scale = source_->Find(scale_name);
  ASSERT_NE(scale, nullptr);
  // V4: E8M0 [128, 8], byte (5, 2) -> NaN; it covers elements from [5, 64].
  // V3: F32 [2, 3], the top byte of block (1, 2) -> negative or NaN; it covers [128, 256].
  const uint64_t at = scale->offset + (IsV4() ? 5 * 8 + 2 : (1 * 3 + 2) * 4 + 3);
  const std::string shard = fs::path(source_->ShardOf(scale_name)->path()).filename().string();
  {
    std::fstream f(corrupt / shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at));
    f.put(static_cast<char>(0xFF));
  }
  OpenSource(corrupt);

  const JobSpec spec = Spec("out", "");
  auto plan = BuildPlan(spec, *source_, inventory_);
  ASSERT_TRUE(plan.ok());
  const std::map<std::string, float> amax = AmaxTable(*plan);
  for (const store::TaskPlan& tp : QuantizeTasks(*plan)) {
    auto task = ParseShardTask(tp.payload_json);
    ASSERT_TRUE(task.ok());
    if (std::find(task->modules.begin(), task->modules.end(), module) == task->modules.end()) {
      continue;
    }
    // One step per module, then steps of 512 elements (the broken row in a later step), and for
    // V4 the MXFP4 experts also decoded and requantized (stepwise) rather than cast: the error
    // names the element by its row in the tensor every way.
    std::vector<JobSpec> specs = {spec};
    if (IsV4()) specs.push_back(Spec("out", ", \"expert_cast\": \"requantize\""));
    for (const JobSpec& run_spec : specs) {
      const bool cast = run_spec.expert_cast == ExpertCast::kLossless;
      for (const int64_t step : {kQuantizeHostStepElements, int64_t{512}}) {
        SCOPED_TRACE(absl::StrCat(cast ? "cast" : "requantize", " step ", step));
        auto out = RunQuantizeTask(Context(run_spec, &amax), *task, step);
        ASSERT_FALSE(out.ok());
        EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(out.status().message(),
                  shard + ": tensor " + module + ".weight: " +
                      (IsV4() ? "NaN E8M0 scale at [5, 64]"
                              : "non-finite or non-positive F32 scale at [128, 256]"));
        EXPECT_FALSE(fs::exists(base_ / "out" / task->shard));
        EXPECT_FALSE(fs::exists(base_ / "out" / (task->shard + ".tmp")));
      }
    }
    return;
  }
  FAIL() << module << " is in no task";
}

TEST_P(QuantizeStageTest, CancellationBetweenTensorsLeavesNoFile) {
  const JobSpec spec = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"");
  auto plan = BuildPlan(spec, *source_, inventory_);
  ASSERT_TRUE(plan.ok());
  auto task = ParseShardTask(QuantizeTasks(*plan).front().payload_json);
  ASSERT_TRUE(task.ok());
  std::atomic<bool> cancelled{false};
  int calls = 0;
  StageContext ctx = Context(spec, nullptr);
  ctx.cancelled = &cancelled;
  ctx.add_progress = [&](uint64_t) {
    ++calls;
    cancelled = true;  // cancel once the first tensor is written
  };
  auto out = RunQuantizeTask(ctx, *task);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(fs::exists(base_ / "out" / task->shard));
  EXPECT_FALSE(fs::exists(base_ / "out" / (task->shard + ".tmp")));
}

TEST_P(QuantizeStageTest, CudaBackendWritesTheSameBytes) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto cuda = kernels::MakeCudaBackend(0);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  for (const char* extra : {"", ", \"recipe\": \"full\", \"expert_cast\": \"requantize\""}) {
    const JobSpec cpu_spec = Spec("cpu", extra), cuda_spec = Spec("cuda", extra);
    auto plan = BuildPlan(cpu_spec, *source_, inventory_);
    ASSERT_TRUE(plan.ok());
    const std::map<std::string, float> amax = AmaxTable(*plan);
    for (const store::TaskPlan& tp : QuantizeTasks(*plan)) {
      auto task = ParseShardTask(tp.payload_json);
      ASSERT_TRUE(task.ok());
      auto on_cpu = RunQuantizeTask(Context(cpu_spec, &amax), *task);
      StageContext ctx = Context(cuda_spec, &amax);
      ctx.backend = cuda->get();
      auto on_cuda = RunQuantizeTask(ctx, *task);
      ASSERT_TRUE(on_cpu.ok() && on_cuda.ok()) << on_cpu.status() << on_cuda.status();
      EXPECT_EQ(on_cuda->sha256, on_cpu->sha256) << task->shard << extra;
    }
    fs::remove_all(base_ / "cpu");
    fs::remove_all(base_ / "cuda");
  }
}

// A `full` job planned with recipe revision 1 (an earlier release: wo_a quantized) resumes with
// that revision and the same quantize tasks; a current plan, an `experts` job and a V3 job keep
// the current revision.
TEST_P(QuantizeStageTest, AdaptSpecKeepsTheRecipeRevisionOfTheStoredPlan) {
  const QuantizeStage stage;
  const auto stored_rows = [&](const JobSpec& spec) {
    auto plan = BuildPlan(spec, *source_, inventory_);
    EXPECT_TRUE(plan.ok()) << plan.status();
    std::vector<store::TaskRow> rows;
    for (const store::StagePlan& s : plan->stages) {
      for (const store::TaskPlan& t : s.tasks) {
        store::TaskRow row;
        row.stage_kind = s.kind;
        row.name = t.name;
        row.payload_json = t.payload_json;
        rows.push_back(std::move(row));
      }
    }
    return rows;
  };
  const auto quantized = [&](const std::vector<store::TaskRow>& rows) {
    std::vector<std::string> modules;
    for (const store::TaskRow& row : rows) {
      if (row.stage_kind != QuantizeStage::kKind) continue;
      auto task = ParseShardTask(row.payload_json);
      EXPECT_TRUE(task.ok()) << task.status();
      modules.insert(modules.end(), task->modules.begin(), task->modules.end());
    }
    return modules;
  };
  const auto wo_a = [](const std::vector<std::string>& modules) {
    return std::count_if(modules.begin(), modules.end(), [](const std::string& m) {
      return absl::EndsWith(m, ".attn.wo_a");
    });
  };

  JobSpec old_full = Spec("out", ", \"recipe\": \"full\"");
  old_full.recipe_revision = 1;
  const std::vector<store::TaskRow> old_rows = stored_rows(old_full);
  EXPECT_EQ(wo_a(quantized(old_rows)), IsV4() ? 3 : 0);

  JobSpec resumed = Spec("out", ", \"recipe\": \"full\"");
  ASSERT_EQ(resumed.recipe_revision, job::kRecipeRevision);
  stage.AdaptSpec(old_rows, resumed);
  EXPECT_EQ(resumed.recipe_revision, IsV4() ? 1 : job::kRecipeRevision);
  EXPECT_EQ(quantized(stored_rows(resumed)), quantized(old_rows));

  JobSpec current = Spec("out", ", \"recipe\": \"full\"");
  const std::vector<store::TaskRow> current_rows = stored_rows(current);
  EXPECT_EQ(wo_a(quantized(current_rows)), 0);
  stage.AdaptSpec(current_rows, current);
  EXPECT_EQ(current.recipe_revision, job::kRecipeRevision);

  // Only `full` has revisions; a payload that does not parse changes nothing.
  JobSpec experts = Spec("out", "");
  stage.AdaptSpec(old_rows, experts);
  EXPECT_EQ(experts.recipe_revision, job::kRecipeRevision);
  store::TaskRow broken;
  broken.stage_kind = std::string(QuantizeStage::kKind);
  broken.payload_json = "{";
  JobSpec full = Spec("out", ", \"recipe\": \"full\"");
  stage.AdaptSpec({broken}, full);
  EXPECT_EQ(full.recipe_revision, job::kRecipeRevision);
}

INSTANTIATE_TEST_SUITE_P(Arches, QuantizeStageTest,
                         testing::Values(fixture::Arch::kDeepseekV4, fixture::Arch::kDeepseekV3),
                         [](const testing::TestParamInfo<fixture::Arch>& info) {
                           return info.param == fixture::Arch::kDeepseekV4 ? "V4" : "V3";
                         });

// F32 and BF16 sources are quantized from their own values (no decode): a hand-made checkpoint
// with one linear of each, selected by globs.
TEST(QuantizeStageDenseSourceTest, F32AndBf16WeightsQuantizeFromTheirOwnValues) {
  const fs::path base =
      fs::temp_directory_path() / ("quantd_quantize_dense_" + std::to_string(getpid()));
  fs::remove_all(base);
  fs::create_directories(base / "src");
  const int64_t rows = 24, cols = 64;
  std::vector<float> f32(rows * cols);
  std::vector<uint16_t> bf16(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    // Values over several binades, some exact E2M1 multiples, one all-zero 16-block.
    f32[i] = (i / 16 == 5) ? 0.0f : static_cast<float>((i * 37) % 101 - 50) * 0.013f * (1 + i % 7);
    bf16[i] = formats::FloatToBf16(f32[i] * 3.0f);
  }
  {
    auto w = checkpoint::SafetensorsWriter::Create(
        (base / "src" / "model.safetensors").string(),
        {{"a.proj.weight", checkpoint::Dtype::kF32, {rows, cols}},
         {"b.proj.weight", checkpoint::Dtype::kBF16, {rows, cols}}});
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*w)->WriteTensor("a.proj.weight", f32.data(), f32.size() * 4).ok());
    ASSERT_TRUE((*w)->WriteTensor("b.proj.weight", bf16.data(), bf16.size() * 2).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  auto source = checkpoint::CheckpointDir::Open((base / "src").string());
  ASSERT_TRUE(source.ok()) << source.status();
  auto inventory = BuildInventory(**source);
  ASSERT_TRUE(inventory.ok()) << inventory.status();
  auto spec = ParseJobSpec("{\"source\": \"" + (base / "src").string() + "\", \"output\": \"" +
                               (base / "out").string() + "\", \"include\": [\"*.proj\"]}",
                           "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto plan = BuildPlan(*spec, **source, *inventory);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto backend = kernels::MakeCpuBackend({2, kernels::SimdLevel::kAuto});
  ASSERT_TRUE(backend.ok());
  const std::map<std::string, float> amax = {{"a.proj", 3.0f}, {"b.proj", 5.0f}};
  StageContext ctx;
  ctx.spec = &*spec;
  ctx.source = source->get();
  ctx.inventory = &*inventory;
  ctx.backend = backend->get();
  ctx.input_amax = &amax;
  testing_util::OpenStageDirs(&ctx);
  ASSERT_EQ(plan->stages[1].kind, "quantize");
  ASSERT_EQ(plan->stages[1].tasks.size(), 1u);
  auto task = ParseShardTask(plan->stages[1].tasks[0].payload_json);
  ASSERT_TRUE(task.ok());
  auto out = RunQuantizeTask(ctx, *task);
  ASSERT_TRUE(out.ok()) << out.status();
  auto file = checkpoint::SafetensorsFile::Open(out->path);
  ASSERT_TRUE(file.ok());

  struct Case {
    std::string module;
    kernels::DenseTensor src;
    float input_amax;
  };
  for (const Case& c :
       {Case{"a.proj", {f32.data(), kernels::FloatType::kF32, rows, cols}, 3.0f},
        Case{"b.proj", {bf16.data(), kernels::FloatType::kBF16, rows, cols}, 5.0f}}) {
    SCOPED_TRACE(c.module);
    float amax_w = 0;
    ASSERT_EQ(kernels::reference::AbsMaxRows(c.src, 0, rows, &amax_w), -1);
    const float scale_2 = formats::Nvfp4GlobalScale(amax_w);
    std::vector<uint8_t> values(rows * cols / 2), scales(rows * cols / 16);
    ASSERT_EQ(kernels::reference::Nvfp4QuantizeRows(
                  c.src, scale_2, {values.data(), scales.data(), nullptr}, 0, rows),
              -1);
    EXPECT_EQ(Bytes(*(*file)->Find(c.module + ".weight")), values);
    EXPECT_EQ(Bytes(*(*file)->Find(c.module + ".weight_scale")), scales);
    EXPECT_EQ(FloatBits(ReadF32(*(*file)->Find(c.module + ".weight_scale_2"))), FloatBits(scale_2));
    EXPECT_EQ(FloatBits(ReadF32(*(*file)->Find(c.module + ".input_scale"))),
              FloatBits(c.input_amax / 2688.0f));
  }
  fs::remove_all(base);
}

}  // namespace
}  // namespace quantd::pipeline
