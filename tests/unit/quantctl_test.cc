// quantctl's pieces without a daemon: the progress view (TTY and plain), the report table, the
// exit codes, the submit spec (file + flags) and the JSON form of a Job.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/exit_codes.h"
#include "client/job_json.h"
#include "client/progress_view.h"
#include "client/report_view.h"
#include "client/spec_flags.h"
#include "client/workers_view.h"
#include "server/job/progress.h"
#include "tests/unit/test_dirs.h"

namespace quantd::client {
namespace {

// A stage line as quantctl draws it.
std::string StageLine(const v1::StageProgress& s) {
  return job::FormatStageLine(s, job::StageLineStyle::kBar);
}

google::protobuf::Timestamp At(int64_t seconds, int32_t nanos = 0) {
  google::protobuf::Timestamp t;
  t.set_seconds(seconds);
  t.set_nanos(nanos);
  return t;
}

// Job 7 in its quantize stage: inspect done, quantize at 140.2 of 805.3 GB, export and verify
// pending (verify counts bytes in MB).
v1::Job RunningJob() {
  v1::Job job;
  job.set_id(7);
  job.set_state(v1::RUNNING);
  job.set_current_stage("quantize");
  v1::StageProgress* inspect = job.add_stages();
  inspect->set_kind("inspect");
  inspect->set_state(v1::StageProgress::SUCCEEDED);
  inspect->set_tasks_done(1);
  inspect->set_tasks_total(1);
  *inspect->mutable_start_time() = At(1000);
  *inspect->mutable_end_time() = At(1002, 400'000'000);
  v1::StageProgress* quantize = job.add_stages();
  quantize->set_kind("quantize");
  quantize->set_state(v1::StageProgress::RUNNING);
  quantize->set_tasks_done(12);
  quantize->set_tasks_total(48);
  quantize->set_bytes_done(140'200'000'000);
  quantize->set_bytes_total(805'300'000'000);
  quantize->set_bytes_per_second(2.31e9);
  quantize->set_eta_seconds(288);
  v1::StageProgress* exp = job.add_stages();
  exp->set_kind("export");
  exp->set_state(v1::StageProgress::PENDING);
  exp->set_tasks_total(4);
  v1::StageProgress* verify = job.add_stages();
  verify->set_kind("verify");
  verify->set_state(v1::StageProgress::PENDING);
  verify->set_tasks_total(4);
  verify->set_bytes_total(12'500'000);
  return job;
}

const char kHeader[] = "job 7 RUNNING";
const char kInspect[] = "inspect    [####################]  1/1 tasks  done in 2s";
// 140.2 / 805.3 of 20 columns = 3.48: three '#'.
const char kQuantize[] =
    "quantize   [###.................]  12/48 tasks  140.2/805.3 GB  2.31 GB/s  ETA 4m48s";
const char kExport[] = "export     [....................]  0/4 tasks";
const char kVerify[] = "verify     [....................]  0/4 tasks  0.0/12.5 MB";

TEST(ProgressViewTest, FormatsHeaderAndStages) {
  v1::Job job = RunningJob();
  EXPECT_EQ(JobLines(job),
            (std::vector<std::string>{kHeader, kInspect, kQuantize, kExport, kVerify}));
  job.set_reason("pausing");
  job.set_task_retries(2);
  job.set_last_error("quantize layers.0: EAGAIN");
  job.mutable_stages(1)->set_state(v1::StageProgress::FAILED);
  job.mutable_stages(1)->clear_eta_seconds();
  EXPECT_EQ(FormatJobHeader(job), "job 7 RUNNING (pausing)  retries 2");
  // Not running: no rate, no ETA.
  EXPECT_EQ(StageLine(job.stages(1)),
            "quantize   [###.................]  12/48 tasks  140.2/805.3 GB  failed");
  EXPECT_EQ(JobLines(job).back(), "last error: quantize layers.0: EAGAIN");
}

TEST(ProgressViewTest, NamesTheWorkersOfAStageThatRemoteWorkersRan) {
  v1::Job job = RunningJob();
  v1::StageWorker* w = job.mutable_stages(0)->add_workers();
  w->set_worker("gpu-a");
  w->set_tasks(1);
  w = job.mutable_stages(1)->add_workers();
  w->set_tasks(2);  // this quantd
  w = job.mutable_stages(1)->add_workers();
  w->set_worker("gpu-b");
  w->set_tasks(10);
  EXPECT_EQ(JobLines(job), (std::vector<std::string>{
                               kHeader, kInspect, "           workers: gpu-a (1)", kQuantize,
                               "           workers: local (2), gpu-b (10)", kExport, kVerify}));
}

// The calibrate stage counts token rows (unit "tokens") and says which layer it calibrates.
TEST(ProgressViewTest, CalibrateShowsLayerAndTokens) {
  v1::StageProgress s;
  s.set_kind("calibrate");
  s.set_unit("tokens");
  s.set_state(v1::StageProgress::RUNNING);
  s.set_step("layer 2 of 3");
  s.set_tasks_done(3);
  s.set_tasks_total(8);
  s.set_bytes_done(1234);
  s.set_bytes_total(3000);
  s.set_bytes_per_second(4100);
  s.set_eta_seconds(3);
  // 1234 / 3000 of 20 columns = 8.2: eight '#'.
  EXPECT_EQ(StageLine(s),
            "calibrate  [########............]  3/8 tasks  layer 2 of 3  1.2k/3.0k tokens  "
            "4.1k tokens/s  ETA 3s");
  // Counts below 1000 without a prefix; the rate takes its own prefix.
  s.set_bytes_done(12);
  s.set_bytes_total(950);
  s.set_bytes_per_second(37.4);
  EXPECT_EQ(StageLine(s),
            "calibrate  [....................]  3/8 tasks  layer 2 of 3  12/950 tokens  "
            "37 tokens/s  ETA 3s");
  s.set_bytes_done(1'260'000);
  s.set_bytes_total(2'500'000);
  s.set_bytes_per_second(2.2e6);
  EXPECT_EQ(StageLine(s),
            "calibrate  [##########..........]  3/8 tasks  layer 2 of 3  1.3M/2.5M tokens  "
            "2.2M tokens/s  ETA 3s");
  // Finished: no step, no rate.
  s.set_state(v1::StageProgress::SUCCEEDED);
  s.set_tasks_done(8);
  s.set_bytes_done(2'500'000);
  *s.mutable_start_time() = At(1000);
  *s.mutable_end_time() = At(1002);
  EXPECT_EQ(StageLine(s),
            "calibrate  [####################]  8/8 tasks  2.5M/2.5M tokens  done in 2s");
  // A daemon that sends no unit counts bytes.
  s.clear_unit();
  EXPECT_EQ(StageLine(s),
            "calibrate  [####################]  8/8 tasks  2.5/2.5 MB  done in 2s");
}

TEST(ProgressViewTest, TtyRedrawsInPlace) {
  std::ostringstream out;
  ProgressView view(&out, /*tty=*/true, /*width=*/0);
  v1::Job job = RunningJob();
  view.Show(job);
  job.mutable_stages(1)->set_tasks_done(13);
  view.Show(job);
  const std::string lines =
      absl::StrCat(kHeader, "\n", kInspect, "\n", "%Q", "\n", kExport, "\n", kVerify, "\n");
  std::string first = lines;
  first.replace(first.find("%Q"), 2, kQuantize);
  std::string second = lines;
  second.replace(second.find("%Q"), 2,
                 "quantize   [###.................]  13/48 tasks  140.2/805.3 GB  2.31 GB/s  "
                 "ETA 4m48s");
  // The first drawing starts where the cursor is; the second moves up over the five lines.
  EXPECT_EQ(out.str(), absl::StrCat("\r\x1b[J", first, "\x1b[5A\r\x1b[J", second));
}

TEST(ProgressViewTest, TtyCutsLinesToTheTerminalWidth) {
  std::ostringstream out;
  ProgressView view(&out, /*tty=*/true, /*width=*/40);
  view.Show(RunningJob());
  EXPECT_EQ(out.str(),
            absl::StrCat("\r\x1b[J", kHeader, "\n", "inspect    [####################]  1/1 \n",
                         "quantize   [###.................]  12/4\n",
                         "export     [....................]  0/4 \n",
                         "verify     [....................]  0/4 \n"));
}

TEST(ProgressViewTest, PlainPrintsOnlyChangedLines) {
  std::ostringstream out;
  ProgressView view(&out, /*tty=*/false, /*width=*/0);
  v1::Job job = RunningJob();
  view.Show(job);
  // Bytes and rate move: no new line until a task finishes.
  job.mutable_stages(1)->set_bytes_done(150'000'000'000);
  job.mutable_stages(1)->set_bytes_per_second(2.5e9);
  view.Show(job);
  job.mutable_stages(1)->set_tasks_done(13);
  view.Show(job);
  // A stage that starts without progress shows the same text: not printed again.
  job.mutable_stages(2)->set_state(v1::StageProgress::RUNNING);
  view.Show(job);
  job.set_reason("pausing");
  view.Show(job);
  job.set_state(v1::PAUSED);
  job.clear_reason();
  job.set_last_error("paused by request");
  job.mutable_stages(1)->set_state(v1::StageProgress::PENDING);
  view.Show(job);
  EXPECT_EQ(
      out.str(),
      absl::StrCat(kHeader, "\n", kInspect, "\n", kQuantize, "\n", kExport, "\n", kVerify, "\n",
                   // 150 / 805.3 of 20 = 3.73
                   "quantize   [###.................]  13/48 tasks  150.0/805.3 GB  "
                   "2.50 GB/s  ETA 4m48s\n",
                   "job 7 RUNNING (pausing)\n",
                   // A stopped job's state comes after its final stage lines.
                   "quantize   [###.................]  13/48 tasks  150.0/805.3 GB\n",
                   "last error: paused by request\n", "job 7 PAUSED\n"));
}

TEST(WorkersViewTest, OneRowPerWorkerWithDevicesTasksAndAge) {
  EXPECT_EQ(FormatWorkers(v1::ListWorkersResponse(), absl::FromUnixSeconds(1000)),
            "no remote workers\n");
  v1::ListWorkersResponse r;
  v1::WorkerInfo* a = r.add_workers();
  a->set_name("node-01");
  a->set_peer("ipv4:10.0.0.5:4100");
  v1::WorkerDevice* d = a->add_devices();
  d->set_name("cuda:0");
  d->set_gpu(true);
  d->set_memory_bytes(int64_t{80} << 30);
  d = a->add_devices();
  d->set_name("cuda:1");
  d->set_gpu(true);
  d->set_memory_bytes(int64_t{3} << 29);
  a->add_tasks("job 3: quantize model-00001-of-00004.safetensors");
  a->set_tasks_leased(12);
  a->mutable_last_seen_time()->set_seconds(993);
  v1::WorkerInfo* b = r.add_workers();
  b->set_name("n2");
  b->set_peer("ipv4:10.0.0.6:4100");
  d = b->add_devices();
  d->set_name("cpu");
  d->set_memory_bytes(int64_t{64} << 30);
  b->mutable_last_seen_time()->set_seconds(1000);
  EXPECT_EQ(FormatWorkers(r, absl::FromUnixSeconds(1000)),
            "NAME     ADDRESS             DEVICES                            "
            "TASK                                              LEASED  LAST SEEN\n"
            "node-01  ipv4:10.0.0.5:4100  cuda:0 (80 GiB), cuda:1 (1.5 GiB)  "
            "job 3: quantize model-00001-of-00004.safetensors  12        7 s ago\n"
            "n2       ipv4:10.0.0.6:4100  cpu (64 GiB)                       "
            "-                                                 0         0 s ago\n");
}

TEST(ReportViewTest, FormatsWorstTensorsAndRuleChecks) {
  v1::JobReport r;
  r.set_job_id(7);
  r.set_state(v1::SUCCEEDED);
  r.set_tensors_total(48);
  r.set_min_sqnr_db(18.5149);
  r.set_mean_sqnr_db(19.874);
  v1::TensorStats* t = r.add_tensors();
  t->set_tensor("layers.1.ffn.experts.3.w2.weight");
  t->set_rel_rmse(0.11873);
  t->set_sqnr_db(18.5149);
  t->set_max_abs_err(0.042113);
  t = r.add_tensors();
  t->set_tensor("layers.0.attn.wq_a.weight");
  t->set_rel_rmse(0.0958);
  t->set_sqnr_db(20.37);
  t->set_max_abs_err(0.5);
  v1::RuleCheck* c = r.add_rules();
  c->set_name("verify model-00001-of-00002.safetensors");
  c->set_passed(true);
  c = r.add_rules();
  c->set_name("verify model-00002-of-00002.safetensors");
  c->set_message("tensor-layout a.weight: bad shape\nindex: b.weight missing\n");
  EXPECT_EQ(FormatReport(r, false),
            "job 7 SUCCEEDED  48 tensors  min SQNR 18.51 dB  mean SQNR 19.87 dB\n"
            "\n"
            "TENSOR                            REL RMSE  SQNR dB  MAX ABS ERR\n"
            "layers.1.ffn.experts.3.w2.weight    0.1187    18.51      0.04211\n"
            "layers.0.attn.wq_a.weight           0.0958    20.37          0.5\n"
            "\n"
            "calibration: no input amax recorded\n"
            "\n"
            "rule checks: 1 of 2 passed\n"
            "  PASS  verify model-00001-of-00002.safetensors\n"
            "  FAIL  verify model-00002-of-00002.safetensors\n"
            "        tensor-layout a.weight: bad shape\n"
            "        index: b.weight missing\n");
}

// Who ran each task: shown when a remote worker ran one, "local" for the daemon itself; a job the
// daemon ran alone shows nothing.
TEST(ReportViewTest, ShowsWhoRanTheTasksWhenARemoteWorkerRanOne) {
  v1::JobReport r;
  r.set_job_id(3);
  r.set_state(v1::FAILED);
  auto add = [&](const char* stage, const char* name, const char* label, int attempt, bool done,
                 const char* worker) {
    v1::TaskRun* t = r.add_tasks();
    t->set_stage(stage);
    t->set_name(name);
    t->set_label(label);
    t->set_attempt(attempt);
    t->set_done(done);
    t->set_worker(worker);
  };
  add("inspect", "inspect", "", 1, true, "");
  const std::string local_only = FormatReport(r, false);
  EXPECT_EQ(local_only,
            "job 3 FAILED  no tensor statistics yet\n"
            "\n"
            "calibration: no input amax recorded\n"
            "\n"
            "rule checks: none yet (verify has not run)\n");
  add("quantize", "model-00001-of-00002.safetensors", "", 2, true, "gpu-a");
  add("quantize", "layers", "shard 2 of 2", 3, false, "gpu-b");
  EXPECT_EQ(FormatReport(r, false),
            "job 3 FAILED  no tensor statistics yet\n"
            "\n"
            "calibration: no input amax recorded\n"
            "\n"
            "tasks: who ran them (local: this quantd)\n"
            "STAGE     TASK                              ATTEMPT  RESULT  RAN BY\n"
            "inspect   inspect                                 1  done    local\n"
            "quantize  model-00001-of-00002.safetensors        2  done    gpu-a\n"
            "quantize  layers (shard 2 of 2)                   3  failed  gpu-b\n"
            "\n"
            "rule checks: none yet (verify has not run)\n");
}

TEST(ReportViewTest, CountsTheModulesWithoutStatistics) {
  v1::JobReport r;
  r.set_job_id(9);
  r.set_state(v1::SUCCEEDED);
  r.set_tensors_total(46);
  r.set_min_sqnr_db(18.5149);
  r.set_mean_sqnr_db(19.874);
  r.set_modules_without_statistics(2);
  EXPECT_EQ(FormatReport(r, false),
            "job 9 SUCCEEDED  46 tensors  min SQNR 18.51 dB  mean SQNR 19.87 dB\n"
            "  2 modules without statistics (quantized by an earlier release): their SQNR is "
            "not in these figures\n"
            "\n"
            "calibration: no input amax recorded\n"
            "\n"
            "rule checks: none yet (verify has not run)\n");
}

TEST(ReportViewTest, SaysWhatIsNotThereYet) {
  v1::JobReport r;
  r.set_job_id(8);
  r.set_state(v1::RUNNING);
  EXPECT_EQ(FormatReport(r, false),
            "job 8 RUNNING  no tensor statistics yet\n"
            "\n"
            "calibration: no input amax recorded\n"
            "\n"
            "rule checks: none yet (verify has not run)\n");
}

v1::ProjectionAmax* AddProjection(v1::LayerReport* layer, const std::string& name, int64_t modules,
                                  double min, double median, double max) {
  v1::ProjectionAmax* p = layer->add_projections();
  p->set_projection(name);
  p->set_modules(modules);
  p->set_min_amax(min);
  p->set_median_amax(median);
  p->set_max_amax(max);
  return p;
}

TEST(ReportViewTest, FormatsTheInputAmaxOfEachLayer) {
  v1::JobReport r;
  r.set_job_id(9);
  r.set_state(v1::SUCCEEDED);
  v1::LayerReport* l0 = r.add_layers();
  l0->set_layer(0);
  AddProjection(l0, "attn.wq_a", 1, 3.25, 3.25, 3.25);
  AddProjection(l0, "ffn.experts.w1", 8, 0.5, 1.75, 2.5);
  AddProjection(l0, "ffn.experts.w2", 7, 0.25, 0.5, 0.75);
  AddProjection(l0, "ffn.experts.w2.unweighted", 7, 4, 5, 6);
  AddProjection(l0, "ffn.shared_experts.w1", 1, 1.5, 1.5, 1.5);
  l0->set_token_counts(true);
  l0->set_calibrated_tokens(4096);
  l0->set_routed_experts(8);
  l0->set_uncalibrated_experts(1);
  v1::LayerReport* l12 = r.add_layers();
  l12->set_layer(12);
  AddProjection(l12, "attn.wkv", 1, 12.0625, 12.0625, 12.0625);
  l12->set_token_counts(true);
  l12->set_calibrated_tokens(4096);
  // From an amax file: no token counts.
  v1::LayerReport* l13 = r.add_layers();
  l13->set_layer(13);
  AddProjection(l13, "ffn.experts.w1", 2, 0.5, 0.625, 0.75);
  l13->set_routed_experts(2);
  EXPECT_EQ(FormatReport(r, false),
            "job 9 SUCCEEDED  no tensor statistics yet\n"
            "\n"
            "calibration: input amax per decoder layer (routed experts: min / median / max)\n"
            "LAYER  TOKENS  UNCALIBRATED  PROJECTION                  MIN  MEDIAN    MAX\n"
            "0        4096  1 of 8        attn.wq_a                                 3.25\n"
            "                             ffn.experts.w1              0.5    1.75    2.5\n"
            "                             ffn.experts.w2             0.25     0.5   0.75\n"
            "                             ffn.experts.w2.unweighted     4       5      6\n"
            "                             ffn.shared_experts.w1                      1.5\n"
            "12       4096  -             attn.wkv                                 12.06\n"
            "13          -  0 of 2        ffn.experts.w1              0.5   0.625   0.75\n"
            "\n"
            "rule checks: none yet (verify has not run)\n");
}

TEST(ReportViewTest, FormatsTheOfficialVersusMathComparison) {
  v1::JobReport r;
  r.set_job_id(11);
  r.set_state(v1::SUCCEEDED);
  v1::LayerReport* l0 = r.add_layers();
  l0->set_layer(0);
  AddProjection(l0, "attn.wq_a", 1, 2.25, 2.25, 2.25);
  l0->set_numerics_compared(true);
  l0->set_numerics_compared_modules(2);
  l0->set_numerics_max_rel_diff(0.0123);
  l0->set_numerics_max_rel_diff_module("ffn.experts.1.w2");
  v1::LayerReport* l1 = r.add_layers();
  l1->set_layer(1);
  AddProjection(l1, "attn.wq_a", 1, 4.5, 4.5, 4.5);
  l1->set_numerics_compared(true);
  l1->set_numerics_compared_modules(1);
  l1->set_numerics_max_rel_diff(std::numeric_limits<double>::infinity());
  l1->set_numerics_max_rel_diff_module("attn.wq_a");
  r.set_numerics_peer_job(4);
  r.set_numerics_peer("math");
  r.set_numerics_compared_modules(3);
  r.set_numerics_max_rel_diff(std::numeric_limits<double>::infinity());
  r.set_numerics_max_rel_diff_module("layers.1.attn.wq_a");
  EXPECT_EQ(FormatReport(r, false),
            "job 11 SUCCEEDED  no tensor statistics yet\n"
            "\n"
            "calibration: input amax per decoder layer (routed experts: min / median / max)\n"
            "LAYER  TOKENS  UNCALIBRATED  PROJECTION  MIN  MEDIAN   MAX\n"
            "0           -  -             attn.wq_a                2.25\n"
            "1           -  -             attn.wq_a                 4.5\n"
            "\n"
            "numerics: input amax against job 4 (math), same source and calibration data\n"
            "  max |a_official - a_math| / a_math inf at layers.1.attn.wq_a over 3 modules\n"
            "LAYER  MODULES  MAX REL DIFF  AT\n"
            "0            2        1.23 %  ffn.experts.1.w2\n"
            "1            1           inf  attn.wq_a\n"
            "\n"
            "rule checks: none yet (verify has not run)\n");
}

// Job 10 evaluated on four layers; layer 3 came out identical (+inf dB).
v1::JobReport EvaluatedReport() {
  v1::JobReport r;
  r.set_job_id(10);
  r.set_state(v1::FAILED);
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::vector<double>> sqnr = {
      {30.5, 32.25}, {20.0, 25.0}, {12.75, 18.25}, {inf, inf}};
  for (size_t i = 0; i < sqnr.size(); ++i) {
    v1::LayerReport* l = r.add_layers();
    l->set_layer(static_cast<int64_t>(i));
    l->set_evaluated(true);
    l->set_free_running_sqnr_db(sqnr[i][0]);
    l->set_teacher_forced_sqnr_db(sqnr[i][1]);
  }
  v1::EvaluationReport* e = r.mutable_evaluation();
  e->set_samples(32);
  e->set_tokens(16384);
  e->set_numerics("official");
  e->set_positions(16352);
  e->set_mean_kl(0.0123);
  e->set_p99_kl(0.0871);
  e->set_max_kl(0.312);
  e->set_top1_agreement(0.978515625);
  e->set_source_ppl(5.214);
  e->set_quantized_ppl(5.301);
  e->set_ppl_ratio(1.016686);
  e->set_gate_passed(false);
  e->set_gate_message("mean KL 0.0123 exceeds evaluate.gate.max_mean_kl 0.01 (worst layer 2)");
  for (int64_t layer : {2, 1, 0}) e->add_worst_layers(layer);
  e->set_seconds(40);
  e->set_calibration_seconds(16);
  return r;
}

constexpr char kEvaluationText[] =
    "job 10 FAILED  no tensor statistics yet\n"
    "\n"
    "calibration: no input amax recorded\n"
    "\n"
    "evaluation: 32 held-out samples, 16384 tokens, 16352 positions compared (official numerics)\n"
    "  KL(source || quantized)  mean 0.0123  p99 0.0871  max 0.312 nats\n"
    "  top-1 agreement          97.85 %\n"
    "  perplexity               5.214 → 5.301  (ratio 1.0167)\n"
    "  gate                     FAILED: mean KL 0.0123 exceeds evaluate.gate.max_mean_kl 0.01 "
    "(worst layer 2)\n"
    "  stage time               40.0 s, 2.5× calibration\n"
    "\n"
    "hidden-state SQNR per layer, quantized against source\n"
    "LAYER  FREE-RUNNING dB  TEACHER-FORCED dB\n"
    "0                30.50              32.25\n"
    "1                20.00              25.00\n"
    "2                12.75              18.25\n"
    "3                  inf                inf\n";

TEST(ReportViewTest, EvaluationOffATerminal) {
  EXPECT_EQ(FormatReport(EvaluatedReport(), false),
            absl::StrCat(kEvaluationText,
                         "layers that lose the most: 2 (18.25 dB), 1 (25.00 dB), 0 (32.25 dB)\n"
                         "\n"
                         "rule checks: none yet (verify has not run)\n"));
}

TEST(ReportViewTest, EvaluationOnATerminalHasTheSparkline) {
  // Teacher-forced 32.25, 25, 18.25, inf over 18.25..32.25: levels 7, round(3.375) = 3, 0, and
  // inf drawn full.
  EXPECT_EQ(FormatReport(EvaluatedReport(), true),
            absl::StrCat(kEvaluationText,
                         "teacher-forced  █▄▁█\n"
                         "layers that lose the most: 2 (18.25 dB), 1 (25.00 dB), 0 (32.25 dB)\n"
                         "\n"
                         "rule checks: none yet (verify has not run)\n"));
}

TEST(ReportViewTest, EvaluationWithoutCalibrationTimeOrGateMessage) {
  v1::JobReport r = EvaluatedReport();
  r.mutable_evaluation()->set_gate_passed(true);
  r.mutable_evaluation()->clear_gate_message();
  r.mutable_evaluation()->set_calibration_seconds(0);
  const std::string text = FormatReport(r, false);
  EXPECT_TRUE(absl::StrContains(text, "  gate                     PASSED\n"
                                      "  stage time               40.0 s\n"))
      << text;
}

TEST(ReportViewTest, JsonCarriesEveryEvaluationFieldAndInfinity) {
  const v1::JobReport r = EvaluatedReport();
  absl::StatusOr<std::string> text = MessageToJson(r);
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::json j = nlohmann::json::parse(*text);
  EXPECT_EQ(j["layers"][3]["teacherForcedSqnrDb"], "Infinity");
  EXPECT_EQ(j["layers"][3]["freeRunningSqnrDb"], "Infinity");
  EXPECT_EQ(j["layers"][0]["teacherForcedSqnrDb"], 32.25);
  EXPECT_EQ(j["layers"][0]["evaluated"], true);
  const nlohmann::json& e = j["evaluation"];
  for (const char* key :
       {"samples", "tokens", "numerics", "positions", "meanKl", "p99Kl", "maxKl", "top1Agreement",
        "sourcePpl", "quantizedPpl", "pplRatio", "gatePassed", "gateMessage", "worstLayers",
        "seconds", "calibrationSeconds"}) {
    EXPECT_TRUE(e.contains(key)) << key;
  }
  EXPECT_EQ(e["worstLayers"], nlohmann::json::parse(R"(["2", "1", "0"])"));
  v1::JobReport back;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(*text, &back).ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(back, r));
}

TEST(ExitCodesTest, EveryStatusCode) {
  const std::vector<std::pair<grpc::StatusCode, int>> expected = {
      {grpc::StatusCode::OK, 0},
      {grpc::StatusCode::CANCELLED, 7},
      {grpc::StatusCode::UNKNOWN, 7},
      {grpc::StatusCode::INVALID_ARGUMENT, 2},
      {grpc::StatusCode::DEADLINE_EXCEEDED, 5},
      {grpc::StatusCode::NOT_FOUND, 3},
      {grpc::StatusCode::ALREADY_EXISTS, 4},
      {grpc::StatusCode::PERMISSION_DENIED, 7},
      {grpc::StatusCode::RESOURCE_EXHAUSTED, 6},
      {grpc::StatusCode::FAILED_PRECONDITION, 4},
      {grpc::StatusCode::ABORTED, 7},
      {grpc::StatusCode::OUT_OF_RANGE, 7},
      {grpc::StatusCode::UNIMPLEMENTED, 7},
      {grpc::StatusCode::INTERNAL, 7},
      {grpc::StatusCode::UNAVAILABLE, 5},
      {grpc::StatusCode::DATA_LOSS, 7},
      {grpc::StatusCode::UNAUTHENTICATED, 7},
  };
  ASSERT_EQ(expected.size(), 17u);  // codes 0..16
  for (const auto& [code, exit_code] : expected) {
    EXPECT_EQ(ExitCodeForStatus(code), exit_code) << "code " << code;
  }
}

TEST(ExitCodesTest, WatchedJobFinalStates) {
  EXPECT_EQ(ExitCodeForFinalState(v1::SUCCEEDED), 0);
  EXPECT_EQ(ExitCodeForFinalState(v1::FAILED), 1);
  EXPECT_EQ(ExitCodeForFinalState(v1::CANCELLED), 1);
  EXPECT_EQ(ExitCodeForFinalState(v1::PAUSED), 1);
}

class SpecFlagsTest : public testing_util::TempDirTest {
 protected:
  std::string WriteSpec(const std::string& text) {
    const std::string path = dir_ + "/spec.json";
    std::ofstream(path) << text;
    return path;
  }

  // `quantctl submit ARGS...` parsed into a spec.
  absl::StatusOr<v1::JobSpec> Parse(std::vector<std::string> args) {
    CLI::App app;
    SpecFlags flags;
    AddSpecFlags(&app, &flags);
    std::reverse(args.begin(), args.end());  // CLI11 takes them last first
    app.parse(args);
    return BuildSpec(flags);
  }
};

TEST_F(SpecFlagsTest, FlagsOverrideTheSpecFile) {
  const std::string spec = WriteSpec(R"({
      "source": "/models/v4", "output": "/out/a", "recipe": "full",
      "include": ["layers.*"], "exclude": ["lm_head"], "weight_format": "nvfp4",
      "kv_cache": "fp8", "materialize_bf16": null,
      "calibration": {"amax_file": "/a.json", "num_samples": 64, "calibrate_all_experts": false},
      "devices": "auto", "host_memory_bytes": 1000})");
  absl::StatusOr<v1::JobSpec> s =
      Parse({"--spec", spec, "--output", "rel/out", "--weight-format", "w4a16_nvfp4", "--exclude",
             "a", "--exclude", "b", "--num-samples", "128", "--seq-len", "512",
             "--calibrate-all-experts", "--device", "cpu", "--device", "cuda:0"});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->source(), "/models/v4");
  EXPECT_EQ(s->output(), (std::filesystem::current_path() / "rel/out").string());
  EXPECT_EQ(s->recipe(), "full");
  EXPECT_EQ(std::vector<std::string>(s->include().begin(), s->include().end()),
            std::vector<std::string>{"layers.*"});
  EXPECT_EQ(std::vector<std::string>(s->exclude().begin(), s->exclude().end()),
            (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(s->weight_format(), "w4a16_nvfp4");
  EXPECT_EQ(s->expert_cast(), "");  // not given anywhere: the daemon's default
  EXPECT_EQ(s->kv_cache(), "fp8");
  EXPECT_EQ(s->materialize_bf16(), "");
  EXPECT_EQ(s->calibration().amax_file(), "/a.json");
  EXPECT_EQ(s->calibration().num_samples(), 128);
  EXPECT_EQ(s->calibration().seq_len(), 512);
  EXPECT_TRUE(s->calibration().calibrate_all_experts());
  EXPECT_EQ(std::vector<std::string>(s->devices().begin(), s->devices().end()),
            (std::vector<std::string>{"cpu", "cuda:0"}));
  EXPECT_EQ(s->host_memory_bytes(), 1000);
}

TEST_F(SpecFlagsTest, CalibrationKeysFromTheSpecFileAndFlags) {
  const std::string spec = WriteSpec(R"({
      "source": "/models/v4", "output": "/out/a",
      "calibration": {"datasets": [{"path": "news.jsonl", "samples": 512},
                                   {"path": "/cal/chat.jsonl"}],
                      "min_seq_len": 8, "seed": 3, "add_bos": false, "mode": "data",
                      "w2_input": "weighted", "expert_amax": "layer_max",
                      "uncalibrated": "model_max", "numerics": "math", "amax_out": "amax.json"}})");
  const std::filesystem::path cwd = std::filesystem::current_path();
  absl::StatusOr<v1::JobSpec> s = Parse({"--spec", spec});
  ASSERT_TRUE(s.ok()) << s.status();
  const v1::CalibrationSpec& c = s->calibration();
  ASSERT_EQ(c.datasets_size(), 2);
  EXPECT_EQ(c.datasets(0).path(), (cwd / "news.jsonl").string());  // made absolute
  EXPECT_EQ(c.datasets(0).samples(), 512);
  EXPECT_EQ(c.datasets(1).path(), "/cal/chat.jsonl");
  EXPECT_EQ(c.datasets(1).samples(), 0);
  EXPECT_EQ(c.min_seq_len(), 8);
  EXPECT_EQ(c.seed(), 3);
  ASSERT_TRUE(c.has_add_bos());
  EXPECT_FALSE(c.add_bos());
  EXPECT_EQ(c.mode(), "data");
  EXPECT_EQ(c.w2_input(), "weighted");
  EXPECT_EQ(c.expert_amax(), "layer_max");
  EXPECT_EQ(c.uncalibrated(), "model_max");
  EXPECT_EQ(c.numerics(), "math");
  EXPECT_EQ(c.amax_out(), (cwd / "amax.json").string());

  // The flags replace the file's values; the datasets list as a whole.
  s = Parse({"--spec", spec, "--calibration-dataset", "/cal/a.jsonl:64", "--calibration-dataset",
             "rel/b.jsonl", "--calibration-dataset", "/cal/c:d.jsonl", "--min-seq-len", "0",
             "--seed", "11", "--calibration-mode", "constant", "--w2-input", "max",
             "--expert-amax", "per_expert", "--uncalibrated", "layer_max", "--numerics",
             "official", "--amax-out", "/cal/out.json"});
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->calibration().datasets_size(), 3);
  EXPECT_EQ(s->calibration().datasets(0).path(), "/cal/a.jsonl");
  EXPECT_EQ(s->calibration().datasets(0).samples(), 64);
  EXPECT_EQ(s->calibration().datasets(1).path(), (cwd / "rel/b.jsonl").string());
  EXPECT_EQ(s->calibration().datasets(1).samples(), 0);
  EXPECT_EQ(s->calibration().datasets(2).path(), "/cal/c:d.jsonl");
  EXPECT_EQ(s->calibration().datasets(2).samples(), 0);
  ASSERT_TRUE(s->calibration().has_min_seq_len());
  EXPECT_EQ(s->calibration().min_seq_len(), 0);
  EXPECT_EQ(s->calibration().seed(), 11);
  EXPECT_FALSE(s->calibration().add_bos());  // the file's value stays
  EXPECT_EQ(s->calibration().mode(), "constant");
  EXPECT_EQ(s->calibration().w2_input(), "max");
  EXPECT_EQ(s->calibration().expert_amax(), "per_expert");
  EXPECT_EQ(s->calibration().uncalibrated(), "layer_max");
  EXPECT_EQ(s->calibration().numerics(), "official");
  EXPECT_EQ(s->calibration().amax_out(), "/cal/out.json");

  // Without a file: unset stays unset (the daemon's default), --no-bos sets add_bos false.
  s = Parse({"--source", "/s", "--output", "/o"});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->calibration().has_add_bos());
  EXPECT_FALSE(s->calibration().has_min_seq_len());
  s = Parse({"--source", "/s", "--output", "/o", "--no-bos"});
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(s->calibration().has_add_bos());
  EXPECT_FALSE(s->calibration().add_bos());
}

TEST_F(SpecFlagsTest, EvaluateFlags) {
  const std::string spec = WriteSpec(R"({"source": "/s", "output": "/o",
      "evaluate": {"num_samples": 16, "gate": {"max_mean_kl": 0.1, "max_ppl_ratio": 1.5}}})");
  absl::StatusOr<v1::JobSpec> s = Parse({"--spec", spec, "--eval-samples", "8", "--gate-min-top1",
                                         "0.9", "--gate-max-ppl-ratio", "1.05"});
  ASSERT_TRUE(s.ok()) << s.status();
  const v1::EvaluateSpec& e = s->evaluate();
  EXPECT_FALSE(e.has_enabled());
  EXPECT_EQ(e.num_samples(), 8);
  ASSERT_TRUE(e.gate().has_max_mean_kl());  // the file's bound stays
  EXPECT_EQ(e.gate().max_mean_kl(), 0.1);
  ASSERT_TRUE(e.gate().has_min_top1_agreement());
  EXPECT_EQ(e.gate().min_top1_agreement(), 0.9);
  EXPECT_EQ(e.gate().max_ppl_ratio(), 1.05);

