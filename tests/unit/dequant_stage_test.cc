// The dequant stage on the tiny V4 and V3 fixtures: every BF16 tensor equals the reference
// decode (kernels/reference.h) bit for bit, scale tensors are gone, everything else is copied.
#include "server/pipeline/stages/dequant_stage.h"

#include <gtest/gtest.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>

#include "kernels/backends.h"
#include "kernels/reference.h"
#include "server/checkpoint/safetensors_reader.h"
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
using checkpoint::TensorInfo;
using checkpoint::TensorInventory;

using job::JobSpec;
using job::ParseJobSpec;

namespace {

namespace fs = std::filesystem;
using checkpoint::TensorView;

class DequantStageTest : public testing::TestWithParam<fixture::Arch> {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("quantd_dequant_test_" + std::to_string(getpid()) + "_" +
                                         std::to_string(static_cast<int>(GetParam())));
    fs::remove_all(base_);
    auto summary = fixture::WriteFixture(fixture::MakeConfig(GetParam(), fixture::Preset::kTiny),
                                         11, (base_ / "src").string(), {});
    ASSERT_TRUE(summary.ok()) << summary.status();
    OpenSource(base_ / "src");
    auto backend = kernels::MakeCpuBackend({2, kernels::SimdLevel::kAuto});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
    auto spec = ParseJobSpec("{\"source\": \"" + (base_ / "src").string() + "\", \"output\": \"" +
                                 (base_ / "out").string() + "\", \"materialize_bf16\": \"" +
                                 (base_ / "bf16").string() + "\"}",
                             "test");
    ASSERT_TRUE(spec.ok()) << spec.status();
    spec_ = *spec;
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

  StageContext Context() {
    StageContext ctx;
    ctx.spec = &spec_;
    ctx.source = source_.get();
    ctx.inventory = &inventory_;
    ctx.backend = backend_.get();
    testing_util::OpenStageDirs(&ctx);
    return ctx;
  }

  std::vector<store::TaskPlan> DequantTasks() {
    auto plan = BuildPlan(spec_, *source_, inventory_);
    EXPECT_TRUE(plan.ok()) << plan.status();
    for (const store::StagePlan& s : plan->stages) {
      if (s.kind == "dequant") return s.tasks;
    }
    ADD_FAILURE() << "no dequant stage";
    return {};
  }

