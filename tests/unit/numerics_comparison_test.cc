// The official-vs-math comparison of a report: relative amax differences per layer and over the
// job from the two jobs' rows, which jobs count as the same calibration in the other mode, and the
// peer found in a store (the latest whose calibrate stage finished).
#include "server/scheduler/numerics_comparison.h"

#include <google/protobuf/text_format.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "server/calibration/calibrate_task.h"
#include "server/pipeline/stages/calibrate_stage.h"
#include "server/scheduler/calibration_report.h"
#include "tests/unit/test_dirs.h"

namespace quantd::scheduler {
namespace {

using job::CalibrationNumerics;
using store::AmaxRow;

// The official job's rows, and the math job's rows for the same modules.
const std::vector<AmaxRow> kOfficial = {
    {"head", "input", 1.5, 64},
    {"layers.0.attn.wq_a", "input", 2.25, 64},
    {"layers.0.ffn.experts.1.w2", "input", 0.75, 8},
    {"layers.0.attn.kv", "kv", 9.0, 64},            // not an input: not compared
    {"layers.1.attn.wq_a", "input", 4.5, 64},
    {"layers.1.ffn.experts.2.w1", "input", 0.0, 0},
    {"layers.1.ffn.experts.3.w1", "input", 1.0, 4},  // no math row: not compared
};
const std::vector<AmaxRow> kMath = {
    {"head", "input", 1.0, 64},
    {"layers.0.attn.wq_a", "input", 2.0, 64},
    {"layers.0.ffn.experts.1.w2", "input", 1.0, 8},
    {"layers.0.attn.kv", "kv", 1.0, 64},
    {"layers.1.attn.wq_a", "input", 4.0, 64},
    {"layers.1.ffn.experts.2.w1", "input", 0.0, 0},
};

// Only the comparison's fields of a report.
v1::JobReport Comparison(const v1::JobReport& report) {
  v1::JobReport out;
  out.set_numerics_peer_job(report.numerics_peer_job());
  out.set_numerics_peer(report.numerics_peer());
  out.set_numerics_compared_modules(report.numerics_compared_modules());
  out.set_numerics_max_rel_diff(report.numerics_max_rel_diff());
  out.set_numerics_max_rel_diff_module(report.numerics_max_rel_diff_module());
  for (const v1::LayerReport& l : report.layers()) {
    v1::LayerReport* o = out.add_layers();
    o->set_layer(l.layer());
    o->set_numerics_compared(l.numerics_compared());
    o->set_numerics_compared_modules(l.numerics_compared_modules());
    o->set_numerics_max_rel_diff(l.numerics_max_rel_diff());
    o->set_numerics_max_rel_diff_module(l.numerics_max_rel_diff_module());
  }
  return out;
}

void ExpectComparison(const v1::JobReport& got, const std::string& expected) {
  v1::JobReport want;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(expected, &want)) << expected;
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(Comparison(got), want))
      << "got:\n" << Comparison(got).DebugString();
}

// |2.25 - 2| / 2 = 0.125, |0.75 - 1| / 1 = 0.25, |4.5 - 4| / 4 = 0.125, 0 / 0 counts 0,
// |1.5 - 1| / 1 = 0.5 (head: in no layer).
constexpr char kExpected[] = R"pb(
  numerics_peer_job: 4
  numerics_compared_modules: 5
  numerics_max_rel_diff: 0.5
  numerics_max_rel_diff_module: "head"
  layers { layer: 0 numerics_compared: true numerics_compared_modules: 2
           numerics_max_rel_diff: 0.25 numerics_max_rel_diff_module: "ffn.experts.1.w2" }
  layers { layer: 1 numerics_compared: true numerics_compared_modules: 2
           numerics_max_rel_diff: 0.125 numerics_max_rel_diff_module: "attn.wq_a" }
)pb";

