// The evaluate stage's plan on the tiny V4 fixture calibrating on the built-in text: one task per
// decoder layer in a chain after export and every verify task, then head and gate; on by default,
// off with evaluate.enabled false; the tasks sized by the bound of the held-out samples; too few
// samples refused by the tokens task. Also its task payloads, where a restart resumes it, and the
// report fields built from its recorded figures.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/calibration/calibrate_layer.h"
#include "server/base/status_macros.h"
#include "server/calibration/calibrate_task.h"
#include "server/calibration/calibration_tokens.h"
#include "server/calibration/job_calibration.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/evaluation/evaluate_task.h"
#include "server/evaluation/job_evaluation.h"
#include "server/fixture/fixture.h"
#include "server/model/v4_config.h"
#include "server/model/v4_memory.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage_registry.h"
#include "server/pipeline/stages/evaluate_stage.h"
#include "server/pipeline/stages/job_tokens.h"
#include "server/pipeline/stages/layer_task_memory.h"
#include "server/scheduler/evaluation_report.h"
#include "tests/unit/test_dirs.h"

namespace quantd::pipeline {

using checkpoint::BuildInventory;
using checkpoint::TensorInventory;

using job::JobSpec;
using job::ParseJobSpec;

namespace {

using calibration::CalibrateTask;
using evaluation::EvaluateTask;

const std::string kData = std::string(QUANTD_SOURCE_DIR) + "/tests/data/calibration_sample.jsonl";

class EvaluatePlanTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_util::TestDir();
    auto summary = fixture::WriteFixture(
        fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny), 7,
        dir_.string(), {});
    ASSERT_TRUE(summary.ok()) << summary.status();
    auto source = checkpoint::CheckpointDir::Open(dir_.string());
    ASSERT_TRUE(source.ok()) << source.status();
    source_ = std::move(*source);
    auto inventory = BuildInventory(*source_);
    ASSERT_TRUE(inventory.ok()) << inventory.status();
    inventory_ = std::move(*inventory);
  }

  // A W4A4 job calibrating on 40 of the 44 lines of the built-in text, plus `extra` keys.
  absl::StatusOr<JobSpec> SpecWith(const std::string& extra, int64_t calibration_samples = 40) {
    return ParseJobSpec(
        "{\"source\": \"" + dir_.string() + "\", \"output\": \"" + dir_.string() +
            "-out\", \"calibration\": {\"datasets\": [{\"path\": \"" + kData +
            "\", \"samples\": " + std::to_string(calibration_samples) +
            "}], \"seq_len\": 48, \"min_seq_len\": 16}" + extra + "}",
        "test");
  }
  absl::StatusOr<Plan> PlanWith(const std::string& extra, int64_t calibration_samples = 40) {
    ASSIGN_OR_RETURN(const JobSpec spec, SpecWith(extra, calibration_samples));
    return BuildPlan(spec, *source_, inventory_, BuiltinStages());
  }
  // What the job's tokens task stores (job_tokens.h), with the held-out samples.
  absl::StatusOr<calibration::JobTokens> TokensWith(const std::string& extra,
                                                    int64_t calibration_samples = 40) {
    ASSIGN_OR_RETURN(const JobSpec spec, SpecWith(extra, calibration_samples));
    ASSIGN_OR_RETURN(const model::V4Config config,
                     model::ParseV4Config(source_->config(), "config.json"));
    return pipeline::TokenizeJob(spec, config.vocab_size, /*held_out=*/true, nullptr);
  }

  std::filesystem::path dir_;
  std::unique_ptr<checkpoint::CheckpointDir> source_;
  TensorInventory inventory_;
};

const store::StagePlan* StageOf(const Plan& plan, std::string_view kind) {
  for (const store::StagePlan& s : plan.stages) {
    if (s.kind == kind) return &s;
  }
  return nullptr;
}

