// The pieces of the calibrate stage that hold state between tasks: the activation store (budget,
// spilling, release, cleanup), the amax rows the tasks record, the task payloads, the tokens file,
// and which calibrate tasks a quantize task waits for.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/calibration/activation_store.h"
#include "server/calibration/amax_rows.h"
#include "server/calibration/calibrate_layer.h"
#include "server/calibration/calibrate_task.h"
#include "server/calibration/calibration_tokens.h"
#include "server/checkpoint/sha256.h"
#include "server/pipeline/stages/calibrate_stage.h"
#include "tests/unit/test_dirs.h"

namespace quantd::calibration {
namespace {

using testing_util::TempDirTest;

BatchActivations HostBatch(int64_t floats) {
  BatchActivations b;
  b.host.sequences = 1;
  b.host.seq_len = 1;
  b.host.streams.assign(static_cast<size_t>(floats), 1.0f);
  b.host.token_ids = {7};
  b.tokens = 1;
  return b;
}

// A spilled batch: a file in `dir` (the store removes it, it does not read it).
BatchActivations SpilledBatch(const std::string& dir, const std::string& name) {
  BatchActivations b;
  b.spill_path = dir + "/" + name;
  std::ofstream(b.spill_path) << "x";
  b.tokens = 1;
  return b;
}

size_t FilesIn(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) n += e.is_regular_file();
  return n;
}

class ActivationStoreTest : public TempDirTest {};

TEST_F(ActivationStoreTest, BudgetSpillReleaseAndCleanup) {
  // A directory an earlier (crashed) store left: removed by the next one.
  std::filesystem::create_directories(dir_ + "/spill-1-0");
  std::ofstream(dir_ + "/spill-1-0/layer0.slice0.batch0.safetensors") << "stale";
  auto store = ActivationStore::Create(dir_, /*host_budget_bytes=*/100);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/spill-1-0"));
  const std::string spill = (*store)->spill_dir();
  EXPECT_TRUE(std::filesystem::is_directory(spill));

  // HostBytes of a 16-float batch with one token id: 68 bytes; a second one does not fit.
  EXPECT_EQ(HostBytes(HostBatch(16).host), 68);
  EXPECT_TRUE((*store)->ReserveHost(68));
  EXPECT_FALSE((*store)->ReserveHost(68));
  EXPECT_EQ((*store)->host_bytes(), 68);
  std::vector<BatchActivations> layer0;
  layer0.push_back(HostBatch(16));
  layer0.push_back(SpilledBatch(spill, "layer0.slice0.batch1.safetensors"));
  (*store)->Put(0, 0, std::move(layer0));
  std::vector<BatchActivations> layer1;
  layer1.push_back(SpilledBatch(spill, "layer1.slice0.batch0.safetensors"));
  (*store)->Put(1, 0, std::move(layer1));
  ASSERT_NE((*store)->Get(0, 0), nullptr);
  EXPECT_EQ((*store)->Get(0, 0)->size(), 2u);
  EXPECT_EQ((*store)->Get(0, 1), nullptr);
  EXPECT_EQ(FilesIn(spill), 2u);

  // Releasing layer 0 returns its host bytes and removes its spill file, not layer 1's.
  (*store)->ReleaseLayer(0);
  EXPECT_EQ((*store)->Get(0, 0), nullptr);
  EXPECT_EQ((*store)->host_bytes(), 0);
  EXPECT_EQ((*store)->peak_host_bytes(), 68);
  EXPECT_EQ(FilesIn(spill), 1u);
  EXPECT_TRUE(std::filesystem::exists(spill + "/layer1.slice0.batch0.safetensors"));

  // A failed task gives its reservation back.
  EXPECT_TRUE((*store)->ReserveHost(100));
  (*store)->UnreserveHost(100);
  EXPECT_EQ((*store)->host_bytes(), 0);

  // Destroying the store (job ended, paused, process stopping) leaves no spill file.
  store->reset();
  EXPECT_FALSE(std::filesystem::exists(spill));
  EXPECT_EQ(FilesIn(dir_), 0u);
}

TEST_F(ActivationStoreTest, WithoutDirectoryNothingSpills) {
  auto store = ActivationStore::Create("", 0);
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->spill_dir(), "");
  EXPECT_TRUE((*store)->ReserveHost(int64_t{1} << 40));
}