  s = Parse({"--source", "/s", "--output", "/o", "--gate-max-kl", "0", "--gate-min-top1", "0"});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->evaluate().gate().has_max_mean_kl());  // 0 is a bound, not "unset"
  EXPECT_TRUE(s->evaluate().gate().has_min_top1_agreement());
  EXPECT_FALSE(s->evaluate().gate().has_max_ppl_ratio());

  s = Parse({"--source", "/s", "--output", "/o", "--no-evaluate"});
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(s->evaluate().has_enabled());
  EXPECT_FALSE(s->evaluate().enabled());
  s = Parse({"--source", "/s", "--output", "/o"});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->evaluate().has_enabled());
}

TEST_F(SpecFlagsTest, EvaluateFlagErrorsNameTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--eval-samples", "-1"}, "--eval-samples -1: must not be negative"},
      {{"--gate-max-kl", "-0.5"}, "--gate-max-kl -0.5: must be a finite number >= 0"},
      {{"--gate-min-top1", "1.5"}, "--gate-min-top1 1.5: must be in [0, 1]"},
      {{"--gate-max-ppl-ratio", "0"}, "--gate-max-ppl-ratio 0: must be a finite number > 0"},
      {{"--no-evaluate", "--eval-samples", "4"},
       "--no-evaluate cannot be combined with --eval-samples"},
      {{"--no-evaluate", "--gate-min-top1", "0.5"},
       "--no-evaluate cannot be combined with --gate-min-top1"},
  };
  for (const auto& [flags, error] : cases) {
    std::vector<std::string> args = {"--source", "/s", "--output", "/o"};
    args.insert(args.end(), flags.begin(), flags.end());
    absl::StatusOr<v1::JobSpec> s = Parse(args);
    ASSERT_FALSE(s.ok()) << error;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.status().message(), error);
  }
  const std::string spec = WriteSpec(R"({"evaluate": {"gate": {"max_mean_kl": "small"}}})");
  absl::StatusOr<v1::JobSpec> s = Parse({"--spec", spec, "--source", "/s", "--output", "/o"});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(),
            absl::StrCat(spec, ": field 'evaluate.gate.max_mean_kl' must be a number"));
}