TEST_F(EvaluatePlanTest, OnByDefaultOneTaskPerLayerInAChainThenHeadAndGate) {
  absl::StatusOr<Plan> plan = PlanWith("");
  ASSERT_TRUE(plan.ok()) << plan.status();
  const store::StagePlan* stage = StageOf(*plan, EvaluateStage::kKind);
  ASSERT_NE(stage, nullptr);
  const std::vector<store::TaskPlan>& t = stage->tasks;
  ASSERT_EQ(t.size(), 5u);  // 3 decoder layers, head, gate
  const std::vector<std::string> names = {"layer0", "layer1", "layer2", "head", "gate"};
  const std::vector<std::string> labels = {"layer 1 of 3", "layer 2 of 3", "layer 3 of 3",
                                           "head: next-token figures", "quality gate"};
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i].name, names[i]);
    EXPECT_EQ(t[i].label, labels[i]);
  }
  // Layer 0 waits for export and every verify task; each later task for the one before.
  std::vector<store::TaskRef> first = {{"export", "export"}};
  for (const store::TaskPlan& v : StageOf(*plan, "verify")->tasks) {
    first.push_back({"verify", v.name});
  }
  EXPECT_EQ(t[0].depends_on, first);
  for (size_t i = 1; i < t.size(); ++i) {
    EXPECT_EQ(t[i].depends_on, (std::vector<store::TaskRef>{{"evaluate", names[i - 1]}})) << i;
  }
  // Planning reads no data: the tasks are sized by the bound, the default 32 samples of at most
  // seq_len 48 tokens (the tokens task finds the 4 lines calibration leaves). Every layer and the
  // head move every held-out token, the gate none.
  absl::StatusOr<EvaluateTask> head = evaluation::ParseEvaluateTask(t[3].payload_json);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->max_samples, 32);
  EXPECT_EQ(head->layers, 3);
  EXPECT_EQ(head->max_tokens, 32 * 48);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(t[i].bytes_total, head->max_tokens) << i;
  EXPECT_EQ(t[4].bytes_total, 0);
  absl::StatusOr<calibration::JobTokens> tokens = TokensWith("");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(tokens->calibration.size(), 40u);
  EXPECT_EQ(tokens->held_out.size(), 4u);
  EXPECT_GT(calibration::TokenCount(tokens->held_out), 4 * 16);
  EXPECT_LE(calibration::TokenCount(tokens->held_out), 4 * 48);
}

// The layer checkpoints take two boundaries of every calibration token (one model) and of every
// held-out token (both models), a token being hc_mult x hidden_size float32; the first start's disk
// check counts them in the job's work directory.
TEST_F(EvaluatePlanTest, CheckpointBytesAreTwoBoundariesOfEveryTokenAndTheDiskCheckCountsThem) {
  const fixture::FixtureConfig config =
      fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny);
  const uint64_t token_bytes = config.hc_mult * config.hidden_size * sizeof(float);
  absl::StatusOr<Plan> plan = PlanWith("");
  ASSERT_TRUE(plan.ok()) << plan.status();
  const store::TaskPlan& tokens_task = StageOf(*plan, "calibrate")->tasks.front();
  ASSERT_EQ(tokens_task.name, "tokens");
  const uint64_t calibration_tokens = tokens_task.bytes_total;
  EXPECT_EQ(calibration_tokens, 40u * 48);  // the bound: 40 samples of at most seq_len 48
  EXPECT_EQ(tokens_task.label, "tokenize up to 40 samples");
  const store::TaskPlan& layer0_task = StageOf(*plan, EvaluateStage::kKind)->tasks.front();
  absl::StatusOr<EvaluateTask> layer0 = evaluation::ParseEvaluateTask(layer0_task.payload_json);
  ASSERT_TRUE(layer0.ok()) << layer0.status();
  const uint64_t held_out_tokens = layer0->max_tokens;
  EXPECT_EQ(held_out_tokens, 32u * 48);
  EXPECT_EQ(plan->checkpoint_bytes,
            2 * calibration_tokens * token_bytes + 2 * 2 * held_out_tokens * token_bytes);
  absl::StatusOr<Plan> without = PlanWith(", \"evaluate\": {\"enabled\": false}");
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_EQ(without->checkpoint_bytes, 2 * calibration_tokens * token_bytes);

  JobSpec spec;
  spec.output = dir_.string() + "-out";
  const std::string work_dir = dir_.string() + "/work";  // the output's file system
  EXPECT_TRUE(CheckDiskSpace(spec, *plan, work_dir).ok());
  // The same output with checkpoints that cannot fit: refused, saying what they need and where.
  Plan over = *plan;
  over.checkpoint_bytes = uint64_t{1} << 62;
  const absl::Status s = CheckDiskSpace(spec, over, work_dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  const std::string expected = "the output needs about " +
                               std::to_string(plan->output_bytes + (uint64_t{1} << 62)) +
                               " bytes (the layer checkpoints of calibration and evaluation need "
                               "about " + std::to_string(uint64_t{1} << 62) + " bytes in " +
                               work_dir + ") but " + spec.output + " has ";
  EXPECT_EQ(s.message().substr(0, expected.size()), expected) << s.message();
}