TEST(NumericsComparisonTest, RelativeDifferencesPerLayerAndOverTheJob) {
  v1::JobReport official;
  AddLayerCalibration(kOfficial, {}, &official);
  AddNumericsComparison(kOfficial, CalibrationNumerics::kOfficial, 4, kMath, &official);
  ExpectComparison(official, std::string(kExpected) + R"pb(numerics_peer: "math")pb");

  // The math job's report shows the same figures: a_math is the denominator either way.
  v1::JobReport math;
  AddLayerCalibration(kMath, {}, &math);
  AddNumericsComparison(kMath, CalibrationNumerics::kMath, 4, kOfficial, &math);
  ExpectComparison(math, std::string(kExpected) + R"pb(numerics_peer: "official")pb");
}

TEST(NumericsComparisonTest, AmaxThatIsZeroOnlyInMathIsInfinitelyFar) {
  const std::vector<AmaxRow> official = {{"layers.2.ffn.experts.0.w1", "input", 0.5, 1}};
  const std::vector<AmaxRow> math = {{"layers.2.ffn.experts.0.w1", "input", 0.0, 1}};
  v1::JobReport report;
  AddLayerCalibration(official, {}, &report);
  AddNumericsComparison(official, CalibrationNumerics::kOfficial, 1, math, &report);
  EXPECT_EQ(report.numerics_max_rel_diff(), std::numeric_limits<double>::infinity());
  ASSERT_EQ(report.layers_size(), 1);
  EXPECT_EQ(report.layers(0).numerics_max_rel_diff(), std::numeric_limits<double>::infinity());
}

job::JobSpec Spec(const std::string& calibration) {
  absl::StatusOr<job::JobSpec> spec = job::ParseJobSpec(
      R"({"source": "/models/v4", "output": "/out", "calibration": {)" + calibration + "}}",
      "test");
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

constexpr char kData[] = R"("datasets": [{"path": "/cal/a.jsonl", "samples": 8}], "seed": 3)";

TEST(NumericsComparisonTest, SameCalibrationOtherNumerics) {
  const job::JobSpec official = Spec(kData);
  const job::JobSpec math = Spec(std::string(kData) + R"(, "numerics": "math")");
  EXPECT_TRUE(SameCalibrationOtherNumerics(official, math));
  EXPECT_TRUE(SameCalibrationOtherNumerics(math, official));
  EXPECT_FALSE(SameCalibrationOtherNumerics(official, official));
  // Export choices do not matter; the data, the source and the mode do.
  EXPECT_TRUE(SameCalibrationOtherNumerics(
      official, Spec(std::string(kData) + R"(, "numerics": "math", "w2_input": "weighted")")));
  for (const std::string& other :
       {std::string(R"("datasets": [{"path": "/cal/a.jsonl", "samples": 9}], "seed": 3)"),
        std::string(R"("datasets": [{"path": "/cal/b.jsonl", "samples": 8}], "seed": 3)"),
        std::string(R"("datasets": [{"path": "/cal/a.jsonl", "samples": 8}], "seed": 4)"),
        std::string(kData) + R"(, "seq_len": 256)", std::string(kData) + R"(, "add_bos": false)",
        std::string(kData) + R"(, "min_seq_len": 4)",
        std::string(kData) + R"(, "calibrate_all_experts": true)",
        std::string(kData) + R"(, "mode": "constant")"}) {
    EXPECT_FALSE(
        SameCalibrationOtherNumerics(official, Spec(other + R"(, "numerics": "math")")))
        << other;
  }
  job::JobSpec elsewhere = math;
  elsewhere.source = "/models/other";
  EXPECT_FALSE(SameCalibrationOtherNumerics(official, elsewhere));
}

class NumericsComparisonStoreTest : public testing_util::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    auto store = store::JobStore::Open(dir_ + "/quantd.db");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }

  // A job of `calibration` whose calibrate stage plans `layers` decoder layers (one task, layer
  // 0), finished when `calibrated`, with `rows` as its amax.
  int64_t AddJob(const std::string& calibration, int64_t layers, bool calibrated,
                 const std::vector<AmaxRow>& rows) {
    const std::string spec = job::JobSpecToJson(Spec(calibration));
    absl::StatusOr<int64_t> id = store_->CreateJob("", spec, ++now_);
    EXPECT_TRUE(id.ok()) << id.status();
    calibration::CalibrateTask task;
    task.layers = layers;
    store::TaskPlan plan;
    plan.name = task.Name();
    plan.payload_json = calibration::ToJson(task);
    plan.bytes_total = 1;
    EXPECT_TRUE(store_->SetPlan(*id, {store::StagePlan{std::string(pipeline::CalibrateStage::kKind), {plan}}}).ok());
    if (calibrated) {
      store::TaskLease lease;
      auto leased = store_->LeaseNextTask(*id, "test", ++now_, 1000, &lease);
      EXPECT_TRUE(leased.ok() && leased->has_value());
      EXPECT_TRUE(store_->CompleteTask(lease, "", 0, "", ++now_).ok());
    }
    EXPECT_TRUE(store_->MergeAmax(*id, rows).ok());
    return *id;
  }

  // The comparison in the report of job `id`.
  v1::JobReport Report(int64_t id) {
    absl::StatusOr<store::JobRow> row = store_->GetJob(id);
    EXPECT_TRUE(row.ok()) << row.status();
    absl::StatusOr<job::JobSpec> spec = job::ParseJobSpec(row->spec_json, "stored");
    EXPECT_TRUE(spec.ok()) << spec.status();
    absl::StatusOr<std::vector<AmaxRow>> amax = store_->ListAmax(id);
    absl::StatusOr<std::vector<store::TaskRow>> tasks = store_->ListTasks(id);
    EXPECT_TRUE(amax.ok() && tasks.ok());
    v1::JobReport report;
    AddLayerCalibration(*amax, *tasks, &report);
    EXPECT_TRUE(AddNumericsComparisonFromStore(*store_, id, *spec, *amax, *tasks, &report).ok());
    return report;
  }

  std::unique_ptr<store::JobStore> store_;
  int64_t now_ = 0;
};