  fs::path base_;
  JobSpec spec_;
  std::unique_ptr<checkpoint::CheckpointDir> source_;
  TensorInventory inventory_;
  std::unique_ptr<kernels::Backend> backend_;
};

TEST_P(DequantStageTest, EveryWeightEqualsTheReferenceDecodeAndScalesAreDropped) {
  std::map<std::string, const TensorInfo*> infos;
  for (const TensorInfo& t : inventory_.tensors) infos[t.name] = &t;
  std::map<std::string, const LinearModule*> linears;
  for (const LinearModule& m : inventory_.linears) linears[m.name] = &m;
  int decoded = 0, copied = 0, dropped = 0;
  for (const store::TaskPlan& tp : DequantTasks()) {
    auto task = ParseDequantTask(tp.payload_json);
    ASSERT_TRUE(task.ok());
    std::atomic<uint64_t> progress{0};
    StageContext ctx = Context();
    ctx.add_progress = [&](uint64_t n) { progress += n; };
    auto out = RunDequantTask(ctx, *task);
    ASSERT_TRUE(out.ok()) << out.status();
    const std::string path = (base_ / "bf16" / task->shard).string();
    EXPECT_EQ(out->path, path);
    EXPECT_EQ(out->bytes, fs::file_size(path));
    EXPECT_EQ(out->sha256, *checkpoint::Sha256File(path));
    EXPECT_EQ(progress.load(), static_cast<uint64_t>(tp.bytes_total));

    auto file = checkpoint::SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ((*file)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
    // The output holds exactly the source shard's non-scale tensors, in natural order.
    std::vector<std::string> expected;
    const checkpoint::SafetensorsFile* src_file = source_->ShardOf(
        (*file)->tensors().empty() ? std::string() : (*file)->tensors().front().name);
    ASSERT_NE(src_file, nullptr);
    for (const TensorView& t : src_file->tensors()) {
      if (infos.at(t.name)->format == TensorFormat::kScale && !infos.at(t.name)->owner.empty()) {
        ++dropped;
        continue;
      }
      expected.push_back(t.name);
    }
    std::sort(expected.begin(), expected.end(),
              [](const std::string& a, const std::string& b) { return NaturalLess(a, b); });
    std::vector<std::string> got;
    for (const TensorView& t : (*file)->tensors()) got.push_back(t.name);
    EXPECT_EQ(got, expected) << task->shard;

    for (const TensorView& t : (*file)->tensors()) {
      const TensorInfo& info = *infos.at(t.name);
      const TensorView& src = *source_->Find(t.name);
      if (info.format != TensorFormat::kFp8BlockE8m0 && info.format != TensorFormat::kFp8BlockF32 &&
          info.format != TensorFormat::kMxfp4) {
        ++copied;
        EXPECT_EQ(t.dtype, src.dtype);
        EXPECT_EQ(t.shape, src.shape);
        EXPECT_TRUE(t.size == src.size && memcmp(t.data, src.data, t.size) == 0) << t.name;
        continue;
      }
      ++decoded;
      const LinearModule& m = *linears.at(info.module);
      EXPECT_EQ(t.dtype, checkpoint::Dtype::kBF16);
      EXPECT_EQ(t.shape, (std::vector<int64_t>{m.out_features, m.in_features}));
      const TensorView& scale = *source_->Find(m.tensors[1]);
      std::vector<uint16_t> ref(static_cast<size_t>(m.out_features * m.in_features));
      const kernels::DenseOut dst{ref.data(), kernels::FloatType::kBF16};
      if (info.format == TensorFormat::kMxfp4) {
        kernels::Mxfp4Tensor mx{src.data, scale.data, m.out_features, m.in_features};
        ASSERT_EQ(kernels::reference::Mxfp4DequantRows(mx, dst, 0, mx.rows), -1);
      } else {
        kernels::Fp8BlockTensor fp8{src.data, scale.data,
                                    info.format == TensorFormat::kFp8BlockE8m0
                                        ? kernels::Fp8ScaleType::kE8M0
                                        : kernels::Fp8ScaleType::kF32,
                                    m.out_features, m.in_features};
        ASSERT_EQ(kernels::reference::Fp8BlockDequantRows(fp8, dst, 0, fp8.rows), -1);
      }
      ASSERT_EQ(t.size, ref.size() * 2);
      EXPECT_EQ(memcmp(t.data, ref.data(), t.size), 0) << t.name;
    }
  }
  EXPECT_GT(decoded, 0);
  EXPECT_GT(copied, 0);
  EXPECT_EQ(dropped, decoded);  // one scale tensor per decoded weight
}

TEST_P(DequantStageTest, CorruptScaleFailsNamingShardTensorAndElement) {
  const fs::path corrupt = base_ / "corrupt";
  fs::copy(base_ / "src", corrupt, fs::copy_options::recursive);
  // An FP8 attention weight: V4 E8M0 scale [2, 2] of wo_a, V3 F32 scale [3, 2] of o_proj.
  const std::string weight = GetParam() == fixture::Arch::kDeepseekV4
                                 ? "layers.1.attn.wo_a.weight"
                                 : "model.layers.1.self_attn.o_proj.weight";
  const std::string scale_name = GetParam() == fixture::Arch::kDeepseekV4
                                     ? "layers.1.attn.wo_a.scale"
                                     : "model.layers.1.self_attn.o_proj.weight_scale_inv";
  const TensorView* scale = source_->Find(scale_name);
  ASSERT_NE(scale, nullptr);
  // Block (1, 0): V4 byte 2 -> 0xFF (NaN); V3 the top byte of float 2 -> negative or NaN.
  const uint64_t at = scale->offset + (GetParam() == fixture::Arch::kDeepseekV4 ? 2 : 2 * 4 + 3);
  const std::string shard = fs::path(source_->ShardOf(weight)->path()).filename().string();
  {
    std::fstream f(corrupt / shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at));
    f.put(static_cast<char>(0xFF));
  }
  OpenSource(corrupt);
  auto out = RunDequantTask(Context(), DequantTask{shard});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(), shard + ": tensor " + weight + ": " +
                                        (GetParam() == fixture::Arch::kDeepseekV4
                                             ? "NaN E8M0 scale at [128, 0]"
                                             : "non-finite or non-positive F32 scale at [128, 0]"));
  EXPECT_FALSE(fs::exists(base_ / "bf16" / shard));
  EXPECT_FALSE(fs::exists(base_ / "bf16" / (shard + ".tmp")));
}

TEST_P(DequantStageTest, UnknownShardIsRejected) {
  auto out = RunDequantTask(Context(), DequantTask{"model-00009-of-00009.safetensors"});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("model-00009-of-00009.safetensors"), std::string::npos);
}

TEST_P(DequantStageTest, CudaBackendWritesTheSameBytes) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto cuda = kernels::MakeCudaBackend(0);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  for (const store::TaskPlan& tp : DequantTasks()) {
    auto task = ParseDequantTask(tp.payload_json);
    ASSERT_TRUE(task.ok());
    auto on_cpu = RunDequantTask(Context(), *task);
    StageContext ctx = Context();
    ctx.backend = cuda->get();
    fs::remove(base_ / "bf16" / task->shard);
    auto on_cuda = RunDequantTask(ctx, *task);
    ASSERT_TRUE(on_cpu.ok() && on_cuda.ok()) << on_cpu.status() << on_cuda.status();
    EXPECT_EQ(on_cuda->sha256, on_cpu->sha256) << task->shard;
  }
}

INSTANTIATE_TEST_SUITE_P(Arches, DequantStageTest,
                         testing::Values(fixture::Arch::kDeepseekV4, fixture::Arch::kDeepseekV3),
                         [](const testing::TestParamInfo<fixture::Arch>& info) {
                           return info.param == fixture::Arch::kDeepseekV4 ? "V4" : "V3";
                         });

}  // namespace
}  // namespace quantd::pipeline