TEST(DatasetFlagTest, PathAndSampleCount) {
  struct Case {
    std::string value;
    std::string path;
    int64_t samples;
  };
  for (const Case& c : std::vector<Case>{{"/a.jsonl", "/a.jsonl", 0},
                                         {"/a.jsonl:0", "/a.jsonl", 0},
                                         {"/a.jsonl:256", "/a.jsonl", 256},
                                         {"/a:b.jsonl", "/a:b.jsonl", 0},
                                         {"/a.jsonl:", "/a.jsonl:", 0},
                                         {"/a.jsonl:-3", "/a.jsonl:-3", 0},
                                         {"/x:1:2", "/x:1", 2}}) {
    absl::StatusOr<v1::CalibrationDataset> d = ParseDatasetFlag(c.value);
    ASSERT_TRUE(d.ok()) << c.value << ": " << d.status();
    EXPECT_EQ(d->path(), c.path) << c.value;
    EXPECT_EQ(d->samples(), c.samples) << c.value;
  }
  absl::StatusOr<v1::CalibrationDataset> d = ParseDatasetFlag("/a.jsonl:99999999999999999999");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d.status().message(),
            "--calibration-dataset /a.jsonl:99999999999999999999: the sample count is out of "
            "range");
}

TEST_F(SpecFlagsTest, FlagsAloneMakeASpec) {
  absl::StatusOr<v1::JobSpec> s = Parse({"--source", "/src", "--output", "/out/../dst"});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->source(), "/src");
  EXPECT_EQ(s->output(), "/dst");
  EXPECT_EQ(s->devices_size(), 0);
}

