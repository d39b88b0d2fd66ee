// quantd inspect (the real binary) and the tensor inventory's format detection and validation.
#include <gtest/gtest.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/fixture/fixture.h"
#include "server/fixture/fixture_spec.h"
#include "server/pipeline/inspect.h"
#include "tests/unit/test_dirs.h"

namespace quantd::pipeline {

using checkpoint::BuildInventory;
using checkpoint::ModelArch;
using checkpoint::TensorFormat;
using checkpoint::TensorInfo;
using checkpoint::TensorInventory;

namespace {

namespace fs = std::filesystem;
using checkpoint::Dtype;
using checkpoint::TensorSpec;
using nlohmann::json;

using testing_util::TestDir;

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs the quantd binary with `args` (already shell-quoted where needed).
RunResult RunQuantd(const std::string& args) {
  const std::string err_path = TestDir("stderr");
  const std::string cmd = absl::StrCat(QUANTD_BINARY, " ", args, " 2>", err_path);
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    ADD_FAILURE() << "popen failed: " << cmd;
    return r;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = Slurp(err_path);
  return r;
}

// Counts and bytes computed from the fixture's own tensor list (not from the files).
struct Expected {
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;  // dtype -> (tensors, bytes)
  uint64_t tensors = 0;
  uint64_t bytes = 0;
};

Expected FromSpec(fixture::Arch arch) {
  Expected e;
  for (const fixture::FixtureTensor& t :
       fixture::FixtureTensors(fixture::MakeConfig(arch, fixture::Preset::kTiny))) {
    for (const TensorSpec& s : t.Stored()) {
      auto& [count, bytes] = e.by_dtype[std::string(checkpoint::DtypeName(s.dtype))];
      ++count;
      bytes += s.bytes();
      ++e.tensors;
      e.bytes += s.bytes();
    }
  }
  return e;
}

TEST(InspectBinaryTest, JsonReportOfTinyV4MatchesTheFixture) {
  const std::string dir = TestDir("v4");
  RunResult mk = RunQuantd(absl::StrCat("mkfixture --seed 4 ", dir));
  ASSERT_EQ(mk.exit_code, 0) << mk.err;

  RunResult r = RunQuantd(absl::StrCat("inspect --json ", dir));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  const Expected want = FromSpec(fixture::Arch::kDeepseekV4);

  EXPECT_EQ(j["dir"], dir);
  EXPECT_EQ(j["arch"], "deepseek_v4");
  EXPECT_EQ(j["model_type"], "deepseek_v4");
  EXPECT_EQ(j["tensors"].get<uint64_t>(), want.tensors);
  EXPECT_EQ(j["tensors"].get<uint64_t>(), 339u);
  EXPECT_EQ(j["tensor_bytes"].get<uint64_t>(), want.bytes);
  for (const auto& [dtype, cb] : want.by_dtype) {
    EXPECT_EQ(j["by_dtype"][dtype]["tensors"].get<uint64_t>(), cb.first) << dtype;
    EXPECT_EQ(j["by_dtype"][dtype]["bytes"].get<uint64_t>(), cb.second) << dtype;
  }
  EXPECT_EQ(j["by_dtype"].size(), want.by_dtype.size());

  // Shards: sizes are the files' sizes, and they add up.
  uint64_t file_bytes = 0, shard_tensors = 0;
  for (const json& s : j["shards"]) {
    const std::string name = s["name"];
    EXPECT_EQ(s["bytes"].get<uint64_t>(), fs::file_size(fs::path(dir) / name)) << name;
    file_bytes += s["bytes"].get<uint64_t>();
    shard_tensors += s["tensors"].get<uint64_t>();
  }
  EXPECT_GE(j["shards"].size(), 2u);
  EXPECT_EQ(j["file_bytes"].get<uint64_t>(), file_bytes);
  EXPECT_EQ(shard_tensors, want.tensors);

  // Formats: 35 FP8 + 96 MXFP4 weights, each with one scale; BF16/F32 are the plain tensors;
  // tid2eid (I64) is "other".
  const auto& d = want.by_dtype;
  const json& f = j["by_format"];
  EXPECT_EQ(f["fp8_block_e8m0"]["tensors"], 35);
  EXPECT_EQ(f["fp8_block_e8m0"]["bytes"].get<uint64_t>(), d.at("F8_E4M3").second);
  EXPECT_EQ(f["mxfp4"]["tensors"], 96);
  EXPECT_EQ(f["mxfp4"]["bytes"].get<uint64_t>(), d.at("I8").second);
  EXPECT_EQ(f["scale"]["tensors"], 131);
  EXPECT_EQ(f["scale"]["bytes"].get<uint64_t>(), d.at("F8_E8M0").second);
  EXPECT_EQ(f["bf16"]["tensors"].get<uint64_t>(), d.at("BF16").first);
  EXPECT_EQ(f["f32"]["tensors"].get<uint64_t>(), d.at("F32").first);
  EXPECT_EQ(f["other"]["tensors"], 1);
  EXPECT_EQ(f["other"]["bytes"], 1024 * 2 * 8);
  EXPECT_EQ(j["linear_modules"], json::parse(R"({"bf16":13,"fp8_block_e8m0":35,"mxfp4":96})"));

  // Recipes (module lists are checked in recipe_test).
  EXPECT_EQ(j["recipes"]["experts"],
            json::parse(R"({"modules":72,"bytes":1253376,"fusion_groups":24,
              "excluded":{"attention":28,"head":1,"mtp":27,"not selected":4,"shared expert":12}})"));
  // full: per layer wq_a, wkv, wq_b, wo_b (196620 FP8 bytes), shared w1/w2/w3 (98310) and 24
  // routed experts (17408 each); wo_a (65540) stays FP8.
  EXPECT_EQ(j["recipes"]["full"],
            json::parse(R"({"modules":93,"bytes":2138166,"fusion_groups":30,
              "excluded":{"compressor":4,"embedding":1,"grouped output projection":3,"head":1,
                          "indexer":4,"mtp":35,"router gate":3}})"));
  EXPECT_EQ(j["recipes"]["full"]["bytes"], 3 * (196620 + 98310 + 24 * 17408));

  // The text form carries the same numbers.
  RunResult text = RunQuantd(absl::StrCat("inspect ", dir));
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("quantizes 72 modules, 1253376 bytes"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find(absl::StrCat("tensors     339, ", want.bytes, " bytes of data")),
            std::string::npos)
      << text.out;
}

TEST(InspectBinaryTest, TinyV3IsFp8BlockF32) {
  const std::string dir = TestDir("v3");
  ASSERT_EQ(RunQuantd(absl::StrCat("mkfixture --arch deepseek-v3 ", dir)).exit_code, 0);
  RunResult r = RunQuantd(absl::StrCat("inspect --json ", dir));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  const Expected want = FromSpec(fixture::Arch::kDeepseekV3);
  EXPECT_EQ(j["arch"], "deepseek_v3");
  EXPECT_EQ(j["tensors"].get<uint64_t>(), want.tensors);
  EXPECT_EQ(j["tensor_bytes"].get<uint64_t>(), want.bytes);
  EXPECT_EQ(j["by_format"]["fp8_block_f32"]["tensors"], 105);
  EXPECT_EQ(j["by_format"]["scale"]["bytes"].get<uint64_t>(), want.by_dtype.at("F32").second - 3 * 8 * 4);
  EXPECT_EQ(j["recipes"]["experts"]["modules"], 48);
  EXPECT_EQ(j["recipes"]["full"]["modules"], 72);
}

TEST(InspectBinaryTest, NotACheckpointIsAnOperationError) {
  const std::string dir = TestDir("empty");
  fs::create_directories(dir);
  std::ofstream(dir + "/README.md") << "not a model";
  RunResult r = RunQuantd(absl::StrCat("inspect ", dir));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find(dir), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("not a checkpoint directory"), std::string::npos) << r.err;