// Calibrate and evaluate tasks state the memory they hold (layer_task_memory.h): the layer of the
// model/v4_memory.h model plus their activations; the other tasks none.
TEST_F(EvaluatePlanTest, LayerTasksStateTheMemoryOfTheirLayerAndActivations) {
  absl::StatusOr<Plan> plan = PlanWith("");
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto config = model::ParseV4Config(source_->config(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  // A slice may hold nearly every token (it takes whole batches): each counts the bound's.
  const int64_t calibration_tokens = StageOf(*plan, "calibrate")->tasks.front().bytes_total;
  for (const store::TaskPlan& t : StageOf(*plan, "calibrate")->tasks) {
    absl::StatusOr<CalibrateTask> task = calibration::ParseCalibrateTask(t.payload_json);
    ASSERT_TRUE(task.ok()) << task.status();
    if (task->kind != CalibrateTask::Kind::kLayer) {
      EXPECT_EQ(t.requirement.memory_bytes, 0) << t.name;
      continue;
    }
    const int64_t layer_bytes =
        model::EstimateLayerMemory(inventory_, "layers." + std::to_string(task->layer) + ".",
                                   model::DecodedWidth::kAsStored)
            .resident_bytes();
    // At least the layer, one sequence's working memory and the slice's streams in and out, at
    // most one whole batch budget more.
    const int64_t streams = 2 * StreamBytes(*config, calibration_tokens);
    EXPECT_GT(t.requirement.memory_bytes,
              layer_bytes + streams + calibration::EstimateBatchBytes(*config, 1, 16))
        << t.name;
    EXPECT_LE(t.requirement.memory_bytes,
              layer_bytes + streams + calibration::kDefaultBatchBytes)
        << t.name;
    EXPECT_FALSE(t.requirement.gpu);
  }
  const std::vector<store::TaskPlan>& evaluate = StageOf(*plan, EvaluateStage::kKind)->tasks;
  for (size_t i = 0; i < 3; ++i) {
    const std::string prefix = "layers." + std::to_string(i) + ".";
    const int64_t layers =
        model::EstimateLayerMemory(inventory_, prefix, model::DecodedWidth::kAsStored)
            .resident_bytes() +
        model::EstimateLayerMemory(inventory_, prefix, model::DecodedWidth::kFloat32)
            .resident_bytes();
    const int64_t streams = 4 * StreamBytes(*config, evaluate[i].bytes_total);
    EXPECT_GT(evaluate[i].requirement.memory_bytes, layers + streams) << i;
    EXPECT_LE(evaluate[i].requirement.memory_bytes,
              layers + streams + calibration::kDefaultBatchBytes)
        << i;
  }
  EXPECT_GT(evaluate[3].requirement.memory_bytes,
            2 * 4 * config->vocab_size * config->hidden_size);  // the head
  EXPECT_EQ(evaluate[4].requirement.memory_bytes, 0);  // the gate
}

// The count is the plan's bound; the tokens task (the job's first after inspect) refuses one the
// data cannot give, naming the file.
TEST_F(EvaluatePlanTest, ExplicitSampleCountIsKeptOrRefusedNamingTheFile) {
  absl::StatusOr<Plan> two = PlanWith(", \"evaluate\": {\"num_samples\": 2}");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(
      evaluation::ParseEvaluateTask(StageOf(*two, "evaluate")->tasks[0].payload_json)->max_samples,
      2);
  absl::StatusOr<calibration::JobTokens> two_tokens =
      TokensWith(", \"evaluate\": {\"num_samples\": 2}");
  ASSERT_TRUE(two_tokens.ok()) << two_tokens.status();
  EXPECT_EQ(two_tokens->held_out.size(), 2u);
  ASSERT_TRUE(PlanWith(", \"evaluate\": {\"num_samples\": 5}").ok());
  absl::StatusOr<calibration::JobTokens> five =
      TokensWith(", \"evaluate\": {\"num_samples\": 5}");
  EXPECT_EQ(five.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(five.status().message(),
            "evaluate.num_samples 5 asks 5 of " + kData +
                " has 44 lines; calibration takes 40 of them and 0 are shorter than min_seq_len "
                "= 16, which leaves 4 usable held-out samples: lower evaluate.num_samples, add "
                "lines, calibrate on fewer samples, or set evaluate.enabled to false");
  // Calibration takes every line: nothing is held out, whatever the count.
  absl::StatusOr<calibration::JobTokens> none = TokensWith("", 44);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("evaluate: the calibration data holds no held-out "
                                         "sample"),
            std::string::npos)
      << none.status();
  EXPECT_NE(none.status().message().find("evaluate.enabled to false"), std::string::npos);
  // Turned off, the same job plans no evaluate stage.
  absl::StatusOr<Plan> off = PlanWith(", \"evaluate\": {\"enabled\": false}", 44);
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(StageOf(*off, "evaluate"), nullptr);
  EXPECT_NE(StageOf(*off, "calibrate"), nullptr);
}

// Tokenizing runs on a worker under its own thread budget (job_tokens.h): out of memory or
// cancelled, the task fails naming what it read, and the process goes on.
TEST_F(EvaluatePlanTest, TokenizingStopsAtItsMemoryBudgetAndWhenCancelled) {
  absl::StatusOr<JobSpec> spec = SpecWith("");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<calibration::JobTokens> small =
      pipeline::TokenizeJob(*spec, 1024, /*held_out=*/true, nullptr, /*memory_bytes=*/65536);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small.status().message(),
            "tokenizing ran out of memory reading " + pipeline::TokenInputs(*spec) +
                " (a tokens task may hold 65536 bytes)")
      << small.status();
  const std::atomic<bool> cancelled{true};
  absl::StatusOr<calibration::JobTokens> stopped =
      pipeline::TokenizeJob(*spec, 1024, /*held_out=*/true, &cancelled);
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();
}

// A calibrating job reads the source its start opened (PreparedJob's, StageJobInput::source):
// the shards are mapped once per job, not once more for the forward.
TEST_F(EvaluatePlanTest, ACalibratingJobsModelIsTheSourceTheJobOpened) {
  absl::StatusOr<JobSpec> spec = SpecWith("");
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto opened = checkpoint::CheckpointDir::Open(dir_.string());
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::shared_ptr<const checkpoint::CheckpointDir> source = std::move(*opened);
  auto job = calibration::JobCalibration::Create(*spec, source, (dir_ / "work").string(), 0);
  ASSERT_TRUE(job.ok()) << job.status();
  absl::StatusOr<const model::V4Checkpoint*> model = (*job)->Checkpoint();
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->dir.get(), source.get());
  EXPECT_EQ((*model)->config.num_hidden_layers, 3);
  auto none = calibration::JobCalibration::Create(*spec, nullptr, (dir_ / "work2").string(), 0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ((*none)->Checkpoint().status().code(), absl::StatusCode::kInternal);
}

TEST_F(EvaluatePlanTest, EnabledNeedsCalibrationData) {
  absl::StatusOr<Plan> on = PlanWith(", \"evaluate\": {\"enabled\": true}");
  ASSERT_TRUE(on.ok()) << on.status();  // calibrates on data: evaluated as by default
  EXPECT_NE(StageOf(*on, "evaluate"), nullptr);
  auto spec = ParseJobSpec("{\"source\": \"" + dir_.string() + "\", \"output\": \"" +
                               dir_.string() + "-out\", \"calibration\": {\"mode\": \"constant\"}, "
                               "\"evaluate\": {\"enabled\": true}}",
                           "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<Plan> plan = BuildPlan(*spec, *source_, inventory_, BuiltinStages());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("evaluate.enabled: "), std::string::npos)
      << plan.status();
  // Unset, a job without calibration data simply has no evaluate stage.
  spec->evaluate.enabled.reset();
  plan = BuildPlan(*spec, *source_, inventory_, BuiltinStages());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(StageOf(*plan, "evaluate"), nullptr);
}

TEST(EvaluateTaskTest, PayloadRoundTripAndErrors) {
  EvaluateTask t;
  t.kind = EvaluateTask::Kind::kLayer;
  t.layer = 2;
  t.layers = 3;
  t.max_samples = 4;
  t.max_tokens = 190;
  EXPECT_EQ(t.Name(), "layer2");
  EXPECT_EQ(ToJson(t),
            R"({"kind":"layer","layer":2,"layers":3,"max_samples":4,"max_tokens":190})");
  absl::StatusOr<EvaluateTask> back = evaluation::ParseEvaluateTask(ToJson(t));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->layer, 2);
  EXPECT_EQ(back->max_tokens, 190);
  t.kind = EvaluateTask::Kind::kGate;
  EXPECT_EQ(t.Name(), "gate");
  EXPECT_EQ(evaluation::ParseEvaluateTask(ToJson(t))->kind, EvaluateTask::Kind::kGate);
  EXPECT_EQ(evaluation::ParseEvaluateTask(R"({"kind":"layer","layer":3,"layers":3,)"
                                          R"("max_samples":4,"max_tokens":1})")
                .status()
                .message(),
            "evaluate task payload: layer is missing or not valid");
  EXPECT_EQ(evaluation::ParseEvaluateTask(R"({"kind":"tail"})").status().message(),
            "evaluate task payload: kind is missing or not valid");
}

store::TaskRow Row(int64_t id, const char* kind, store::TaskState state) {
  store::TaskRow t;
  t.id = id;
  t.stage_kind = kind;
  t.state = state;
  return t;
}

// One host batch of `sequences` x 2 tokens (hc_mult 1, hidden 2) whose values start at `first`.
calibration::BatchActivations HostBatch(int64_t sequences, float first) {
  calibration::BatchActivations b;
  b.host.sequences = sequences;
  b.host.seq_len = 2;
  b.host.hc_mult = 1;
  b.host.hidden_size = 2;
  b.host.token_ids.assign(static_cast<size_t>(sequences * 2), 7);
  for (int64_t i = 0; i < sequences * 4; ++i) b.host.streams.push_back(first + i);
  b.tokens = b.host.tokens();
  return b;
}

// The evaluate tasks of a 3-layer model as stored (ids 10.. in plan order), every one `state`.
std::vector<store::TaskRow> EvaluateRows(store::TaskState state) {
  std::vector<store::TaskRow> rows;
  EvaluateTask t;
  t.layers = 3;
  t.max_samples = 2;
  t.max_tokens = 4;
  for (int64_t l = 0; l < 5; ++l) {
    t.kind = l < 3 ? EvaluateTask::Kind::kLayer
                   : (l == 3 ? EvaluateTask::Kind::kHead : EvaluateTask::Kind::kGate);
    t.layer = l < 3 ? l : 0;
    store::TaskRow row = Row(10 + l, "evaluate", state);
    row.name = t.Name();
    row.payload_json = ToJson(t);
    rows.push_back(row);
  }
  return rows;
}

class EvaluateResumeTest : public testing::Test {
 protected:
  void SetUp() override { work_ = testing_util::TestDir(); }

  std::unique_ptr<evaluation::JobEvaluation> NewJob(int64_t checkpoint_seconds = 0) {
    auto job = evaluation::JobEvaluation::Create(work_.string(), checkpoint_seconds);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? std::move(*job) : nullptr;
  }

  // Runs layer `layer` of `job` as its task does (outputs valued from `first`) and records the
  // checkpoint it wrote as the task's output in `row`.
  void PutLayer(evaluation::JobEvaluation& job, int64_t layer, float first,
                store::TaskRow& row) {
    auto file = job.PutOutput(layer, {HostBatch(2, first), HostBatch(1, first + 100)},
                              {HostBatch(2, first + 200), HostBatch(1, first + 300)});
    ASSERT_TRUE(file.ok()) << file.status();
    ASSERT_TRUE(file->has_value());
    row.output_path = (*file)->path;
    row.output_bytes = static_cast<int64_t>((*file)->bytes);
    row.output_sha256 = (*file)->sha256;
    job.OnTaskDone(row, row.output_path, std::nullopt, std::nullopt);
  }

  std::filesystem::path work_;
};

TEST_F(EvaluateResumeTest, ResumesAfterTheLastCheckpointedLayerWithBothModelsOutputs) {
  std::vector<store::TaskRow> rows = EvaluateRows(store::TaskState::kPending);
  {
    std::unique_ptr<evaluation::JobEvaluation> job = NewJob();
    for (int64_t l = 0; l < 2; ++l) {
      rows[l].state = store::TaskState::kDone;
      PutLayer(*job, l, 1000.0f * l, rows[l]);
    }
  }
  // Only layer 1's checkpoint is kept (layer 0's went at layer 1's boundary).
  EXPECT_FALSE(std::filesystem::exists(rows[0].output_path));
  std::unique_ptr<evaluation::JobEvaluation> job = NewJob();
  const calibration::ResumePoint point = job->Resume(rows);
  EXPECT_FALSE(point.finished);
  EXPECT_EQ(point.layer, 1);
  EXPECT_TRUE(point.requeue.empty());
  EXPECT_TRUE(point.rejected.empty());
  const std::optional<evaluation::EvaluationBatches> out = job->Output(1);
  ASSERT_TRUE(out.has_value());
  ASSERT_EQ(out->source->size(), 2u);
  ASSERT_EQ(out->quantized->size(), 2u);
  EXPECT_TRUE((*out->source)[0].spill_path.empty());  // in host memory, as the next layer needs
  EXPECT_EQ((*out->source)[0].host.streams, HostBatch(2, 1000).host.streams);
  EXPECT_EQ((*out->source)[1].host.streams, HostBatch(1, 1100).host.streams);
  EXPECT_EQ((*out->quantized)[0].host.streams, HostBatch(2, 1200).host.streams);
  EXPECT_EQ((*out->quantized)[1].host.streams, HostBatch(1, 1300).host.streams);
  EXPECT_EQ((*out->quantized)[1].host.token_ids, HostBatch(1, 1300).host.token_ids);
  EXPECT_EQ(out->tokens(), 6);
}

TEST_F(EvaluateResumeTest, EveryLayerDoneAndTheHeadNotResumesAfterTheLastLayer) {
  std::vector<store::TaskRow> rows = EvaluateRows(store::TaskState::kPending);
  {
    std::unique_ptr<evaluation::JobEvaluation> job = NewJob();
    for (int64_t l = 0; l < 3; ++l) {
      rows[l].state = store::TaskState::kDone;
      PutLayer(*job, l, 10.0f * l, rows[l]);
    }
  }
  std::unique_ptr<evaluation::JobEvaluation> job = NewJob();
  EXPECT_EQ(job->Resume(rows).layer, 2);
  EXPECT_TRUE(job->Output(2).has_value());

  // The head done, the gate not: the head runs again on layer 2's outputs (its figures were in
  // the process that stopped).
  rows[3].state = store::TaskState::kDone;
  std::unique_ptr<evaluation::JobEvaluation> again = NewJob();
  const calibration::ResumePoint point = again->Resume(rows);
  EXPECT_EQ(point.layer, 2);
  EXPECT_EQ(point.requeue, (std::vector<int64_t>{13}));

  // Every task done: finished, every checkpoint removed.
  rows[4].state = store::TaskState::kDone;
  std::unique_ptr<evaluation::JobEvaluation> done = NewJob();
  EXPECT_TRUE(done->Resume(rows).finished);
  EXPECT_TRUE(std::filesystem::is_empty(done->checkpoints().dir()));
}

TEST_F(EvaluateResumeTest, ACorruptCheckpointIsNeverTrusted) {
  std::vector<store::TaskRow> rows = EvaluateRows(store::TaskState::kPending);
  {
    std::unique_ptr<evaluation::JobEvaluation> job = NewJob();
    for (int64_t l = 0; l < 2; ++l) {
      rows[l].state = store::TaskState::kDone;
      PutLayer(*job, l, 1.0f, rows[l]);
    }
  }
  // A manifest of the same size but another content: its SHA-256 no longer matches.
  std::string text;
  {
    std::ifstream in(rows[1].output_path);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  text[text.find("\"slice\":0")] = ' ';
  {
    std::ofstream out(rows[1].output_path, std::ios::trunc);
    out << text;
  }
  std::unique_ptr<evaluation::JobEvaluation> job = NewJob();
  const calibration::ResumePoint point = job->Resume(rows);
  EXPECT_EQ(point.layer, -1);  // layer 0's checkpoint was removed at layer 1's boundary
  EXPECT_EQ(point.requeue, (std::vector<int64_t>{10, 11}));
  // Layer 1 corrupt, then layer 0 gone (removed on purpose at layer 1's boundary).
  ASSERT_EQ(point.rejected.size(), 2u);
  EXPECT_EQ(point.rejected[0], "layer 1 slice 0: checkpoint not used: " + rows[1].output_path +
                                   " does not have the recorded SHA-256");
  EXPECT_EQ(point.rejected[1],
            "layer 0 slice 0: checkpoint not used: " + rows[0].output_path + " is gone");
  EXPECT_FALSE(job->Output(1).has_value());
  EXPECT_TRUE(std::filesystem::is_empty(job->checkpoints().dir()));
}

TEST_F(EvaluateResumeTest, WithoutACheckpointTheStageRunsAgainFromLayer0) {
  std::vector<store::TaskRow> rows = EvaluateRows(store::TaskState::kPending);
  {
    // A clock that never reaches the next boundary: nothing is checkpointed.
    std::unique_ptr<evaluation::JobEvaluation> job = NewJob(/*checkpoint_seconds=*/300);
    rows[0].state = store::TaskState::kDone;
    auto file = job->PutOutput(0, {HostBatch(1, 0)}, {HostBatch(1, 1)});
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_FALSE(file->has_value());
  }
  std::unique_ptr<evaluation::JobEvaluation> job = NewJob();
  const calibration::ResumePoint point = job->Resume(rows);
  EXPECT_EQ(point.layer, -1);
  EXPECT_EQ(point.requeue, (std::vector<int64_t>{10}));
  EXPECT_TRUE(point.rejected.empty());
}

TEST(EvaluationReportTest, LayersAndFiguresFromTheRecordedRows) {
  v1::JobReport report;
  report.add_layers()->set_layer(1);  // calibration gave layer 1 only
  report.mutable_layers(0)->set_calibrated_tokens(96);
  const double inf = std::numeric_limits<double>::infinity();
  // Layer 0: 20 dB teacher-forced; layer 1 identical (+inf); layer 2: 10 dB.
  const std::vector<store::EvaluationLayerRow> layers = {
      {0, 100.0, 10.0, 100.0, 1.0, 0.5}, {1, 4.0, 0.0, 4.0, 0.0, 0.5},
      {2, 100.0, 100.0, 100.0, 10.0, 0.5}};
  scheduler::AddEvaluation(layers, std::nullopt, 0, &report);
  EXPECT_FALSE(report.has_evaluation());
  ASSERT_EQ(report.layers_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(report.layers(i).layer(), i);
    EXPECT_TRUE(report.layers(i).evaluated());
  }
  EXPECT_EQ(report.layers(1).calibrated_tokens(), 96);
  EXPECT_DOUBLE_EQ(report.layers(0).free_running_sqnr_db(), 10.0);
  EXPECT_DOUBLE_EQ(report.layers(0).teacher_forced_sqnr_db(), 20.0);
  EXPECT_EQ(report.layers(1).teacher_forced_sqnr_db(), inf);
  EXPECT_DOUBLE_EQ(report.layers(2).free_running_sqnr_db(), 0.0);

  store::EvaluationRow figures;
  figures.samples = 4;
  figures.tokens = 190;
  figures.numerics = "official";
  figures.positions = 190;
  figures.mean_kl = 0.25;
  figures.top1_agreement = 0.5;
  figures.ppl_ratio = 1.5;
  figures.gate_passed = false;
  figures.gate_message = "quality gate: mean_kl 0.25 > max_mean_kl 0.1";
  figures.seconds = 3;
  v1::JobReport with;
  scheduler::AddEvaluation(layers, figures, 6, &with);
  ASSERT_TRUE(with.has_evaluation());
  const v1::EvaluationReport& e = with.evaluation();
  EXPECT_EQ(e.samples(), 4);
  EXPECT_EQ(e.tokens(), 190);
  EXPECT_EQ(e.mean_kl(), 0.25);
  EXPECT_EQ(e.top1_agreement(), 0.5);
  EXPECT_EQ(e.ppl_ratio(), 1.5);
  EXPECT_FALSE(e.gate_passed());
  EXPECT_EQ(e.gate_message(), figures.gate_message);
  // Lowest teacher-forced SQNR first; the identical layer is never among them.
  EXPECT_EQ(std::vector<int64_t>(e.worst_layers().begin(), e.worst_layers().end()),
            (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(e.seconds(), 3);
  EXPECT_EQ(e.calibration_seconds(), 6);
}

TEST(EvaluateStageInterfaceTest, ProgressOutputsAndAnEarlierReleasesPlan) {
  const EvaluateStage stage;
  EvaluateTask t;
  t.layers = 3;
  t.max_samples = 4;
  t.max_tokens = 190;
  store::TaskRow layer;
  layer.stage_kind = "evaluate";
  layer.name = "layer1";
  layer.label = "layer 2 of 3";
  t.layer = 1;
  layer.payload_json = ToJson(t);
  store::TaskRow head = layer;
  head.name = "head";
  head.label = "head: next-token figures";
  t.kind = EvaluateTask::Kind::kHead;
  head.payload_json = ToJson(t);

  EXPECT_EQ(stage.progress_unit(), "tokens");
  // One task runs at a time: its label.
  EXPECT_EQ(stage.ProgressStep({&layer}), "layer 2 of 3");
  EXPECT_EQ(stage.ProgressStep({}), "");
  EXPECT_TRUE(stage.ChecksOwnOutput(layer));
  EXPECT_FALSE(stage.ChecksOwnOutput(head));

  // A plan stored by a release without the stage keeps it off; one with its tasks, or a spec
  // that says, is left as it is.
  store::TaskRow quantize;
  quantize.stage_kind = "quantize";
  JobSpec spec;
  stage.AdaptSpec({quantize}, spec);
  EXPECT_EQ(spec.evaluate.enabled, false);
  spec.evaluate.enabled.reset();
  stage.AdaptSpec({quantize, head}, spec);
  EXPECT_FALSE(spec.evaluate.enabled.has_value());
  spec.evaluate.enabled = true;
  stage.AdaptSpec({quantize}, spec);
  EXPECT_EQ(spec.evaluate.enabled, true);
}

}  // namespace
}  // namespace quantd::pipeline
