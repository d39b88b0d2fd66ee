// Export on the tiny V4 and V3 fixtures with hand-written output shards (the planned tensors with
// the planned dtypes and shapes; export reads only their headers): the index, config.json's
// quantization_config and hf_quant_config.json exactly, for each layout and KV-cache setting;
// the source's other files copied byte for byte; a rerun writes the same bytes.
#include "server/pipeline/stages/export_stage.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "nlohmann/json.hpp"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/checkpoint/sha256.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/fixture/fixture.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stages/output_manifest.h"
#include "tests/unit/stage_dirs.h"

namespace quantd::pipeline {

using checkpoint::BuildInventory;
using checkpoint::LinearModule;
using checkpoint::TensorInventory;

using job::JobSpec;
using job::ParseJobSpec;

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using nlohmann::ordered_json;

std::string Read(const std::string& path) {
  absl::StatusOr<std::string> text = checkpoint::ReadFile(path, 64 << 20);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? *text : "";
}

class ExportStageTest : public testing::Test {
 protected:
  void SetUp() override {
    const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
    root_ = (fs::path(testing::TempDir()) /
             (std::string("export_stage_test_") + info->name() + "_" + std::to_string(getpid())))
                .string();
    fs::remove_all(root_);
    src_ = root_ + "/src";
    out_ = root_ + "/out";
  }
  void TearDown() override { fs::remove_all(root_); }

  // The fixture, plus files a Hugging Face repository carries next to the weights.
  void MakeSource(fixture::Arch arch) {
    auto summary = fixture::WriteFixture(fixture::MakeConfig(arch, fixture::Preset::kTiny), 7,
                                         src_, {});
    ASSERT_TRUE(summary.ok()) << summary.status();
    WriteFile(src_ + "/tokenizer.json", "{\"model\": {\"type\": \"BPE\"}}\n");
    WriteFile(src_ + "/tokenizer_config.json", "{\"bos_token\": \"<s>\"}");
    fs::create_directories(src_ + "/inference");
    WriteFile(src_ + "/inference/model.py", "import torch\n");
    fs::create_directories(src_ + "/.cache/huggingface");
    WriteFile(src_ + "/.cache/huggingface/model-00001-of-00004.safetensors.lock", "");
    // A symlink out of the source (a Hugging Face cache blob, or a file the caller could not read)
    // is never followed; one that stays inside the source is.
    WriteFile(root_ + "/blob", "MIT License\n");
    fs::create_symlink(root_ + "/blob", src_ + "/LICENSE");
    fs::create_symlink(src_ + "/inference", src_ + "/linked_dir");
    fs::create_symlink("tokenizer.json", src_ + "/tokenizer_alias.json");

    auto source = checkpoint::CheckpointDir::Open(src_);
    ASSERT_TRUE(source.ok()) << source.status();
    source_ = std::move(*source);
    auto inventory = BuildInventory(*source_);
    ASSERT_TRUE(inventory.ok()) << inventory.status();
    inventory_ = std::move(*inventory);
  }

  void WriteFile(const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::binary) << text;
  }

