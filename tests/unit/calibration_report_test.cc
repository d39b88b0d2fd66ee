// The per-layer calibration figures of a JobReport from a job's amax rows and quantize tasks: min /
// median / max over routed experts, single values for every other module, weighted and unweighted
// w2, uncalibrated experts (no token, or no row for an expert the plan quantizes) and calibrated
// tokens; rows as the store merges them (max of values, sum of tokens).
#include "server/scheduler/calibration_report.h"

#include <google/protobuf/text_format.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/pipeline/plan.h"
#include "tests/unit/test_dirs.h"

namespace quantd::scheduler {
namespace {

using store::AmaxRow;

v1::JobReport Parse(const std::string& text) {
  v1::JobReport report;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &report)) << text;
  return report;
}

void ExpectReport(const v1::JobReport& got, const std::string& expected) {
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(got, Parse(expected)))
      << "got:\n" << got.DebugString() << "expected:\n" << Parse(expected).DebugString();
}

TEST(CalibrationReportTest, SummarisesEachLayer) {
  const std::vector<AmaxRow> rows = {
      // Layer 10 comes after layer 2: layers are ordered by number, not by name.
      {"layers.10.attn.wq_a", "input", 7.0, 96},
      {"layers.2.attn.wq_a", "input", 3.25, 96},
      {"layers.2.attn.wkv", "input", 3.25, 96},
      // A compressor sees fewer rows: the layer's tokens are the most any module saw.
      {"layers.2.attn.compressor.wkv", "input", 1.0, 24},
      {"layers.2.ffn.shared_experts.w1", "input", 1.5, 96},
      // Four routed experts; expert 3 got no token (its values filled in by the export).
      {"layers.2.ffn.experts.0.w1", "input", 0.5, 40},
      {"layers.2.ffn.experts.1.w1", "input", 2.5, 100},
      {"layers.2.ffn.experts.2.w1", "input", 1.0, 52},
      {"layers.2.ffn.experts.3.w1", "input", 2.5, 0},
      {"layers.2.ffn.experts.0.w2", "input", 0.25, 40},
      {"layers.2.ffn.experts.1.w2", "input", 0.75, 100},
      {"layers.2.ffn.experts.2.w2", "input", 0.5, 52},
      {"layers.2.ffn.experts.0.w2.unweighted", "input", 4.0, 40},
      {"layers.2.ffn.experts.1.w2.unweighted", "input", 6.0, 100},
      {"layers.2.ffn.experts.2.w2.unweighted", "input", 5.0, 52},
      // Not summarised: other kinds, modules outside the decoder layers, malformed names.
      {"layers.2.attn.kv", "kv", 9.0, 96},
      {"head", "input", 9.0, 96},
      {"mtp.0.ffn.experts.0.w1", "input", 9.0, 96},
      {"layers.x.attn.wq_a", "input", 9.0, 96},
      {"layers.2", "input", 9.0, 96},
  };
  v1::JobReport report;
  // The plan quantizes experts 0-5 of layer 2: 4 and 5 have no row (no token reached them).
  pipeline::ShardTask shard;
  shard.shard = "model-00001-of-00001.safetensors";
  for (int e = 0; e < 6; ++e) {
    shard.modules.push_back(absl::StrCat("layers.2.ffn.experts.", e, ".w1"));
  }
  shard.modules.push_back("layers.2.attn.wq_a");
  shard.modules.push_back("layers.7.ffn.experts.0.w1");  // a layer without rows is not reported
  store::TaskRow quantize;
  quantize.stage_kind = "quantize";
  quantize.payload_json = pipeline::ToJson(shard);
  store::TaskRow verify = quantize;  // other stages' payloads are not read
  verify.stage_kind = "verify";
  verify.payload_json = R"({"shard": "x", "modules": ["layers.2.ffn.experts.9.w1"]})";
  AddLayerCalibration(rows, {quantize, verify}, &report);
  ExpectReport(report, R"pb(
    layers {
      layer: 2
      projections { projection: "attn.compressor.wkv" modules: 1
                    min_amax: 1 median_amax: 1 max_amax: 1 }
      projections { projection: "attn.wkv" modules: 1
                    min_amax: 3.25 median_amax: 3.25 max_amax: 3.25 }
      projections { projection: "attn.wq_a" modules: 1
                    min_amax: 3.25 median_amax: 3.25 max_amax: 3.25 }
      projections { projection: "ffn.experts.w1" modules: 4
                    min_amax: 0.5 median_amax: 1.75 max_amax: 2.5 }
      projections { projection: "ffn.experts.w2" modules: 3
                    min_amax: 0.25 median_amax: 0.5 max_amax: 0.75 }
      projections { projection: "ffn.experts.w2.unweighted" modules: 3
                    min_amax: 4 median_amax: 5 max_amax: 6 }
      projections { projection: "ffn.shared_experts.w1" modules: 1
                    min_amax: 1.5 median_amax: 1.5 max_amax: 1.5 }
      token_counts: true
      calibrated_tokens: 96
      routed_experts: 6
      uncalibrated_experts: 3
    }
    layers {
      layer: 10
      projections { projection: "attn.wq_a" modules: 1
                    min_amax: 7 median_amax: 7 max_amax: 7 }
      token_counts: true
      calibrated_tokens: 96
    }
  )pb");
}