  r = RunQuantd(absl::StrCat("inspect ", dir, "/missing"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(dir + "/missing: not a directory"), std::string::npos) << r.err;
}

TEST(InspectBinaryTest, UsageErrorsExitWithTwo) {
  EXPECT_EQ(RunQuantd("inspect").exit_code, 2);
  EXPECT_EQ(RunQuantd("").exit_code, 2);
  EXPECT_EQ(RunQuantd("frobnicate").exit_code, 2);
  RunResult r = RunQuantd(absl::StrCat("mkfixture --preset huge ", TestDir("x")));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("unknown --preset 'huge'"), std::string::npos) << r.err;
  r = RunQuantd("--version");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, "quantd 0.1.0\n");
}

TEST(InspectBinaryTest, MkfixtureRefusesNonEmptyDirectory) {
  const std::string dir = TestDir("busy");
  fs::create_directories(dir);
  std::ofstream(dir + "/x") << "x";
  RunResult r = RunQuantd(absl::StrCat("mkfixture ", dir));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("not empty"), std::string::npos) << r.err;
  EXPECT_EQ(RunQuantd(absl::StrCat("mkfixture --force ", dir)).exit_code, 0);
}

// Writes a single-file checkpoint (model.safetensors) with the given tensors, zero-filled.
std::string WriteCheckpoint(const std::string& tag, const std::vector<TensorSpec>& specs) {
  const std::string dir = TestDir(tag);
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << R"({"model_type": "test"})";
  absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsWriter>> w =
      checkpoint::SafetensorsWriter::Create(dir + "/model.safetensors", specs);
  EXPECT_TRUE(w.ok()) << w.status();
  for (const TensorSpec& s : specs) {
    const std::vector<uint8_t> zeros(s.bytes(), 0);
    EXPECT_TRUE((*w)->WriteTensor(s.name, zeros.data(), zeros.size()).ok());
  }
  EXPECT_TRUE((*w)->Finish().ok());
  return dir;
}

