// server/evaluation: the figures (SQNR, next-token KL / top-1 / perplexity) on inputs whose
// values are known in closed form, the gate's messages, and the held-out selection (disjoint
// from the calibration samples, the same on every call).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "server/calibration/calibration_data.h"
#include "server/evaluation/held_out_samples.h"
#include "server/evaluation/next_token_metrics.h"
#include "server/evaluation/quality_gate.h"
#include "server/evaluation/quality_report.h"
#include "server/evaluation/sqnr.h"
#include "tests/unit/test_dirs.h"

namespace quantd::evaluation {
namespace {

TEST(Sqnr, TenLog10OfSignalOverNoise) {
  const float ref[2] = {3, 4}, x[2] = {3, 3};
  Sqnr s;
  s.Add(ref, x, 2);
  EXPECT_EQ(s.signal, 25.0);
  EXPECT_EQ(s.noise, 1.0);
  EXPECT_DOUBLE_EQ(s.Db(), 10.0 * std::log10(25.0));
  Sqnr same;
  same.Add(ref, ref, 2);
  EXPECT_EQ(same.Db(), std::numeric_limits<double>::infinity());
}

TEST(NextTokenMetrics, KlTop1AndPerplexityInClosedForm) {
  // Vocabulary 2, one sequence of 2 tokens [0, 1]. Source logits: (0, ln 3) -> p = (1/4, 3/4),
  // then (0, 0) -> (1/2, 1/2). Quantized: (0, 0) -> (1/2, 1/2), then (0, 0).
  const float l3 = static_cast<float>(std::log(3.0));
  const float p[4] = {0, l3, 0, 0}, q[4] = {0, 0, 0, 0};
  const int32_t ids[2] = {0, 1};
  NextTokenMetrics m;
  m.AddSequence(p, q, ids, 2, 2);
  const NextTokenQuality r = m.Finish();
  // KL at position 0: 1/4 ln(1/2) + 3/4 ln(3/2); position 1: 0.
  const double kl0 = 0.25 * std::log(0.5) + 0.75 * std::log(1.5);
  EXPECT_EQ(r.positions, 2);
  EXPECT_NEAR(r.mean_kl, kl0 / 2, 1e-7);  // ln 3 is rounded to float: relative 1e-7
  EXPECT_NEAR(r.max_kl, kl0, 1e-7);
  EXPECT_EQ(r.p99_kl, r.max_kl);  // nearest rank ceil(0.99 * 2) = 2: the largest
  // Argmaxes: position 0 source 1, quantized 0 (lowest id among equals); position 1 both 0.
  EXPECT_EQ(r.top1_agreement, 0.5);
  // One prediction (id 1 after position 0): source -ln(3/4), quantized -ln(1/2).
  EXPECT_EQ(r.predicted, 1);
  EXPECT_NEAR(r.source_ppl, 4.0 / 3.0, 1e-6);
  EXPECT_NEAR(r.quantized_ppl, 2.0, 1e-12);
  EXPECT_NEAR(r.ppl_ratio, 1.5, 1e-6);
}

TEST(NextTokenMetrics, IdenticalLogitsGiveExactlyZeroAndOne) {
  std::vector<float> logits(3 * 5);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i));
  const int32_t ids[3] = {4, 2, 0};
  NextTokenMetrics m;
  m.AddSequence(logits.data(), logits.data(), ids, 3, 5);
  const NextTokenQuality r = m.Finish();
  EXPECT_EQ(r.mean_kl, 0.0);
  EXPECT_EQ(r.max_kl, 0.0);
  EXPECT_EQ(r.top1_agreement, 1.0);
  EXPECT_EQ(r.ppl_ratio, 1.0);
}

TEST(NextTokenMetrics, P99IsTheNearestRank) {
  // 200 positions with KL 0 except two: the 198th smallest (ceil(0.99 * 200)) is still 0; with
  // three the 198th is the smallest of them.
  NextTokenMetrics m;
  const float same[2] = {0, 0}, other[2] = {0, 5};
  const int32_t ids[1] = {0};
  for (int i = 0; i < 198; ++i) m.AddSequence(same, same, ids, 1, 2);
  for (int i = 0; i < 2; ++i) m.AddSequence(same, other, ids, 1, 2);
  EXPECT_EQ(m.Finish().p99_kl, 0.0);
  NextTokenMetrics three;
  for (int i = 0; i < 197; ++i) three.AddSequence(same, same, ids, 1, 2);
  for (int i = 0; i < 3; ++i) three.AddSequence(same, other, ids, 1, 2);
  EXPECT_GT(three.Finish().p99_kl, 0.0);
  EXPECT_EQ(three.Finish().p99_kl, three.Finish().max_kl);
}

QualityReport ReportWith(double mean_kl, double top1, double ratio) {
  QualityReport r;
  r.next_token.mean_kl = mean_kl;
  r.next_token.top1_agreement = top1;
  r.next_token.ppl_ratio = ratio;
  const float ref[2] = {3, 4}, close[2] = {3, 3.9f}, far[2] = {3, 3};
  for (int layer = 0; layer < 3; ++layer) {
    LayerQuality l;
    l.layer = layer;
    l.teacher_forced.Add(ref, layer == 1 ? far : close, 2);
    r.layers.push_back(l);
  }
  return r;
}