TEST(CalibrationReportTest, AmaxFileRowsCountNoTokens) {
  // calibration.amax_file rows carry no token counts: only a quantized expert the file does not
  // name (expert 2) is filled in.
  pipeline::ShardTask shard;
  shard.shard = "model-00001-of-00001.safetensors";
  shard.modules = {"layers.0.ffn.experts.0.w1", "layers.0.ffn.experts.1.w1",
                   "layers.0.ffn.experts.2.w1"};
  store::TaskRow quantize;
  quantize.stage_kind = "quantize";
  quantize.payload_json = pipeline::ToJson(shard);
  v1::JobReport report;
  AddLayerCalibration({{"layers.0.ffn.experts.0.w1", "input", 0.5, 0},
                       {"layers.0.ffn.experts.1.w1", "input", 0.75, 0}},
                      {quantize}, &report);
  ExpectReport(report, R"pb(
    layers {
      layer: 0
      projections { projection: "ffn.experts.w1" modules: 2
                    min_amax: 0.5 median_amax: 0.625 max_amax: 0.75 }
      routed_experts: 3
      uncalibrated_experts: 1
    }
  )pb");
  v1::JobReport empty;
  AddLayerCalibration({}, {quantize}, &empty);
  EXPECT_EQ(empty.layers_size(), 0);
}

class CalibrationReportStoreTest : public testing_util::TempDirTest {};

TEST_F(CalibrationReportStoreTest, SlicesMergedByTheStoreAddUpTheirTokens) {
  auto store = store::JobStore::Open(dir_ + "/quantd.db");
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<int64_t> job = (*store)->CreateJob("", R"({"source":"/s","output":"/o"})", 0);
  ASSERT_TRUE(job.ok()) << job.status();
  // Two sample slices of layer 0: amax is their max, tokens their sum.
  ASSERT_TRUE((*store)
                  ->MergeAmax(*job, {{"layers.0.attn.wq_a", "input", 2.0, 30},
                                     {"layers.0.ffn.experts.0.w1", "input", 1.0, 10},
                                     {"layers.0.ffn.experts.1.w1", "input", 0.0, 0}})
                  .ok());
  ASSERT_TRUE((*store)
                  ->MergeAmax(*job, {{"layers.0.attn.wq_a", "input", 3.0, 34},
                                     {"layers.0.ffn.experts.0.w1", "input", 0.5, 6},
                                     {"layers.0.ffn.experts.1.w1", "input", 0.0, 0}})
                  .ok());
  absl::StatusOr<std::vector<AmaxRow>> rows = (*store)->ListAmax(*job);
  ASSERT_TRUE(rows.ok()) << rows.status();
  v1::JobReport report;
  AddLayerCalibration(*rows, {}, &report);
  ExpectReport(report, R"pb(
    layers {
      layer: 0
      projections { projection: "attn.wq_a" modules: 1
                    min_amax: 3 median_amax: 3 max_amax: 3 }
      projections { projection: "ffn.experts.w1" modules: 2
                    min_amax: 0 median_amax: 0.5 max_amax: 1 }
      token_counts: true
      calibrated_tokens: 64
      routed_experts: 2
      uncalibrated_experts: 1
    }
  )pb");
}

}  // namespace
}  // namespace quantd::scheduler
