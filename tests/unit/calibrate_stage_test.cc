// The pieces of the calibrate stage that hold state between tasks: the activation store (budget,
// spilling, release, cleanup), the layer checkpoints (when a layer is kept, where a restart
// resumes, what is removed), the amax rows the tasks record, the task payloads, the tokens file,
// and which calibrate tasks a quantize task waits for.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/calibration/activation_store.h"
#include "server/calibration/amax_rows.h"
#include "server/calibration/calibrate_layer.h"
#include "server/calibration/calibrate_task.h"
#include "server/calibration/calibration_tokens.h"
#include "server/calibration/job_calibration.h"
#include "server/calibration/layer_checkpoint.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/sha256.h"
#include "server/model/v4_activations.h"
#include "server/pipeline/stages/calibrate_stage.h"
#include "server/pipeline/stages/job_tokens.h"
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

// A batch of `tokens` tokens (one sequence) whose streams are `value`, hc 2 x hidden 3.
model::V4Activations Acts(int64_t tokens, float value) {
  model::V4Activations a;
  a.sequences = 1;
  a.seq_len = tokens;
  a.hc_mult = 2;
  a.hidden_size = 3;
  a.token_ids.assign(static_cast<size_t>(tokens), 5);
  a.streams.assign(static_cast<size_t>(tokens * 6), value);
  return a;
}

BatchActivations InHost(int64_t tokens, float value) {
  BatchActivations b;
  b.host = Acts(tokens, value);
  b.tokens = tokens;
  return b;
}

// The batch spilled as CalibrateLayerSlice spills it.
BatchActivations Spilled(const std::string& path, int64_t tokens, float value) {
  BatchActivations b;
  EXPECT_TRUE(model::SpillActivations(Acts(tokens, value), path).ok());
  b.spill_path = path;
  b.spill_sha256 = *checkpoint::Sha256File(path);
  b.tokens = tokens;
  return b;
}

// The stored row of a layer task: DONE with `file` as its output when given, else PENDING.
LayerTask Task(int64_t id, int64_t layer, int64_t slice, const CheckpointFile* file) {
  LayerTask t{layer, slice, {}};
  t.row.id = id;
  t.row.state = file != nullptr ? store::TaskState::kDone : store::TaskState::kPending;
  if (file != nullptr) {
    t.row.output_path = file->path;
    t.row.output_bytes = static_cast<int64_t>(file->bytes);
    t.row.output_sha256 = file->sha256;
  }
  return t;
}

std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

class LayerCheckpointTest : public TempDirTest {};

TEST_F(LayerCheckpointTest, PolicyFollowsTheClockFromTheLastBoundary) {
  int64_t now = 1000;
  auto checkpoints =
      LayerCheckpoints::Create(dir_ + "/layers", /*checkpoint_seconds=*/300, [&] { return now; });
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  LayerCheckpoints& c = **checkpoints;
  // Layer 0 ends 299.999 s after the start: not yet. A slice spilled whole is kept anyway (its
  // files are only linked), the others of the layer keep the layer's decision.
  now += 299'999;
  EXPECT_FALSE(c.ShouldPersist(0, /*all_spilled=*/false));
  EXPECT_TRUE(c.ShouldPersist(0, /*all_spilled=*/true));
  now += 1;
  EXPECT_FALSE(c.ShouldPersist(0, false));  // decided once per layer
  // Layer 1 ends 300 s after the start: kept, by every slice, however late it asks.
  EXPECT_TRUE(c.ShouldPersist(1, false));
  now += 50'000;
  EXPECT_TRUE(c.ShouldPersist(1, false));
  // Its commit restarts the clock: layer 2, 299 s later, is not kept; layer 3, 300 s later, is.
  c.OnBoundaryCommitted(1);
  now += 299'000;
  EXPECT_FALSE(c.ShouldPersist(2, false));
  now += 1'000;
  EXPECT_TRUE(c.ShouldPersist(3, false));

  // checkpoint_seconds 0: every layer, whatever the clock.
  auto every = LayerCheckpoints::Create(dir_ + "/every", 0, [] { return int64_t{7}; });
  ASSERT_TRUE(every.ok());
  for (int64_t layer = 0; layer < 4; ++layer) EXPECT_TRUE((*every)->ShouldPersist(layer, false));
}