absl::StatusOr<TensorInventory> Inventory(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<checkpoint::CheckpointDir>> c =
      checkpoint::CheckpointDir::Open(dir);
  if (!c.ok()) return c.status();
  return BuildInventory(**c);
}

std::string InventoryError(const std::vector<TensorSpec>& specs) {
  absl::StatusOr<TensorInventory> inv = Inventory(WriteCheckpoint("bad", specs));
  EXPECT_FALSE(inv.ok());
  return inv.ok() ? "" : std::string(inv.status().message());
}

TEST(InventoryTest, DetectsNvfp4Layouts) {
  const std::string dir = WriteCheckpoint(
      "nvfp4", {{"a.weight", Dtype::kU8, {32, 16}},
                {"a.weight_scale", Dtype::kF8E4M3, {32, 2}},
                {"a.weight_scale_2", Dtype::kF32, {}},
                {"a.input_scale", Dtype::kF32, {}},
                {"b.weight_packed", Dtype::kU8, {32, 16}},
                {"b.weight_scale", Dtype::kF8E4M3, {32, 2}},
                {"b.weight_global_scale", Dtype::kF32, {1}},
                {"b.input_global_scale", Dtype::kF32, {1}},
                {"attn.k_proj.k_scale", Dtype::kF32, {}},
                {"norm.weight", Dtype::kBF16, {32}}});
  absl::StatusOr<TensorInventory> inv = Inventory(dir);
  ASSERT_TRUE(inv.ok()) << inv.status();
  std::map<std::string, std::pair<TensorFormat, std::string>> got;
  for (const TensorInfo& t : inv->tensors) got[t.name] = {t.format, t.owner};
  EXPECT_EQ(got["a.weight"].first, TensorFormat::kNvfp4);
  EXPECT_EQ(got["a.weight_scale_2"], std::make_pair(TensorFormat::kScale, std::string("a.weight")));
  EXPECT_EQ(got["a.input_scale"], std::make_pair(TensorFormat::kScale, std::string("a.weight")));
  EXPECT_EQ(got["b.weight_packed"].first, TensorFormat::kNvfp4CompressedTensors);
  EXPECT_EQ(got["b.input_global_scale"],
            std::make_pair(TensorFormat::kScale, std::string("b.weight_packed")));
  EXPECT_EQ(got["attn.k_proj.k_scale"], std::make_pair(TensorFormat::kScale, std::string()));
  EXPECT_EQ(got["norm.weight"].first, TensorFormat::kBf16);
  ASSERT_EQ(inv->linears.size(), 2u);
  EXPECT_EQ(inv->linears[0].name, "a");
  EXPECT_EQ(inv->linears[0].in_features, 32);
  EXPECT_EQ(inv->linears[0].tensors.size(), 4u);
  EXPECT_EQ(inv->linears[0].bytes, 512u + 64 + 4 + 4);
  EXPECT_EQ(inv->arch, ModelArch::kUnknown);
  EXPECT_EQ(inv->model_type, "test");
}