  // Plans the job and writes its output shards: copied tensors with their source bytes, NVFP4
  // tensors zero-filled. Returns the expected index.
  json PlanAndWriteShards(const std::string& extra_spec) {
    auto spec = ParseJobSpec(
        "{\"source\": \"" + src_ + "\", \"output\": \"" + out_ + "\"" + extra_spec + "}", "test");
    EXPECT_TRUE(spec.ok()) << spec.status();
    spec_ = *spec;
    auto plan = BuildPlan(spec_, *source_, inventory_);
    EXPECT_TRUE(plan.ok()) << plan.status();
    plan_ = *plan;
    fs::create_directories(out_);
    std::map<std::string, const LinearModule*> linears;
    for (const LinearModule& m : inventory_.linears) linears[m.name] = &m;
    json weight_map = json::object();
    uint64_t total = 0;
    for (const store::StagePlan& stage : plan_.stages) {
      if (stage.kind != "quantize") continue;
      for (const store::TaskPlan& t : stage.tasks) {
        auto task = ParseShardTask(t.payload_json);
        EXPECT_TRUE(task.ok());
        std::vector<checkpoint::TensorSpec> specs;
        std::vector<std::string> data;
        for (const std::string& name : task->copy_tensors) {
          const checkpoint::TensorView* v = source_->Find(name);
          specs.push_back({name, v->dtype, v->shape});
          data.emplace_back(reinterpret_cast<const char*>(v->data), v->size);
        }
        for (const std::string& m : task->modules) {
          for (const OutputTensor& o : Nvfp4ModuleTensors(spec_, m, linears.at(m)->out_features,
                                                          linears.at(m)->in_features)) {
            specs.push_back({o.name, o.dtype, o.shape});
            data.emplace_back(specs.back().bytes(), '\0');
          }
        }
        auto w = checkpoint::SafetensorsWriter::Create(out_ + "/" + task->shard, specs);
        EXPECT_TRUE(w.ok()) << w.status();
        for (size_t i = 0; i < specs.size(); ++i) {
          EXPECT_TRUE((*w)->WriteTensor(specs[i].name, data[i].data(), data[i].size()).ok());
          weight_map[specs[i].name] = task->shard;
          total += data[i].size();
        }
        EXPECT_TRUE((*w)->Finish().ok());
        recorded_[task->shard] = {out_ + "/" + task->shard,
                                  static_cast<int64_t>((*w)->total_bytes()), (*w)->sha256()};
      }
    }
    return {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  }

  absl::StatusOr<TaskOutput> Export() {
    StageContext ctx;
    ctx.spec = &spec_;
    ctx.source = source_.get();
    ctx.inventory = &inventory_;
    testing_util::OpenStageDirs(&ctx);
    ctx.add_progress = [this](uint64_t bytes) {
      ++heartbeats_;
      progress_bytes_ += bytes;
    };
    ctx.recorded_output = [this](std::string_view kind,
                                 const std::string& name) -> std::optional<RecordedOutput> {
      auto it = recorded_.find(name);
      if (kind != "quantize" || it == recorded_.end()) return std::nullopt;
      return it->second;
    };
    return RunExportTask(ctx, plan_);
  }

  // The source's config.json with quantization_config replaced.
  json ConfigWith(const json& quantization_config) {
    json config = json::parse(Read(src_ + "/config.json"));
    config["quantization_config"] = quantization_config;
    return config;
  }

  std::string root_, src_, out_;
  std::unique_ptr<checkpoint::CheckpointDir> source_;
  TensorInventory inventory_;
  JobSpec spec_;
  Plan plan_;
  std::map<std::string, RecordedOutput> recorded_;  // by shard: what "quantize" recorded
  int heartbeats_ = 0;           // add_progress calls of the exports
  uint64_t progress_bytes_ = 0;  // bytes they reported
};

const json kW4A4Group = {
    {"group_0",
     {{"input_activations",
       {{"dynamic", false}, {"num_bits", 4}, {"type", "float"}, {"group_size", 16}}},
      {"weights", {{"dynamic", false}, {"num_bits", 4}, {"type", "float"}, {"group_size", 16}}},
      {"targets", {"Linear"}}}}};

TEST_F(ExportStageTest, V4ExpertsMirrorsNvidiaPublishedLayout) {
  MakeSource(fixture::Arch::kDeepseekV4);
  const json index = PlanAndWriteShards("");
  const std::string shard_bytes = Read(out_ + "/model-00001-of-00004.safetensors");
  absl::StatusOr<TaskOutput> first = Export();
  ASSERT_TRUE(first.ok()) << first.status();

  EXPECT_EQ(json::parse(Read(out_ + "/model.safetensors.index.json")), index);
  EXPECT_TRUE(index["weight_map"].contains("layers.2.ffn.experts.7.w3.input_scale"));
  EXPECT_FALSE(index["weight_map"].contains("layers.2.ffn.experts.7.w3.scale"));

  const ordered_json layer = {{"quant_algo", "NVFP4"}, {"group_size", 16}};
  const ordered_json layers = {{"layers.0.ffn.experts", layer},
                               {"layers.1.ffn.experts", layer},
                               {"layers.2.ffn.experts", layer}};
  const ordered_json excludes = {"*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"};
  const ordered_json hf = {{"producer", {{"name", "quantd"}}},
                           {"quantization",
                            {{"quant_algo", "MIXED_PRECISION"},
                             {"kv_cache_quant_algo", nullptr},
                             {"group_size", 16},
                             {"quantized_layers", layers},
                             {"exclude_modules", excludes}}}};
  EXPECT_EQ(Read(out_ + "/hf_quant_config.json"), hf.dump(2) + "\n");

  const json qc = {{"activation_scheme", "dynamic"},
                   {"fmt", "e4m3"},
                   {"quant_method", "fp8"},
                   {"scale_fmt", "ue8m0"},
                   {"weight_block_size", {128, 128}},
                   {"moe_quant_algo", "NVFP4"},
                   {"quant_algo", "MIXED_PRECISION"},
                   {"kv_cache_quant_algo", nullptr},
                   {"group_size", 16},
                   {"config_groups", kW4A4Group},
                   {"quantized_layers", json(layers)},
                   {"exclude_modules", json(excludes)},
                   {"ignore", json(excludes)},
                   {"producer", {{"name", "quantd"}}}};
  EXPECT_EQ(Read(out_ + "/config.json"), ConfigWith(qc).dump(2) + "\n");

  // Other regular files inside the source copied byte for byte (a symlink to one of them as a
  // copy); weights, caches, configs and anything reached through a symlink out of the source or
  // a symlinked directory are not.
  for (const char* name : {"generation_config.json", "tokenizer.json", "tokenizer_config.json",
                           "inference/model.py", "tokenizer_alias.json"}) {
    EXPECT_EQ(Read(out_ + "/" + name), Read(src_ + "/" + name)) << name;
  }
  EXPECT_FALSE(fs::is_symlink(out_ + "/tokenizer_alias.json"));
  EXPECT_FALSE(fs::exists(out_ + "/LICENSE"));
  EXPECT_FALSE(fs::exists(out_ + "/linked_dir"));
  EXPECT_FALSE(fs::exists(out_ + "/.cache"));
  EXPECT_EQ(Read(out_ + "/model-00001-of-00004.safetensors"), shard_bytes);
  std::vector<std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(out_)) {
    if (e.is_regular_file()) files.push_back(fs::relative(e.path(), out_).string());
  }
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{
                       "config.json", "generation_config.json", "hf_quant_config.json",
                       "inference/model.py", "model-00001-of-00004.safetensors",
                       "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors",
                       "model-00004-of-00004.safetensors", "model.safetensors.index.json",
                       "quantd_manifest.json",
                       "tokenizer.json", "tokenizer_alias.json", "tokenizer_config.json"}));

  // The task's output: the directory, the bytes of the files it wrote, a digest over them.
  uint64_t written = 0;
  for (const std::string& f : files) {
    if (f.find(".safetensors") == std::string::npos || f == "model.safetensors.index.json") {
      written += fs::file_size(out_ + "/" + f);
    }
  }
  EXPECT_EQ(first->path, out_);
  EXPECT_EQ(first->bytes, written);
  EXPECT_EQ(first->sha256.size(), 64u);
  // A rerun (an interrupted export redone) writes the same bytes.
  const std::string config_before = Read(out_ + "/config.json");
  absl::StatusOr<TaskOutput> second = Export();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->sha256, first->sha256);
  EXPECT_EQ(second->bytes, first->bytes);
  EXPECT_EQ(Read(out_ + "/config.json"), config_before);
}