TEST(AmaxRowsTest, RoundTripKeepsBothW2Inputs) {
  AmaxTable table;
  table.AddSlice("layer 1 slice 0 of 1");
  table.Record("layers.1.attn.wq_a", 3.5f, 10);
  table.RecordW2("layers.1.ffn.experts.5.w2", 0.75f, 2.25f, 4);
  const std::vector<store::AmaxRow> rows = ToAmaxRows(table);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[1].module, "layers.1.ffn.experts.5.w2");
  EXPECT_EQ(rows[1].value, 0.75);
  EXPECT_EQ(rows[1].samples, 4);
  EXPECT_EQ(rows[2].module, "layers.1.ffn.experts.5.w2.unweighted");
  EXPECT_EQ(rows[2].value, 2.25);
  EXPECT_EQ(rows[2].samples, 4);
  AmaxTable back = FromAmaxRows(rows);
  back.AddSlice("layer 1 slice 0 of 1");
  EXPECT_TRUE(back == table);
}

TEST(CalibrateTaskTest, PayloadRoundTripAndErrors) {
  CalibrateTask t;
  t.kind = CalibrateTask::Kind::kLayer;
  t.layer = 2;
  t.layers = 3;
  t.slice = 1;
  t.slices = 2;
  t.first_batch = 4;
  t.end_batch = 7;
  EXPECT_EQ(t.Name(), "layer2.slice1");
  auto back = ParseCalibrateTask(ToJson(t));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->layer, 2);
  EXPECT_EQ(back->end_batch, 7);
  EXPECT_EQ(ParseCalibrateTask(R"({"kind":"layer","layers":3,"slices":2,"layer":3,"slice":0,)"
                               R"("first_batch":0,"end_batch":0})")
                .status()
                .message(),
            "calibrate task payload: layer is missing or not valid");
  EXPECT_FALSE(ParseCalibrateTask("[]").ok());
  t.kind = CalibrateTask::Kind::kTokens;
  EXPECT_EQ(ParseCalibrateTask(ToJson(t))->Name(), "tokens");
}

TEST(SliceBatchesTest, ContiguousCoverInOrder) {
  // 5 batches over 2 slices: [0, 2) and [2, 5); more slices than batches leave some empty.
  EXPECT_EQ(SliceBatches(5, 0, 2), std::make_pair(int64_t{0}, int64_t{2}));
  EXPECT_EQ(SliceBatches(5, 1, 2), std::make_pair(int64_t{2}, int64_t{5}));
  EXPECT_EQ(SliceBatches(1, 0, 2), std::make_pair(int64_t{0}, int64_t{0}));
  EXPECT_EQ(SliceBatches(1, 1, 2), std::make_pair(int64_t{0}, int64_t{1}));
}

class TokensFileTest : public TempDirTest {};

TEST_F(TokensFileTest, RoundTripChecksumAndVocabulary) {
  const SampleIds ids = {{1, 2, 3}, {1023}, {0, 5}};
  const std::string path = dir_ + "/tokens.bin";
  ASSERT_TRUE(WriteTokensFile(path, ids).ok());
  // "QDTOKEN1", the count, 3 lengths, 6 ids.
  EXPECT_EQ(std::filesystem::file_size(path), 8u + 8 + 3 * 8 + 6 * 4);
  const std::string sha = *checkpoint::Sha256File(path);
  auto back = ReadTokensFile(path, sha, 1024);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, ids);
  EXPECT_EQ(ReadTokensFile(path, std::string(64, '0'), 1024).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(ReadTokensFile(path, sha, 1000).status().message(),
            "calibration tokens " + path + ": a token id is outside the vocabulary");
}

TEST(CalibrateDependenciesTest, ShardWaitsForItsLayersOnly) {
  pipeline::JobSpec spec;
  const pipeline::CalibrationLayout layout{4, 2};
  pipeline::ShardTask task;
  task.shard = "model-00002-of-00004.safetensors";
  task.modules = {"layers.1.ffn.experts.0.w1", "layers.3.ffn.experts.7.w2"};
  std::vector<std::string> names;
  for (const store::TaskRef& r : pipeline::CalibrateDependencies(layout, spec, task)) {
    EXPECT_EQ(r.stage, "calibrate");
    names.push_back(r.task);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"layer1.slice0", "layer1.slice1", "layer3.slice0",
                                             "layer3.slice1"}));
  // The model-max fill needs every layer; so does a module outside the decoder layers.
  spec.calibration.uncalibrated = pipeline::UncalibratedFill::kModelMax;
  EXPECT_EQ(pipeline::CalibrateDependencies(layout, spec, task).size(), 8u);
  spec.calibration.uncalibrated = pipeline::UncalibratedFill::kLayerMax;
  task.modules = {"head"};
  EXPECT_EQ(pipeline::CalibrateDependencies(layout, spec, task).size(), 8u);
  // A shard without NVFP4 modules waits for no calibration.
  task.modules.clear();
  EXPECT_TRUE(pipeline::CalibrateDependencies(layout, spec, task).empty());
}

}  // namespace
}  // namespace quantd::calibration