TEST(QualityGate, NamesEveryBrokenFigureAndTheWorstLayer) {
  job::QualityGate gate;
  gate.max_mean_kl = 0.1;
  gate.min_top1_agreement = 0.9;
  gate.max_ppl_ratio = 1.05;
  EXPECT_TRUE(CheckQualityGate(gate, ReportWith(0.1, 0.9, 1.05)).ok());
  const absl::Status s = CheckQualityGate(gate, ReportWith(0.2, 0.5, 1.5));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "quality gate: mean_kl 0.2 > max_mean_kl 0.1; top1_agreement 0.5 < "
            "min_top1_agreement 0.9; ppl_ratio 1.5 > max_ppl_ratio 1.05; lowest teacher-forced "
            "SQNR at layer 1 (13.98 dB)");
  EXPECT_EQ(BrokenBounds(job::QualityGate{}, ReportWith(9, 0, 9)).size(), 0u);
  // NaN figures never pass a bound.
  EXPECT_FALSE(CheckQualityGate(gate, ReportWith(std::nan(""), 1, 1)).ok());
}

class HeldOutSamplesTest : public testing_util::TempDirTest {};

TEST_F(HeldOutSamplesTest, FollowTheCalibrationSamplesOfEachFile) {
  // input_ids samples: no tokenizer.json is needed, the ids are checked against the model's 1024.
  calibration::CalibrationTokenizer tokenizer(dir_ + "/no-tokenizer");
  constexpr int64_t kVocab = 1024;
  job::CalibrationSpec spec;
  spec.min_seq_len = 1;
  spec.add_bos = false;
  spec.seed = 3;
  for (const char* name : {"a.jsonl", "b.jsonl"}) {
    const std::string path = dir_ + "/" + name;
    std::ofstream f(path);
    for (int i = 0; i < 20; ++i) f << "{\"input_ids\": [" << (name[0] == 'a' ? 100 : 200) + i << "]}\n";
    spec.datasets.push_back({path, 0});
  }
  spec.num_samples = 6;  // 3 per file
  absl::StatusOr<calibration::CalibrationSet> calibration =
      calibration::LoadCalibrationSet(spec, std::nullopt, tokenizer, kVocab);
  ASSERT_TRUE(calibration.ok()) << calibration.status();
  absl::StatusOr<std::vector<std::vector<int32_t>>> held_out =
      LoadHeldOutSamples(spec, std::nullopt, 5, tokenizer, kVocab);  // 3 from a, 2 from b
  ASSERT_TRUE(held_out.ok()) << held_out.status();
  ASSERT_EQ(held_out->size(), 5u);
  std::set<int32_t> calibrated, evaluated;
  for (const auto& s : calibration->samples) calibrated.insert(s.ids[0]);
  for (const auto& s : *held_out) evaluated.insert(s[0]);
  EXPECT_EQ(evaluated.size(), 5u);
  for (int32_t id : evaluated) EXPECT_EQ(calibrated.count(id), 0u) << id;
  EXPECT_EQ(std::count_if(evaluated.begin(), evaluated.end(), [](int32_t id) { return id < 200; }), 3);
  // The next samples of each file's order: the same as a calibration of 3 + 3 and 3 + 2 samples.
  job::CalibrationSpec longer = spec;
  longer.num_samples = 0;
  longer.datasets[0].samples = 6;
  longer.datasets[1].samples = 5;
  absl::StatusOr<calibration::CalibrationSet> both =
      calibration::LoadCalibrationSet(longer, std::nullopt, tokenizer, kVocab);
  ASSERT_TRUE(both.ok()) << both.status();
  const std::vector<int32_t> want = {both->samples[3].ids[0], both->samples[4].ids[0],
                                     both->samples[5].ids[0], both->samples[9].ids[0],
                                     both->samples[10].ids[0]};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ((*held_out)[i][0], want[i]) << i;
  // Too few lines left after the calibration samples: the error names the file.
  absl::StatusOr<std::vector<std::vector<int32_t>>> too_many =
      LoadHeldOutSamples(spec, std::nullopt, 40, tokenizer, kVocab);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("a.jsonl"), std::string::npos) << too_many.status();
  // The default count: 32 (16 per file), or what the files hold when they hold fewer.
  absl::StatusOr<std::vector<std::vector<int32_t>>> all =
      LoadHeldOutSamples(spec, std::nullopt, 0, tokenizer, kVocab);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 32u);
  job::CalibrationSpec most = spec;
  most.num_samples = 37;  // 19 from a, 18 from b: 1 and 2 lines left
  absl::StatusOr<std::vector<std::vector<int32_t>>> few =
      LoadHeldOutSamples(most, std::nullopt, 0, tokenizer, kVocab);
  ASSERT_TRUE(few.ok()) << few.status();
  EXPECT_EQ(few->size(), 3u);
  most.num_samples = 40;  // every line calibrates
  const absl::Status none = LoadHeldOutSamples(most, std::nullopt, 0, tokenizer, kVocab).status();
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(none.message(),
            "evaluate: the calibration data holds no held-out sample (" + dir_ +
                "/a.jsonl has 20 lines; calibration takes 20 of them and 0 are shorter than "
                "min_seq_len = 1, which leaves 0 usable held-out samples; " + dir_ +
                "/b.jsonl has 20 lines; calibration takes 20 of them and 0 are shorter than "
                "min_seq_len = 1, which leaves 0 usable held-out samples): lower "
                "evaluate.num_samples, add lines, calibrate on fewer samples, or set "
                "evaluate.enabled to false");
  // No data set at all.
  EXPECT_EQ(LoadHeldOutSamples(job::CalibrationSpec{}, std::nullopt, 4, tokenizer, kVocab).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace quantd::evaluation
