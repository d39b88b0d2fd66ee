// The evaluate stage's plan on the tiny V4 fixture calibrating on the built-in text: one task per
// decoder layer in a chain after export and every verify task, then head and gate; on by default,
// off with evaluate.enabled false; the default sample count clamped to what the data holds; too
// few samples refused at planning. Also its task payloads, where a restart resumes it, and the
// report fields built from its recorded figures.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "server/evaluation/evaluate_task.h"
#include "server/fixture/fixture.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/stage_registry.h"
#include "server/pipeline/stages/evaluate_stage.h"
#include "server/pipeline/tensor_inventory.h"
#include "server/scheduler/evaluation_report.h"
#include "tests/unit/test_dirs.h"

namespace quantd::pipeline {
namespace {

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
  absl::StatusOr<Plan> PlanWith(const std::string& extra, int64_t calibration_samples = 40) {
    auto spec = ParseJobSpec(
        "{\"source\": \"" + dir_.string() + "\", \"output\": \"" + dir_.string() +
            "-out\", \"calibration\": {\"datasets\": [{\"path\": \"" + kData +
            "\", \"samples\": " + std::to_string(calibration_samples) +
            "}], \"seq_len\": 48, \"min_seq_len\": 16}" + extra + "}",
        "test");
    if (!spec.ok()) return spec.status();
    return BuildPlan(*spec, *source_, inventory_, BuiltinStages());
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
  // The 4 lines calibration leaves (the default 32 clamped), all of them tokens: every layer and
  // the head move every held-out token, the gate none.
  absl::StatusOr<EvaluateTask> head = evaluation::ParseEvaluateTask(t[3].payload_json);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->samples, 4);
  EXPECT_EQ(head->layers, 3);
  EXPECT_GT(head->tokens, 4 * 16);
  EXPECT_LE(head->tokens, 4 * 48);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(t[i].bytes_total, head->tokens) << i;
  EXPECT_EQ(t[4].bytes_total, 0);
}

TEST_F(EvaluatePlanTest, ExplicitSampleCountIsKeptOrRefusedNamingTheFile) {
  absl::StatusOr<Plan> two = PlanWith(", \"evaluate\": {\"num_samples\": 2}");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(evaluation::ParseEvaluateTask(StageOf(*two, "evaluate")->tasks[0].payload_json)->samples,
            2);
  absl::StatusOr<Plan> five = PlanWith(", \"evaluate\": {\"num_samples\": 5}");
  EXPECT_EQ(five.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(five.status().message(),
            "evaluate.num_samples 5 asks 5 of " + kData +
                " has 44 lines; calibration takes 40 of them and 0 are shorter than min_seq_len "
                "= 16, which leaves 4 usable held-out samples: lower evaluate.num_samples, add "
                "lines, calibrate on fewer samples, or set evaluate.enabled to false");
  // Calibration takes every line: nothing is held out, whatever the count.
  absl::StatusOr<Plan> none = PlanWith("", 44);
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
  t.samples = 4;
  t.tokens = 190;
  EXPECT_EQ(t.Name(), "layer2");
  EXPECT_EQ(ToJson(t), R"({"kind":"layer","layer":2,"layers":3,"samples":4,"tokens":190})");
  absl::StatusOr<EvaluateTask> back = evaluation::ParseEvaluateTask(ToJson(t));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->layer, 2);
  EXPECT_EQ(back->tokens, 190);
  t.kind = EvaluateTask::Kind::kGate;
  EXPECT_EQ(t.Name(), "gate");
  EXPECT_EQ(evaluation::ParseEvaluateTask(ToJson(t))->kind, EvaluateTask::Kind::kGate);
  EXPECT_EQ(evaluation::ParseEvaluateTask(R"({"kind":"layer","layer":3,"layers":3,"samples":4,)"
                                          R"("tokens":1})")
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

TEST(EvaluateTasksToRedoTest, EveryDoneTaskWhileTheStageIsUnfinished) {
  using store::TaskState;
  const std::vector<store::TaskRow> unfinished = {
      Row(1, "export", TaskState::kDone), Row(2, "evaluate", TaskState::kDone),
      Row(3, "evaluate", TaskState::kDone), Row(4, "evaluate", TaskState::kPending),
      Row(5, "evaluate", TaskState::kFailed)};
  EXPECT_EQ(EvaluateTasksToRedo(unfinished), (std::vector<int64_t>{2, 3}));
  const std::vector<store::TaskRow> finished = {Row(1, "export", TaskState::kPending),
                                                Row(2, "evaluate", TaskState::kDone)};
  EXPECT_TRUE(EvaluateTasksToRedo(finished).empty());
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

}  // namespace
}  // namespace quantd::pipeline