TEST_F(ExportStageTest, V4FullWithFp8CastKvCache) {
  MakeSource(fixture::Arch::kDeepseekV4);
  const json index = PlanAndWriteShards(", \"recipe\": \"full\", \"kv_cache\": \"fp8_cast\"");
  absl::StatusOr<TaskOutput> out = Export();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(json::parse(Read(out_ + "/model.safetensors.index.json")), index);

  // Every linear left in its source format is covered by the recipe's exclusions.
  const ordered_json excludes = {"mtp.*", "embed", "head", "*.ffn.gate", "*.attn.compressor.*",
                                 "*.attn.indexer.*", "*.attn.wo_a"};
  const ordered_json hf = {{"producer", {{"name", "quantd"}}},
                           {"quantization",
                            {{"quant_algo", "NVFP4"},
                             {"kv_cache_quant_algo", "FP8"},
                             {"group_size", 16},
                             {"exclude_modules", excludes}}}};
  EXPECT_EQ(Read(out_ + "/hf_quant_config.json"), hf.dump(2) + "\n");
  const json qc = {{"config_groups", kW4A4Group},
                   {"ignore", json(excludes)},
                   {"quant_algo", "NVFP4"},
                   {"kv_cache_scheme", {{"dynamic", false}, {"num_bits", 8}, {"type", "float"}}},
                   {"producer", {{"name", "quantd"}}},
                   {"quant_method", "modelopt"}};
  EXPECT_EQ(Read(out_ + "/config.json"), ConfigWith(qc).dump(2) + "\n");
}