TEST_F(LayerCheckpointTest, PersistWritesHostBatchesAndLinksSpilledOnes) {
  auto store = ActivationStore::Create(dir_ + "/work", 0);
  ASSERT_TRUE(store.ok());
  auto checkpoints = LayerCheckpoints::Create(dir_ + "/layers", 0);
  ASSERT_TRUE(checkpoints.ok());
  std::vector<BatchActivations> batches;
  batches.push_back(InHost(2, 1.5f));
  batches.push_back(Spilled((*store)->spill_dir() + "/layer3.slice1.batch1.safetensors", 1, 2.5f));
  int heartbeats = 0;
  auto file = (*checkpoints)->Persist(3, 1, batches, [&heartbeats] { ++heartbeats; });
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(heartbeats, 2);
  EXPECT_EQ(file->path, dir_ + "/layers/layer3.slice1.json");
  const std::string b0 = dir_ + "/layers/layer3.slice1.batch0.safetensors";
  const std::string b1 = dir_ + "/layers/layer3.slice1.batch1.safetensors";
  EXPECT_EQ(file->bytes, std::filesystem::file_size(file->path));
  EXPECT_EQ(file->sha256, *checkpoint::Sha256File(file->path));
  EXPECT_EQ(file->batch_bytes,
            static_cast<int64_t>(std::filesystem::file_size(b0) + std::filesystem::file_size(b1)));
  // The spilled batch is the same file (a hard link), not a copy.
  EXPECT_TRUE(std::filesystem::equivalent(b1, batches[1].spill_path));
  EXPECT_EQ(std::filesystem::hard_link_count(b1), 2u);
  // The manifest lists both batches with their sizes, token counts and SHA-256.
  const std::string manifest = *checkpoint::ReadFile(file->path, 1 << 20);
  EXPECT_EQ(manifest,
            absl::StrCat(R"({"layer":3,"slice":1,"batches":[)",
                         R"({"file":"layer3.slice1.batch0.safetensors","bytes":)",
                         std::filesystem::file_size(b0), R"(,"tokens":2,"sha256":")",
                         *checkpoint::Sha256File(b0),
                         R"("},{"file":"layer3.slice1.batch1.safetensors","bytes":)",
                         std::filesystem::file_size(b1), R"(,"tokens":1,"sha256":")",
                         batches[1].spill_sha256, R"("}]})"));
  // The written host batch reads back bit-identically.
  auto back = model::ReadActivations(b0);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->streams, batches[0].host.streams);
  EXPECT_EQ(back->token_ids, batches[0].host.token_ids);
}