TEST_F(NumericsComparisonStoreTest, ThePeerIsTheLatestFinishedCalibrationInTheOtherMode) {
  const std::string math = std::string(kData) + R"(, "numerics": "math")";
  const int64_t official = AddJob(kData, 2, true, kOfficial);
  const int64_t peer = AddJob(math, 2, true, kMath);
  AddJob(std::string(kData) + R"(, "seed": 5, "numerics": "math")", 2, true, kOfficial);
  AddJob(math, 3, true, kOfficial);   // another source behind the same path: 3 layers
  AddJob(math, 2, false, kOfficial);  // still calibrating
  AddJob(kData, 2, true, kOfficial);  // the same mode

  v1::JobReport report = Report(official);
  EXPECT_EQ(report.numerics_peer_job(), peer);
  EXPECT_EQ(report.numerics_peer(), "math");
  EXPECT_EQ(report.numerics_compared_modules(), 5);
  EXPECT_EQ(report.numerics_max_rel_diff(), 0.5);
  EXPECT_EQ(report.numerics_max_rel_diff_module(), "head");

  // The math job's peer is the latest official one that finished: the last job.
  report = Report(peer);
  EXPECT_EQ(report.numerics_peer_job(), peer + 4);
  EXPECT_EQ(report.numerics_peer(), "official");
  EXPECT_EQ(report.numerics_max_rel_diff(), 0.5);

  // Without a finished peer: no comparison.
  const int64_t alone = AddJob(std::string(kData) + R"(, "seed": 9)", 2, true, kOfficial);
  report = Report(alone);
  EXPECT_EQ(report.numerics_peer_job(), 0);
  EXPECT_EQ(report.numerics_peer(), "");
  EXPECT_FALSE(report.layers(0).numerics_compared());
}

}  // namespace
}  // namespace quantd::scheduler