TEST_F(ExportStageTest, V4FullWeightsOnlyCompressedTensors) {
  MakeSource(fixture::Arch::kDeepseekV4);
  PlanAndWriteShards(
      ", \"recipe\": \"full\", \"weight_format\": \"w4a16_nvfp4\", "
      "\"export_format\": \"compressed-tensors\"");
  WriteFile(out_ + "/hf_quant_config.json", "{}");  // left by an earlier ModelOpt export
  absl::StatusOr<TaskOutput> out = Export();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(fs::exists(out_ + "/hf_quant_config.json"));
  const json weights = {{"num_bits", 4},    {"type", "float"},   {"strategy", "tensor_group"},
                        {"group_size", 16}, {"symmetric", true}, {"dynamic", false},
                        {"observer", "static_minmax"}};
  const json qc = {
      {"quant_method", "compressed-tensors"},
      {"format", "nvfp4-pack-quantized"},
      {"quantization_status", "compressed"},
      {"config_groups",
       {{"group_0",
         {{"format", "nvfp4-pack-quantized"}, {"targets", {"Linear"}}, {"weights", weights}}}}},
      {"ignore",
       {"re:mtp\\..*$", "embed", "head", "re:.*\\.ffn\\.gate$", "re:.*\\.attn\\.compressor\\..*$",
        "re:.*\\.attn\\.indexer\\..*$", "re:.*\\.attn\\.wo_a$"}},
      {"kv_cache_scheme", nullptr}};
  EXPECT_EQ(Read(out_ + "/config.json"), ConfigWith(qc).dump(2) + "\n");
}

TEST_F(ExportStageTest, V3ExpertsSummarizesUnselectedModules) {
  MakeSource(fixture::Arch::kDeepseekV3);
  PlanAndWriteShards(", \"weight_format\": \"w4a16_nvfp4\"");
  absl::StatusOr<TaskOutput> out = Export();
  ASSERT_TRUE(out.ok()) << out.status();
  // The recipe's exclusions, then the dense MLP of layer 0, the routers and the embedding, each
  // as a layer pattern that matches no routed expert.
  const ordered_json excludes = {"model.layers.3.*",
                                 "*.self_attn.*",
                                 "*.mlp.shared_experts.*",
                                 "lm_head",
                                 "model.embed_tokens",
                                 "model.layers.*.mlp.down_proj",
                                 "model.layers.*.mlp.gate_proj",
                                 "model.layers.*.mlp.up_proj",
                                 "model.layers.*.mlp.gate"};
  const ordered_json hf = {{"producer", {{"name", "quantd"}}},
                           {"quantization",
                            {{"quant_algo", "W4A16_NVFP4"},
                             {"kv_cache_quant_algo", nullptr},
                             {"group_size", 16},
                             {"exclude_modules", excludes}}}};
  EXPECT_EQ(Read(out_ + "/hf_quant_config.json"), hf.dump(2) + "\n");
  const json qc = {
      {"config_groups",
       {{"group_0",
         {{"weights", {{"dynamic", false}, {"num_bits", 4}, {"type", "float"}, {"group_size", 16}}},
          {"targets", {"Linear"}}}}}},
      {"ignore", json(excludes)},
      {"quant_algo", "W4A16_NVFP4"},
      {"producer", {{"name", "quantd"}}},
      {"quant_method", "modelopt"}};
  EXPECT_EQ(Read(out_ + "/config.json"), ConfigWith(qc).dump(2) + "\n");
}