TEST_F(SpecFlagsTest, ErrorsNameTheKey) {
  struct Case {
    std::string json;
    std::string error;  // after "<spec path>: "
  };
  const std::vector<Case> cases = {
      {R"({"source": "/s", "weight_fmt": "nvfp4"})", "field 'weight_fmt' is not a known field"},
      {R"({"calibration": {"samples": 3}})", "field 'calibration.samples' is not a known field"},
      {R"({"source": 5})", "field 'source' must be a string"},
      {R"({"calibration": {"num_samples": "sixty"}})",
       "field 'calibration.num_samples' must be a non-negative integer"},
      {R"({"host_memory_bytes": 1.5})", "field 'host_memory_bytes' must be a non-negative integer"},
      {R"({"host_memory_bytes": 9223372036854775808})",
       "field 'host_memory_bytes' must be a non-negative integer"},
      {R"({"calibration": {"calibrate_all_experts": 1}})",
       "field 'calibration.calibrate_all_experts' must be true or false"},
      {R"({"devices": 5})", "field 'devices' must be an array of strings"},
      {R"({"include": ["a", 2]})", "field 'include' must be an array of strings"},
      {R"({"calibration": []})", "field 'calibration' must be an object"},
      {R"({"calibration": {"datasets": "/a"}})",
       "field 'calibration.datasets' must be an array of objects"},
      {R"({"calibration": {"datasets": ["/a"]}})",
       "field 'calibration.datasets[0]' must be an object"},
      {R"({"calibration": {"datasets": [{"path": "/a"}, {"path": "/b", "samples": "8x"}]}})",
       "field 'calibration.datasets[1].samples' must be a non-negative integer"},
      {R"({"calibration": {"datasets": [{"file": "/a"}]}})",
       "field 'calibration.datasets[0].file' is not a known field"},
      {R"({"calibration": {"add_bos": [true]}})",
       "field 'calibration.add_bos' must be true or false"},
      {R"(["source"])", "a job spec must be a JSON object"},
  };
  for (const Case& c : cases) {
    const std::string path = WriteSpec(c.json);
    absl::StatusOr<v1::JobSpec> s = Parse({"--spec", path, "--source", "/s", "--output", "/o"});
    ASSERT_FALSE(s.ok()) << c.json;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.status().message(), absl::StrCat(path, ": ", c.error)) << c.json;
  }
  const std::string bad = WriteSpec("{\"source\": ");
  absl::StatusOr<v1::JobSpec> s = Parse({"--spec", bad});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), absl::StrCat(bad, ": not valid JSON"));
}