TEST(InventoryTest, QuantizedWeightsNeedTheirScales) {
  std::string e = InventoryError({{"x.weight", Dtype::kF8E4M3, {256, 256}}});
  EXPECT_NE(e.find("FP8 weight x.weight has no block scale (expected x.scale or "
                   "x.weight_scale_inv)"),
            std::string::npos)
      << e;

  e = InventoryError({{"x.weight", Dtype::kF8E4M3, {576, 320}},
                      {"x.weight_scale_inv", Dtype::kF32, {4, 3}}});
  EXPECT_NE(e.find("scale x.weight_scale_inv of x.weight [576, 320] has shape [4, 3], expected "
                   "[5, 3]"),
            std::string::npos)
      << e;

  e = InventoryError({{"e.weight", Dtype::kI8, {64, 64}}, {"e.scale", Dtype::kF8E8M0, {64, 2}}});
  EXPECT_NE(e.find("scale e.scale of e.weight [64, 64] has shape [64, 2], expected [64, 4]"),
            std::string::npos)
      << e;

  e = InventoryError({{"e.weight", Dtype::kI8, {64, 64}}, {"e.scale", Dtype::kF32, {64, 4}}});
  EXPECT_NE(e.find("scale e.scale of e.weight is F32, expected F8_E8M0"), std::string::npos) << e;

  e = InventoryError({{"n.weight", Dtype::kU8, {32, 16}}, {"n.weight_scale", Dtype::kF8E4M3, {32, 2}}});
  EXPECT_NE(e.find("nvfp4 weight n.weight has no n.weight_scale_2"), std::string::npos) << e;

  e = InventoryError({{"o.weight", Dtype::kBF16, {8, 8}}, {"o.scale", Dtype::kF8E8M0, {1, 1}}});
  EXPECT_NE(e.find("scale tensor o.scale belongs to no quantized weight"), std::string::npos) << e;
}

TEST(InspectTest, BrokenCheckpointErrorNamesTensors) {
  const std::string dir = WriteCheckpoint("broken", {{"q.weight", Dtype::kF8E4M3, {128, 128}}});
  absl::StatusOr<json> r = InspectCheckpoint(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(dir), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("q.weight"), std::string::npos) << r.status();
}

TEST(InspectTest, UnknownArchitectureHasNoBuiltinRecipes) {
  const std::string dir = WriteCheckpoint("llama", {{"lm_head.weight", Dtype::kBF16, {64, 32}}});
  absl::StatusOr<json> r = InspectCheckpoint(dir);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)["arch"], "unknown");
  EXPECT_TRUE((*r)["recipes"]["experts"].contains("error"));
  EXPECT_EQ((*r)["linear_modules"], json::parse(R"({"bf16":1})"));
  const std::string text = FormatInspectReport(*r);
  EXPECT_NE(text.find("experts  not applicable: recipe 'experts' is defined for deepseek_v4"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace quantd::pipeline