TEST_F(ExportStageTest, MissingOutputShardFailsNamingIt) {
  MakeSource(fixture::Arch::kDeepseekV4);
  PlanAndWriteShards("");
  fs::remove(out_ + "/model-00002-of-00004.safetensors");
  absl::StatusOr<TaskOutput> out = Export();
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("model-00002-of-00004.safetensors"), std::string::npos)
      << out.status();
  EXPECT_FALSE(fs::exists(out_ + "/model.safetensors.index.json"));
}

TEST_F(ExportStageTest, ReportsAHeartbeatPerShardHeaderAndCopiedChunk) {
  // Export reads no source bytes, but a long one must keep its lease: one heartbeat per output
  // shard whose header the index is built from, and per 1 MiB chunk of each copied file (the
  // fixture's are all smaller: one each).
  MakeSource(fixture::Arch::kDeepseekV4);
  PlanAndWriteShards("");
  ASSERT_TRUE(Export().ok());
  int shards = 0, copied = 0;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(out_)) {
    if (!e.is_regular_file()) continue;
    const std::string name = e.path().filename().string();
    if (e.path().extension() == ".safetensors") {
      ++shards;
    } else if (name != "model.safetensors.index.json" && name != "config.json" &&
               name != "hf_quant_config.json" && name != kManifestName) {
      ++copied;
    }
  }
  EXPECT_EQ(shards, 4);
  EXPECT_GT(copied, 0);
  EXPECT_EQ(heartbeats_, shards + copied);
  EXPECT_EQ(progress_bytes_, 0u);
}

TEST_F(ExportStageTest, TheManifestListsEveryFileOfTheOutputWithItsSizeAndSha256) {
  MakeSource(fixture::Arch::kDeepseekV4);
  PlanAndWriteShards("");
  ASSERT_TRUE(Export().ok());
  absl::StatusOr<std::vector<ManifestEntry>> manifest =
      ParseManifest(Read(out_ + "/" + kManifestName), kManifestName);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  std::map<std::string, ManifestEntry> listed;
  for (const ManifestEntry& e : *manifest) listed[e.path] = e;
  std::set<std::string> files;  // every file of the output but the manifest, recomputed
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(out_)) {
    const std::string rel = fs::relative(e.path(), out_).string();
    if (!e.is_regular_file() || rel == kManifestName || rel.front() == '.') continue;
    files.insert(rel);
    ASSERT_EQ(listed.count(rel), 1u) << rel;
    EXPECT_EQ(listed.at(rel).size, fs::file_size(e.path())) << rel;
    absl::StatusOr<std::string> sha = checkpoint::Sha256File(e.path().string());
    ASSERT_TRUE(sha.ok());
    EXPECT_EQ(listed.at(rel).sha256, *sha) << rel;
  }
  EXPECT_EQ(files.size(), listed.size());
  EXPECT_EQ(listed.count("model-00001-of-00004.safetensors"), 1u);
  EXPECT_EQ(listed.count("config.json"), 1u);
  EXPECT_EQ(listed.count("model.safetensors.index.json"), 1u);
  // The shards' digests are the ones their quantize tasks recorded: no shard is read again.
  EXPECT_EQ(listed.at("model-00002-of-00004.safetensors").sha256,
            recorded_.at("model-00002-of-00004.safetensors").sha256);
}

TEST_F(ExportStageTest, AShardWithoutARecordedOutputFailsTheManifest) {
  MakeSource(fixture::Arch::kDeepseekV4);
  PlanAndWriteShards("");
  recorded_.erase("model-00003-of-00004.safetensors");
  absl::StatusOr<TaskOutput> out = Export();
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(out.status().message(),
            absl::StrCat(out_, "/model-00003-of-00004.safetensors: the quantize task of "
                         "model-00003-of-00004.safetensors recorded no output"));
  EXPECT_FALSE(fs::exists(out_ + "/" + kManifestName));
}

}  // namespace
}  // namespace quantd::pipeline