TEST_F(LayerCheckpointTest, ResumeUsesTheLastVerifiedBoundaryAndNeverACorruptOne) {
  auto checkpoints = LayerCheckpoints::Create(dir_ + "/layers", 0);
  ASSERT_TRUE(checkpoints.ok());
  LayerCheckpoints& c = **checkpoints;
  // Layers 0 and 1 of 3 checkpointed (2 slices each: one batch, and none), layer 2 not run.
  std::map<std::pair<int64_t, int64_t>, CheckpointFile> files;
  for (int64_t layer : {0, 1}) {
    for (int64_t slice : {0, 1}) {
      std::vector<BatchActivations> batches;
      if (slice == 0) batches.push_back(InHost(2, static_cast<float>(layer) + 0.25f));
      auto file = c.Persist(layer, slice, batches);
      ASSERT_TRUE(file.ok()) << file.status();
      files[{layer, slice}] = *file;
    }
  }
  std::vector<LayerTask> tasks;
  for (int64_t layer : {0, 1, 2}) {
    for (int64_t slice : {0, 1}) {
      auto it = files.find({layer, slice});
      const CheckpointFile* file = it == files.end() ? nullptr : &it->second;
      tasks.push_back(Task(10 * layer + slice, layer, slice, file));
    }
  }
  // A flipped byte in layer 1's batch: layer 1 is not trusted, layer 0 is the resume point, and
  // layer 1's done tasks are requeued; only layer 0's files stay.
  const std::string batch1 = dir_ + "/layers/layer1.slice0.batch0.safetensors";
  {
    std::fstream f(batch1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  auto store = ActivationStore::Create(dir_ + "/work", 0);
  ASSERT_TRUE(store.ok());
  ResumePoint point = ResumeLayers(tasks, 2, c, **store);
  EXPECT_FALSE(point.finished);
  EXPECT_EQ(point.layer, 0);
  EXPECT_EQ(point.requeue, (std::vector<int64_t>{10, 11}));
  EXPECT_EQ(point.rejected, (std::vector<std::string>{
                                "layer 1 slice 0: checkpoint not used: " + batch1 +
                                " does not have the SHA-256 its manifest records"}));
  EXPECT_EQ(Names(dir_ + "/layers"),
            (std::vector<std::string>{"layer0.slice0.batch0.safetensors", "layer0.slice0.json",
                                      "layer0.slice1.json"}));
  // Layer 0's outputs are in the store, as the checkpoint's files, and read back as written.
  auto slice0 = (*store)->Get(0, 0);
  ASSERT_NE(slice0, nullptr);
  ASSERT_EQ(slice0->size(), 1u);
  EXPECT_EQ((*slice0)[0].spill_path, dir_ + "/layers/layer0.slice0.batch0.safetensors");
  EXPECT_EQ((*slice0)[0].tokens, 2);
  EXPECT_EQ(model::ReadActivations((*slice0)[0].spill_path)->streams, Acts(2, 0.25f).streams);
  ASSERT_NE((*store)->Get(0, 1), nullptr);
  EXPECT_TRUE((*store)->Get(0, 1)->empty());
  EXPECT_EQ((*store)->Get(1, 0), nullptr);
  // The store reads the checkpoint's files but never removes them.
  (*store)->ReleaseLayer(0);
  store->reset();
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/layers/layer0.slice0.batch0.safetensors"));

  // The next restart (layer 1 requeued): layer 0's files as they are, then one grown by a byte.
  tasks[2].row.state = tasks[3].row.state = store::TaskState::kPending;
  store = ActivationStore::Create(dir_ + "/work", 0);
  point = ResumeLayers(tasks, 2, c, **store);
  EXPECT_EQ(point.layer, 0);
  EXPECT_TRUE(point.rejected.empty());
  EXPECT_TRUE(point.requeue.empty());
  std::ofstream(files[{0, 1}].path, std::ios::app) << " ";
  point = ResumeLayers(tasks, 2, c, **store);
  EXPECT_EQ(point.layer, -1);
  EXPECT_EQ(point.requeue, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(point.rejected, (std::vector<std::string>{
                                "layer 0 slice 1: checkpoint not used: " + files[{0, 1}].path +
                                " has " + std::to_string(files[{0, 1}].bytes + 1) +
                                " bytes, recorded " + std::to_string(files[{0, 1}].bytes)}));
  EXPECT_TRUE(Names(dir_ + "/layers").empty());
  // With every layer task done, nothing resumes and nothing is requeued.
  for (LayerTask& t : tasks) t.row.state = store::TaskState::kDone;
  point = ResumeLayers(tasks, 2, c, **store);
  EXPECT_TRUE(point.finished);
  EXPECT_TRUE(point.requeue.empty());
}

TEST_F(LayerCheckpointTest, ResumeSkipsLayersNotCheckpointedAndRejectsAGoneOrEditedManifest) {
  auto checkpoints = LayerCheckpoints::Create(dir_ + "/layers", 0);
  ASSERT_TRUE(checkpoints.ok());
  LayerCheckpoints& c = **checkpoints;
  // One slice per layer. Layer 0 checkpointed; layer 1 done without one (the clock said no);
  // layer 2 checkpointed, then its manifest edited in place (same size); layer 3 not run.
  const CheckpointFile f0 = *c.Persist(0, 0, {});
  const CheckpointFile f2 = *c.Persist(2, 0, {});
  const CheckpointFile none;
  std::vector<LayerTask> tasks = {Task(1, 0, 0, &f0), Task(2, 1, 0, &none), Task(3, 2, 0, &f2),
                                  Task(4, 3, 0, nullptr)};
  ASSERT_EQ(*checkpoint::ReadFile(f2.path, 1 << 20), R"({"layer":2,"slice":0,"batches":[]})");
  ASSERT_TRUE(
      checkpoint::WriteFileAtomically(f2.path, R"({"layer":2,"slice":1,"batches":[]})").ok());
  auto store = ActivationStore::Create(dir_ + "/work", 0);
  ASSERT_TRUE(store.ok());
  ResumePoint point = ResumeLayers(tasks, 1, c, **store);
  EXPECT_EQ(point.layer, 0);
  EXPECT_EQ(point.requeue, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(point.rejected, (std::vector<std::string>{
                                "layer 2 slice 0: checkpoint not used: " + f2.path +
                                " does not have the recorded SHA-256"}));
  EXPECT_EQ(Names(dir_ + "/layers"), (std::vector<std::string>{"layer0.slice0.json"}));
  // The manifest gone: not trusted either; nothing is left to resume from.
  std::filesystem::remove(f0.path);
  point = ResumeLayers(tasks, 1, c, **store);
  EXPECT_EQ(point.layer, -1);
  EXPECT_EQ(point.requeue, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(point.rejected, (std::vector<std::string>{
                                "layer 2 slice 0: checkpoint not used: " + f2.path + " is gone",
                                "layer 0 slice 0: checkpoint not used: " + f0.path + " is gone"}));
}

TEST_F(LayerCheckpointTest, JobKeepsAtMostTwoBoundariesAndNoneOnceCalibrated) {
  job::JobSpec spec;
  spec.calibration.checkpoint_seconds = 0;
  auto job = JobCalibration::Create(spec, nullptr, dir_, 0);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string layers = dir_ + "/calibrate-layers";
  EXPECT_EQ((*job)->checkpoints().dir(), layers);
  // Layer L slice S of 3 layers x 2 slices finishes: checkpointed (but the last layer), committed.
  const auto finish = [&](int64_t layer, int64_t slice) {
    CalibrateTask t;
    t.kind = CalibrateTask::Kind::kLayer;
    t.layer = layer;
    t.layers = 3;
    t.slice = slice;
    t.slices = 2;
    store::TaskRow row;
    row.stage_kind = "calibrate";
    row.payload_json = ToJson(t);
    CheckpointFile file;
    if (layer < 2) file = *(*job)->checkpoints().Persist(layer, slice, {});
    (*job)->OnTaskDone(row, {}, file.path, file.sha256);
  };
  finish(0, 0);
  finish(0, 1);
  finish(1, 0);
  // Layer 1 is being written: both boundaries are on disk.
  EXPECT_EQ(Names(layers), (std::vector<std::string>{"layer0.slice0.json", "layer0.slice1.json",
                                                    "layer1.slice0.json"}));
  finish(1, 1);
  EXPECT_EQ(Names(layers), (std::vector<std::string>{"layer1.slice0.json", "layer1.slice1.json"}));
  finish(2, 0);
  finish(2, 1);
  EXPECT_TRUE(Names(layers).empty());
}

// A restart requeues layer 0 slice 1 (task 12): its stored rows stay until its rerun replaces
// them, in the job's table as in the store, so its tokens count once.
TEST_F(LayerCheckpointTest, RestoredRowsOfARerunTaskAreReplacedNotAdded) {
  auto job = JobCalibration::Create(job::JobSpec(), nullptr, dir_, 0);
  ASSERT_TRUE(job.ok()) << job.status();
  const auto layer_task = [](int64_t id, int64_t slice, store::TaskState state) {
    CalibrateTask t;
    t.kind = CalibrateTask::Kind::kLayer;
    t.layer = 0;
    t.layers = 2;
    t.slice = slice;
    t.slices = 2;
    store::TaskRow row;
    row.id = id;
    row.stage_kind = "calibrate";
    row.payload_json = ToJson(t);
    row.state = state;
    return row;
  };
  const std::string module = "layers.0.attn.wq_a";
  const store::TaskRow done = layer_task(11, 0, store::TaskState::kDone);
  const store::TaskRow requeued = layer_task(12, 1, store::TaskState::kPending);
  (*job)->Restore({{11, {module, "input", 2.0, 10}}, {12, {module, "input", 3.0, 6}}},
                  {done, requeued});
  EXPECT_EQ((*job)->Table().entries().at(module).amax, 3.0f);
  EXPECT_EQ((*job)->Table().entries().at(module).tokens, 16);
  // The rerun measures the same rows: 10 + 6 tokens, not 10 + 6 + 6.
  (*job)->OnTaskDone(requeued, {{module, "input", 3.0, 6}}, "", "");
  EXPECT_EQ((*job)->Table().entries().at(module).amax, 3.0f);
  EXPECT_EQ((*job)->Table().entries().at(module).tokens, 16);
  // Another run's rows replace the earlier ones whole: the max falls back to task 11's.
  (*job)->OnTaskDone(requeued, {{module, "input", 1.0, 4}}, "", "");
  EXPECT_EQ((*job)->Table().entries().at(module).amax, 2.0f);
  EXPECT_EQ((*job)->Table().entries().at(module).tokens, 14);
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
  EXPECT_EQ(t.Name(), "layer2.slice1");
  // The batches are the tokens file's (SliceBatches at run time), never in the payload.
  EXPECT_EQ(ToJson(t), R"({"kind":"layer","layers":3,"slices":2,"layer":2,"slice":1})");
  auto back = ParseCalibrateTask(ToJson(t));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->layer, 2);
  EXPECT_EQ(back->slice, 1);
  EXPECT_EQ(ParseCalibrateTask(R"({"kind":"layer","layers":3,"slices":2,"layer":3,"slice":0})")
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
  JobTokens tokens;
  tokens.calibration = {{1, 2, 3}, {1023}, {0, 5}};
  tokens.held_out = {{7, 8}};
  const std::string path = dir_ + "/tokens.bin";
  ASSERT_TRUE(WriteTokensFile(path, tokens).ok());
  // "QDTOKEN2", the two counts, 4 lengths, 8 ids.
  EXPECT_EQ(std::filesystem::file_size(path), 8u + 2 * 8 + 4 * 8 + 8 * 4);
  const std::string sha = *checkpoint::Sha256File(path);
  auto back = ReadTokensFile(path, sha, 1024);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->calibration, tokens.calibration);
  EXPECT_EQ(back->held_out, tokens.held_out);
  EXPECT_EQ(TokenCount(back->calibration), 6);
  // A header whose counts claim more samples than the file has lengths for.
  std::string bytes = *checkpoint::ReadFile(path, 1 << 20);
  bytes[16] = 100;
  const std::string damaged = dir_ + "/damaged.bin";
  ASSERT_TRUE(checkpoint::WriteFileAtomically(damaged, bytes).ok());
  EXPECT_EQ(ReadTokensFile(damaged, *checkpoint::Sha256File(damaged), 1024).status().message(),
            "calibration tokens " + damaged + ": sample count past the end");
  EXPECT_EQ(ReadTokensFile(path, std::string(64, '0'), 1024).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(ReadTokensFile(path, sha, 1000).status().message(),
            "calibration tokens " + path + ": a token id is outside the vocabulary");
}

TEST(CalibrationTokenBoundTest, SamplesAskedTimesSeqLen) {
  job::CalibrationSpec spec;
  spec.datasets = {{"/d/a.jsonl", 3}, {"/d/b.jsonl", 0}};
  spec.num_samples = 5;  // for b, the one file without `samples`
  spec.seq_len = 100;
  auto bound = CalibrationTokenBound(spec);
  ASSERT_TRUE(bound.ok()) << bound.status();
  EXPECT_EQ(bound->samples, 8);
  EXPECT_EQ(bound->tokens, 800);
  // Never past what a tokens file holds, whatever the spec asks (no overflow).
  spec.seq_len = int64_t{1} << 62;
  EXPECT_EQ(CalibrationTokenBound(spec)->tokens, kMaxJobTokens);
  EXPECT_EQ(BoundOf(INT64_MAX, INT64_MAX).tokens, kMaxJobTokens);
  EXPECT_EQ(BoundOf(3, 7).tokens, 21);
  spec.datasets.clear();
  EXPECT_FALSE(CalibrationTokenBound(spec).ok());  // no data set
}

TEST(CalibrateDependenciesTest, ShardWaitsForItsLayersOnly) {
  job::JobSpec spec;
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
  spec.calibration.uncalibrated = job::UncalibratedFill::kModelMax;
  EXPECT_EQ(pipeline::CalibrateDependencies(layout, spec, task).size(), 8u);
  spec.calibration.uncalibrated = job::UncalibratedFill::kLayerMax;
  task.modules = {"head"};
  EXPECT_EQ(pipeline::CalibrateDependencies(layout, spec, task).size(), 8u);
  // A shard without NVFP4 modules waits for no calibration.
  task.modules.clear();
  EXPECT_TRUE(pipeline::CalibrateDependencies(layout, spec, task).empty());
}

// A stored calibrate task row of `task` (id, state and output as given).
store::TaskRow CalibrateRow(int64_t id, const CalibrateTask& task, store::TaskState state,
                            std::string output = "") {
  store::TaskRow row;
  row.id = id;
  row.stage_kind = "calibrate";
  row.name = task.Name();
  row.payload_json = ToJson(task);
  row.state = state;
  row.output_path = std::move(output);
  return row;
}

TEST(CalibrateStageInterfaceTest, ProgressOutputsAndReportFactsComeFromItsOwnPayloads) {
  const pipeline::CalibrateStage stage;
  CalibrateTask t;
  t.layers = 4;
  t.slices = 2;
  t.kind = CalibrateTask::Kind::kTokens;
  const store::TaskRow tokens = CalibrateRow(1, t, store::TaskState::kDone, "/w/tokens.bin");
  t.kind = CalibrateTask::Kind::kLayer;
  t.layer = 2;
  t.slice = 1;
  const store::TaskRow layer2 = CalibrateRow(2, t, store::TaskState::kLeased);
  t.layer = 1;
  t.slice = 0;
  const store::TaskRow layer1 = CalibrateRow(3, t, store::TaskState::kDone, "/w/ckpt.json");
  store::TaskRow other = layer1;
  other.stage_kind = "evaluate";

  EXPECT_EQ(stage.progress_unit(), "tokens");
  // The earliest running layer, 1-based; nothing without a running layer task.
  EXPECT_EQ(stage.ProgressStep({&layer2, &tokens, &layer1}), "layer 2 of 4");
  EXPECT_EQ(stage.ProgressStep({&tokens}), "");
  EXPECT_EQ(stage.ProgressStep({}), "");
  // A layer task's output is a layer checkpoint, checked by the stage's own resume.
  EXPECT_TRUE(stage.ChecksOwnOutput(layer1));
  EXPECT_FALSE(stage.ChecksOwnOutput(tokens));
  EXPECT_FALSE(stage.ChecksOwnOutput(other));

  EXPECT_EQ(pipeline::CalibratedLayers({tokens, layer1}), 4);
  EXPECT_EQ(pipeline::CalibratedLayers({tokens, other}), std::nullopt);
  store::StageProgress calibrate;
  calibrate.kind = "calibrate";
  calibrate.state = store::StageState::kRunning;
  calibrate.started_ms = 1000;
  EXPECT_FALSE(pipeline::CalibrationSucceeded({calibrate}));
  EXPECT_EQ(pipeline::CalibrationSeconds({calibrate}), 0);
  calibrate.state = store::StageState::kSucceeded;
  calibrate.finished_ms = 7500;
  EXPECT_TRUE(pipeline::CalibrationSucceeded({calibrate}));
  EXPECT_EQ(pipeline::CalibrationSeconds({calibrate}), 6.5);
}

TEST(CalibrateStageInterfaceTest, OpensAJobOnlyWhenTheJobCalibratesOnData) {
  const pipeline::CalibrateStage stage;
  job::JobSpec spec;
  pipeline::StoredJob stored;
  const std::set<int64_t> changed;
  pipeline::StageJobInput input;
  input.spec = &spec;
  input.stored = &stored;
  input.changed_outputs = &changed;
  auto job = stage.OpenJob(input);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(*job, nullptr);
  spec.source = "/models/src";
  spec.weight_format = job::WeightFormat::kNvfp4;
  spec.calibration.mode = job::CalibrationMode::kData;
  spec.calibration.datasets = {{"/data/a.jsonl", 0}, {"/data/b.jsonl", 0}};
  EXPECT_EQ(pipeline::TokenInputs(spec),
            "/models/src/tokenizer.json or the calibration data /data/a.jsonl, /data/b.jsonl");
}

}  // namespace
}  // namespace quantd::calibration