TEST_F(SpecFlagsTest, UnreadableFileAndMissingPaths) {
  const std::string missing = dir_ + "/missing.json";
  absl::StatusOr<v1::JobSpec> s = Parse({"--spec", missing});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.status().message(), absl::StrCat("cannot read --spec file: ", missing,
                                               ": cannot open: No such file or directory"));

  s = Parse({"--output", "/o"});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), "submit needs --source (or \"source\" in the --spec file)");
  s = Parse({"--spec", WriteSpec(R"({"source": "/s"})")});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), "submit needs --output (or \"output\" in the --spec file)");
}

TEST(JobJsonTest, EnumNamesAndLowerCamelCase) {
  v1::Job job = RunningJob();
  job.mutable_spec()->set_source("/src");
  absl::StatusOr<std::string> text = MessageToJson(job);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->find('\n'), std::string::npos);  // one line per message
  const nlohmann::json j = nlohmann::json::parse(*text);
  EXPECT_EQ(j["state"], "RUNNING");
  EXPECT_EQ(j["id"], "7");  // proto3 JSON spells int64 as a string
  EXPECT_EQ(j["currentStage"], "quantize");
  EXPECT_FALSE(j.contains("current_stage"));
  // Zero and empty fields are printed too.
  EXPECT_EQ(j["lastError"], "");
  EXPECT_EQ(j["taskRetries"], "0");
  EXPECT_EQ(j["stages"][1]["kind"], "quantize");
  EXPECT_EQ(j["stages"][1]["state"], "RUNNING");
  EXPECT_EQ(j["stages"][1]["tasksDone"], "12");
  EXPECT_EQ(j["stages"][1]["bytesPerSecond"], 2.31e9);
  EXPECT_EQ(j["stages"][1]["etaSeconds"], 288);
  EXPECT_FALSE(j["stages"][2].contains("etaSeconds"));  // optional and unset
  EXPECT_EQ(j["stages"][0]["startTime"], "1970-01-01T00:16:40Z");
  EXPECT_EQ(j["spec"]["source"], "/src");
  EXPECT_EQ(j["spec"]["weightFormat"], "");
  EXPECT_EQ(j["spec"]["hostMemoryBytes"], "0");
}

}  // namespace
}  // namespace quantd::client
