// quantd run (scheduler/run_job.h) on the tiny V4 fixture (4 source shards): full runs (W4A16 and W4A4 with an amax
// file), idempotent re-runs, refusals (other spec, missing amax, kv fp8, changed source), a corrupt
// shard that fails the job and resumes once fixed, cancellation, and the progress line format.
#include "server/scheduler/run_job.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/sha256.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/fixture/fixture.h"
#include "server/job/progress.h"
#include "server/pipeline/prepared_job.h"
#include "server/store/job_store.h"

namespace quantd::pipeline {

using checkpoint::BuildInventory;
using checkpoint::LinearModule;
using checkpoint::TensorFormat;
using checkpoint::TensorInventory;

using job::FormatDuration;
using job::FormatStageLine;
using job::JobSpec;
using job::ParseJobSpec;
using job::ProgressPrinter;
using job::StageLineStyle;

namespace {

namespace fs = std::filesystem;
using scheduler::RunJob;
using scheduler::RunOptions;
using scheduler::RunRequestId;

// An output stream that sets `flag` once `count` lines containing `needle` were flushed into it:
// the runner prints one line per finished task when not on a terminal, so this cancels a run at a
// known point.
class CancelAfter : public std::stringbuf {
 public:
  CancelAfter(std::string needle, int count, std::atomic<bool>* flag)
      : needle_(std::move(needle)), count_(count), flag_(flag) {}

 protected:
  int sync() override {
    const std::string text = str();
    int n = 0;
    for (size_t at = text.find(needle_); at != std::string::npos; at = text.find(needle_, at + 1)) {
      ++n;
    }
    if (n >= count_) flag_->store(true);
    return 0;
  }

 private:
  std::string needle_;       // text that marks a line
  int count_;                // lines to see before cancelling
  std::atomic<bool>* flag_;  // set once they were seen
};

class RunnerTest : public testing::Test {
 protected:
  void SetUp() override {
    root_ =
        fs::temp_directory_path() / ("quantd_runner_test_" + std::to_string(getpid()) + "_" +
                                     testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    src_ = (root_ / "src").string();
    auto summary = fixture::WriteFixture(
        fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny), 7, src_, {});
    ASSERT_TRUE(summary.ok()) << summary.status();
    ASSERT_EQ(summary->shards.size(), 4u);
  }
  void TearDown() override { fs::remove_all(root_); }

  JobSpec Spec(const std::string& out, const std::string& extra) {
    auto spec = ParseJobSpec("{\"source\": \"" + src_ + "\", \"output\": \"" +
                                 (root_ / out).string() + "\"" + extra + "}",
                             "test");
    EXPECT_TRUE(spec.ok()) << spec.status();
    return *spec;
  }

  RunOptions Options(const JobSpec& spec, const std::string& state) {
    RunOptions o;
    o.state_path = (root_ / state).string();
    o.spec = spec;
    o.workers = 2;
    o.devices = {"cpu"};
    o.cpu_threads = 1;
    o.progress = &log_;
    return o;
  }

  std::unique_ptr<store::JobStore> OpenStore(const std::string& state) {
    auto store = store::JobStore::Open((root_ / state).string());
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }

  struct SourcePlan {
    std::unique_ptr<checkpoint::CheckpointDir> source;
    TensorInventory inventory;
    Plan plan;
  };
  SourcePlan PlanFor(const JobSpec& spec) {
    SourcePlan p;
    auto source = checkpoint::CheckpointDir::Open(src_);
    EXPECT_TRUE(source.ok()) << source.status();
    p.source = std::move(*source);
    auto inventory = BuildInventory(*p.source);
    EXPECT_TRUE(inventory.ok()) << inventory.status();
    p.inventory = std::move(*inventory);
    auto plan = BuildPlan(spec, *p.source, p.inventory);
    EXPECT_TRUE(plan.ok()) << plan.status();
    p.plan = std::move(*plan);
    return p;
  }

  // amax of the i-th module (natural order): 2688 * (i + 1) / 16, so input_scale = (i + 1) / 16
  // exactly.
  std::map<std::string, float> WriteAmaxFile(const std::string& name,
                                             const std::vector<std::string>& modules) {
    std::map<std::string, float> amax;
    std::ofstream f(root_ / name);
    f << "{";
    for (size_t i = 0; i < modules.size(); ++i) {
      amax[modules[i]] = 2688.0f * static_cast<float>(i + 1) / 16.0f;
      f << (i ? ", " : "") << "\"" << modules[i] << "\": " << amax[modules[i]];
    }
    f << "}";
    return amax;
  }

  // File name -> SHA-256 of every file in `dir` but the marker, which names the job that wrote
  // them (output_marker.h).
  static std::map<std::string, std::string> Hashes(const std::string& dir) {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().filename() == pipeline::OutputMarker::kFileName) continue;
      auto sha = checkpoint::Sha256File(e.path().string());
      EXPECT_TRUE(sha.ok()) << sha.status();
      out[e.path().filename().string()] = sha.ok() ? *sha : "";
    }
    return out;
  }

  static std::vector<store::TaskRow> Tasks(store::JobStore& store, const std::string& kind) {
    auto tasks = store.ListTasks(1);
    EXPECT_TRUE(tasks.ok()) << tasks.status();
    std::vector<store::TaskRow> out;
    for (const store::TaskRow& t : *tasks) {
      if (t.stage_kind == kind) out.push_back(t);
    }
    return out;
  }

  fs::path root_;
  std::string src_;
  std::ostringstream log_;
};

TEST_F(RunnerTest, W4a16RunSucceedsWritesEveryShardAndASecondRunIsANoOp) {
  const JobSpec spec = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"");
  const RunOptions options = Options(spec, "state.db");
  ASSERT_TRUE(RunJob(options).ok()) << log_.str();

  auto store = OpenStore("state.db");
  auto job = store->GetJob(1);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state, store::JobState::kSucceeded);
  EXPECT_EQ(job->request_id, RunRequestId(spec));
  auto tasks = store->ListTasks(1);
  ASSERT_TRUE(tasks.ok());
  ASSERT_EQ(tasks->size(), 1u + 4u + 1u + 4u);  // inspect, quantize x4, export, verify x4
  for (const store::TaskRow& t : *tasks) {
    EXPECT_EQ(t.state, store::TaskState::kDone) << t.name;
    EXPECT_EQ(t.attempt, 1) << t.name;
  }
  const auto hashes = Hashes((root_ / "out").string());
  for (const store::TaskRow& t : Tasks(*store, "quantize")) {
    // Each quantize task recorded the file it wrote, with its size and checksum.
    EXPECT_EQ(t.output_path, (root_ / "out" / t.name).string());
    ASSERT_EQ(hashes.count(t.name), 1u) << t.name;
    EXPECT_EQ(hashes.at(t.name), t.output_sha256) << t.name;
    EXPECT_EQ(static_cast<int64_t>(fs::file_size(t.output_path)), *t.output_bytes);
  }
  for (const char* name : {"model.safetensors.index.json", "config.json", "hf_quant_config.json",
                           "generation_config.json"}) {
    EXPECT_EQ(hashes.count(name), 1u) << name;
  }
  for (const auto& [name, sha] : hashes) EXPECT_NE(fs::path(name).extension(), ".tmp") << name;

  // W4A16: weight_scale_2 but no input_scale for every quantized module.
  auto out = checkpoint::CheckpointDir::Open((root_ / "out").string());
  ASSERT_TRUE(out.ok()) << out.status();
  const SourcePlan p = PlanFor(spec);
  for (const std::string& m : p.plan.recipe.modules) {
    EXPECT_NE((*out)->Find(m + ".weight_scale_2"), nullptr) << m;
    EXPECT_EQ((*out)->Find(m + ".input_scale"), nullptr) << m;
  }
  auto stats = store->ListTensorStats(1);
  ASSERT_TRUE(stats.ok());
  EXPECT_FALSE(stats->empty());

  // The second run finds the job SUCCEEDED and touches nothing.
  auto events = store->ListEvents(1, 0);
  ASSERT_TRUE(events.ok());
  std::map<std::string, fs::file_time_type> mtimes;
  for (const auto& e : fs::directory_iterator(root_ / "out")) {
    mtimes[e.path().filename().string()] = e.last_write_time();
  }
  store.reset();
  log_.str("");
  ASSERT_TRUE(RunJob(options).ok());
  EXPECT_NE(log_.str().find("already SUCCEEDED"), std::string::npos) << log_.str();
  store = OpenStore("state.db");
  auto events_after = store->ListEvents(1, 0);
  ASSERT_TRUE(events_after.ok());
  EXPECT_EQ(events_after->size(), events->size());
  EXPECT_EQ(Hashes((root_ / "out").string()), hashes);
  for (const auto& e : fs::directory_iterator(root_ / "out")) {
    EXPECT_EQ(e.last_write_time(), mtimes.at(e.path().filename().string()));
  }
}

TEST_F(RunnerTest, Nvfp4RunTakesInputScalesFromTheAmaxFile) {
  JobSpec spec = Spec("out", "");
  const SourcePlan p = PlanFor(spec);
  const std::map<std::string, float> amax = WriteAmaxFile("amax.json", p.plan.recipe.modules);
  spec.calibration.amax_file = (root_ / "amax.json").string();
  ASSERT_TRUE(RunJob(Options(spec, "state.db")).ok()) << log_.str();

  auto store = OpenStore("state.db");
  auto rows = store->ListAmax(1);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), amax.size());
  for (const store::AmaxRow& r : *rows) {
    EXPECT_EQ(r.kind, "input");
    EXPECT_EQ(r.value, amax.at(r.module)) << r.module;
    EXPECT_EQ(r.samples, 0);
  }
  // input_scale = max amax of the module's fusion group / 2688, exact by construction.
  std::map<std::string, float> group_amax = amax;
  for (const auto& group : p.plan.recipe.fusion_groups) {
    float m = 0;
    for (const std::string& member : group) m = std::max(m, amax.at(member));
    for (const std::string& member : group) group_amax[member] = m;
  }
  auto out = checkpoint::CheckpointDir::Open((root_ / "out").string());
  ASSERT_TRUE(out.ok()) << out.status();
  for (const std::string& m : p.plan.recipe.modules) {
    const checkpoint::TensorView* v = (*out)->Find(m + ".input_scale");
    ASSERT_NE(v, nullptr) << m;
    ASSERT_EQ(v->size, 4u);
    float scale;
    memcpy(&scale, v->data, 4);
    EXPECT_EQ(scale, group_amax.at(m) / 2688.0f) << m;
  }
  EXPECT_EQ(store->GetJob(1)->state, store::JobState::kSucceeded);
}

TEST_F(RunnerTest, Nvfp4WithoutAmaxAndKvFp8FailWithClearMessages) {
  ASSERT_FALSE(fs::exists(root_ / "out"));
  absl::Status s = RunJob(Options(Spec("out", ""), "a.db"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "weight_format nvfp4 needs input amax: give calibration data (calibration.dataset or "
            "datasets), calibration.amax_file or calibration.mode constant, or use w4a16_nvfp4");
  auto store = OpenStore("a.db");
  EXPECT_EQ(store->GetJob(1)->state, store::JobState::kFailed);
  EXPECT_EQ(store->GetJob(1)->error, s.message());
  EXPECT_FALSE(store->HasPlan(1));
  // The job failed before any task ran: the output directory it created and claimed is gone.
  EXPECT_FALSE(fs::exists(root_ / "out"));

  // An existing empty output directory stays, without the job's marker.
  fs::create_directories(root_ / "out");
  s = RunJob(
      Options(Spec("out", ", \"weight_format\": \"w4a16_nvfp4\", \"kv_cache\": \"fp8\""), "b.db"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("kv_cache fp8 needs calibrated KV-cache scales"), std::string::npos)
      << s;
  EXPECT_TRUE(fs::is_directory(root_ / "out"));
  EXPECT_TRUE(fs::is_empty(root_ / "out"));
}

TEST_F(RunnerTest, AmaxFileIsValidated) {
  const SourcePlan p = PlanFor(Spec("out", ""));
  const std::string module = p.plan.recipe.modules.front();
  struct Case {
    std::string json;
    std::string error;
  };
  const std::string file = (root_ / "amax.json").string();
  const std::vector<Case> cases = {
      {"[1, 2]", file + ": expected a JSON object {module: input_amax}"},
      // A key that is not a module, and every value, stay out of the message (the file may be a
      // secret the caller cannot read).
      {"{\"nope.w1\": 1}",
       file + ": the key of entry 1 (7 bytes) is not a linear module of the source checkpoint"},
      {"{\"" + module + "\": -1}", file + ": amax of " + module + " is not a finite float32 >= 0"},
      {"{\"" + module + "\": \"3\"}",
       file + ": amax of " + module + " is not a finite float32 >= 0"},
      {"{\"" + module + "\": 1e39}",
       file + ": amax of " + module + " is not a finite float32 >= 0"},
      {"{\"" + module + "\": ", file + ": not valid JSON (syntax error at byte " +
                                     std::to_string(module.size() + 6) + ")"},
  };
  for (const Case& c : cases) {
    std::ofstream(file) << c.json;
    auto rows = LoadAmaxFile(file, p.inventory, std::nullopt);
    ASSERT_FALSE(rows.ok()) << c.json;
    EXPECT_EQ(rows.status().message(), c.error);
  }
  std::ofstream(file) << "{\"" << module << "\": 0.5, \"embed\": 0}";
  auto rows = LoadAmaxFile(file, p.inventory, std::nullopt);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 2u);
  // In key order.
  EXPECT_EQ((*rows)[0].module, "embed");
  EXPECT_EQ((*rows)[0].value, 0.0);
  EXPECT_EQ((*rows)[1].module, module);
  EXPECT_EQ((*rows)[1].value, 0.5);
  EXPECT_EQ((*rows)[1].kind, "input");
}

// The file is judged by where the opened file lies: a link inside the caller's roots to a file
// outside them is refused, naming the field and the path, never the target.
TEST_F(RunnerTest, AmaxFileOutsideTheRootsIsRefused) {
  const SourcePlan p = PlanFor(Spec("out", ""));
  const std::string module = p.plan.recipe.modules.front();
  const std::filesystem::path mine = root_ / "mine", theirs = root_ / "theirs";
  std::filesystem::create_directories(mine);
  std::filesystem::create_directories(theirs);
  std::ofstream((theirs / "amax.json").string()) << "{\"" << module << "\": 0.5}";
  std::filesystem::create_symlink(theirs / "amax.json", mine / "amax.json");
  const std::string link = (mine / "amax.json").string();
  const checkpoint::SourceRoots roots =
      std::vector<std::string>{std::filesystem::canonical(mine).string()};
  auto rows = LoadAmaxFile(link, p.inventory, roots);
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(rows.status().message(),
            "calibration.amax_file: " + link +
                " leads outside the allowed roots of the caller that submitted the job (a "
                "symbolic link is followed only within them)");
  // Roots that hold the target: read.
  rows = LoadAmaxFile(link, p.inventory,
                      std::vector<std::string>{std::filesystem::canonical(root_).string()});
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->size(), 1u);
}

TEST_F(RunnerTest, AStateFileOfAnotherSpecIsRefused) {
  const JobSpec a = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"");
  const JobSpec b = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\", \"recipe\": \"full\"");
  EXPECT_NE(RunRequestId(a), RunRequestId(b));
  EXPECT_EQ(RunRequestId(a), RunRequestId(Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"")));
  std::atomic<bool> cancel{true};  // plans the job, runs nothing
  RunOptions options = Options(a, "state.db");
  options.cancel = &cancel;
  EXPECT_EQ(RunJob(options).code(), absl::StatusCode::kCancelled);
  absl::Status s = RunJob(Options(b, "state.db"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "state file " + (root_ / "state.db").string() +
                             " belongs to a different job spec (source " + src_ + ", output " +
                             (root_ / "out").string() +
                             "); use another --state file for this spec");
  auto store = OpenStore("state.db");
  auto jobs = store->ListJobs(std::nullopt, 0, 10);
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].state, store::JobState::kPaused);
}

TEST_F(RunnerTest, AStateFileInUseByAnotherProcessIsRefused) {
  const JobSpec spec = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"");
  const std::string lock = (root_ / "state.db.lock").string();
  const int fd = open(lock.c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  // flock locks belong to the open file description: a second open() conflicts like a second
  // process would.
  ASSERT_EQ(flock(fd, LOCK_EX | LOCK_NB), 0);
  absl::Status s = RunJob(Options(spec, "state.db"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "state file " + (root_ / "state.db").string() + " is in use by another quantd run");
  EXPECT_FALSE(fs::exists(root_ / "state.db"));
  close(fd);
  EXPECT_TRUE(RunJob(Options(spec, "state.db")).ok()) << log_.str();
}

TEST_F(RunnerTest, ChangedSourceIsRefused) {
  const JobSpec spec = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"");
  // Paused once planned (a pause while the source is being read would leave no plan).
  std::atomic<bool> cancel{false};
  CancelAfter buf("planned ", 1, &cancel);
  std::ostream log(&buf);
  RunOptions options = Options(spec, "state.db");
  options.cancel = &cancel;
  options.progress = &log;
  ASSERT_EQ(RunJob(options).code(), absl::StatusCode::kCancelled);
  // Same directory, other tensors: a V3 checkpoint.
  fs::remove_all(src_);
  ASSERT_TRUE(
      fixture::WriteFixture(fixture::MakeConfig(fixture::Arch::kDeepseekV3, fixture::Preset::kTiny),
                            7, src_, {})
          .ok());
  absl::Status s = RunJob(Options(spec, "state.db"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message().rfind("the source checkpoint changed since the job was planned", 0), 0u)
      << s;
  EXPECT_EQ(OpenStore("state.db")->GetJob(1)->state, store::JobState::kFailed);
}

TEST_F(RunnerTest, CheckPlanUnchangedNamesTheFirstDifference) {
  const JobSpec spec = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"");
  const SourcePlan p = PlanFor(spec);
  std::vector<store::TaskRow> stored;
  for (const store::StagePlan& stage : p.plan.stages) {
    for (const store::TaskPlan& t : stage.tasks) {
      store::TaskRow row;
      row.stage_kind = stage.kind;
      row.name = t.name;
      row.payload_json = t.payload_json;
      row.bytes_total = t.bytes_total;
      stored.push_back(row);
    }
  }
  EXPECT_TRUE(CheckPlanUnchanged(p.plan, stored).ok());
  const std::string prefix =
      "the source checkpoint changed since the job was planned (or the plan was built by another "
      "quantd version): ";
  std::vector<store::TaskRow> changed = stored;
  changed[2].bytes_total += 1;
  EXPECT_EQ(CheckPlanUnchanged(p.plan, changed).message(),
            prefix + "quantize task " + stored[2].name +
                " now covers different tensors or bytes (" + std::to_string(stored[2].bytes_total) +
                " bytes, stored " + std::to_string(stored[2].bytes_total + 1) + ")");
  changed = stored;
  changed.pop_back();
  EXPECT_EQ(CheckPlanUnchanged(p.plan, changed).message(),
            prefix + "verify task " + stored.back().name + " is new");
  changed = stored;
  changed.push_back(stored.back());
  EXPECT_EQ(CheckPlanUnchanged(p.plan, changed).message(),
            prefix + "verify task " + stored.back().name + " is gone");
}

TEST_F(RunnerTest, CorruptShardFailsTheJobNamingShardAndTensorAndResumesOnceFixed) {
  const JobSpec spec = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"");
  const SourcePlan p = PlanFor(spec);
  // The third quantize task's first MXFP4 module, stored in that task's shard.
  const store::TaskPlan& victim = p.plan.stages[1].tasks[2];
  auto payload = ParseShardTask(victim.payload_json);
  ASSERT_TRUE(payload.ok());
  std::string module, scale_tensor;
  for (const std::string& m : payload->modules) {
    for (const LinearModule& lm : p.inventory.linears) {
      if (lm.name == m && lm.format == TensorFormat::kMxfp4 &&
          p.source->ShardOf(lm.tensors[0])->path() == src_ + "/" + victim.name) {
        module = m;
        scale_tensor = lm.tensors[1];
      }
    }
    if (!module.empty()) break;
  }
  ASSERT_FALSE(module.empty());
  const checkpoint::TensorView* scale = p.source->Find(scale_tensor);
  ASSERT_NE(scale, nullptr);
  const std::string shard_path = src_ + "/" + victim.name;
  const uint64_t offset = scale->offset + 5;
  char original;
  {
    std::fstream f(shard_path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(offset);
    f.get(original);
    f.seekp(offset);
    f.put(static_cast<char>(0xFF));  // E8M0 NaN
  }
  const RunOptions options = Options(spec, "state.db");
  absl::Status s = RunJob(options);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(victim.name), std::string::npos) << s;
  EXPECT_NE(s.message().find(module), std::string::npos) << s;

  auto store = OpenStore("state.db");
  EXPECT_EQ(store->GetJob(1)->state, store::JobState::kFailed);
  EXPECT_EQ(store->GetJob(1)->error, s.message());
  std::vector<store::TaskRow> quantize = Tasks(*store, "quantize");
  ASSERT_EQ(quantize.size(), 4u);
  EXPECT_EQ(quantize[2].state, store::TaskState::kFailed);
  EXPECT_EQ(quantize[2].error, s.message());
  EXPECT_FALSE(fs::exists(root_ / "out" / victim.name));
  // The shards before it are done and stay on disk.
  std::map<std::string, std::string> done_sha;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(quantize[i].state, store::TaskState::kDone);
    EXPECT_EQ(*checkpoint::Sha256File(quantize[i].output_path), quantize[i].output_sha256);
    done_sha[quantize[i].name] = quantize[i].output_sha256;
  }
  EXPECT_EQ(Tasks(*store, "export")[0].state, store::TaskState::kPending);
  store.reset();

  {
    std::fstream f(shard_path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(offset);
    f.put(original);
  }
  ASSERT_TRUE(RunJob(options).ok()) << log_.str();
  store = OpenStore("state.db");
  EXPECT_EQ(store->GetJob(1)->state, store::JobState::kSucceeded);
  quantize = Tasks(*store, "quantize");
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(quantize[i].attempt, 1);  // not redone
    EXPECT_EQ(quantize[i].output_sha256, done_sha.at(quantize[i].name));
  }
  EXPECT_EQ(quantize[2].attempt, 2);
  EXPECT_EQ(quantize[2].state, store::TaskState::kDone);

  // Same bytes as a run that never saw the corruption.
  ASSERT_TRUE(
      RunJob(Options(Spec("clean", ", \"weight_format\": \"w4a16_nvfp4\""), "clean.db")).ok());
  EXPECT_EQ(Hashes((root_ / "out").string()), Hashes((root_ / "clean").string()));
}

TEST_F(RunnerTest, CancelPausesAfterRunningTasksAndTheNextRunFinishes) {
  const JobSpec spec = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"");
  std::atomic<bool> cancel{false};
  CancelAfter buf("safetensors done: ", 2, &cancel);  // after the second quantize task
  std::ostream log(&buf);
  RunOptions options = Options(spec, "state.db");
  options.progress = &log;
  options.cancel = &cancel;
  absl::Status s = RunJob(options);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s << buf.str();

  auto store = OpenStore("state.db");
  auto job = store->GetJob(1);
  EXPECT_EQ(job->state, store::JobState::kPaused);
  EXPECT_EQ(job->reason, "interrupted");
  int quantized = 0;
  for (const store::TaskRow& t : Tasks(*store, "quantize")) {
    EXPECT_NE(t.state, store::TaskState::kLeased) << t.name;
    quantized += t.state == store::TaskState::kDone;
  }
  EXPECT_GE(quantized, 2);
  EXPECT_EQ(Tasks(*store, "export")[0].state, store::TaskState::kPending);
  // The verify of a quantized shard may have run too: it waits for that shard only.
  int done = 0;
  const absl::StatusOr<std::vector<store::TaskRow>> tasks = store->ListTasks(1);
  ASSERT_TRUE(tasks.ok()) << tasks.status();
  for (const store::TaskRow& t : *tasks) done += t.state == store::TaskState::kDone;
  store.reset();

  cancel = false;
  ASSERT_TRUE(RunJob(Options(spec, "state.db")).ok()) << log_.str();
  EXPECT_NE(log_.str().find("resuming job 1: " + std::to_string(done) + " of 10 tasks done"),
            std::string::npos)
      << log_.str();
  ASSERT_TRUE(
      RunJob(Options(Spec("clean", ", \"weight_format\": \"w4a16_nvfp4\""), "clean.db")).ok());
  EXPECT_EQ(Hashes((root_ / "out").string()), Hashes((root_ / "clean").string()));
}

// Issue 9 §4: on resume, a done task whose output is gone or changed is redone, and so are the done
// tasks after it (export indexed the shard, verify read it).
TEST_F(RunnerTest, ResumeRebuildsDoneOutputsThatAreGoneOrChanged) {
  const JobSpec spec = Spec("out", ", \"weight_format\": \"w4a16_nvfp4\"");
  std::atomic<bool> cancel{false};
  // Once every quantize task is done (export and the verify of the last shard are still to run).
  CancelAfter buf("safetensors done: ", 4, &cancel);
  std::ostream log(&buf);
  RunOptions options = Options(spec, "state.db");
  options.progress = &log;
  options.cancel = &cancel;
  absl::Status s = RunJob(options);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s << buf.str();
  auto store = OpenStore("state.db");
  const std::vector<store::TaskRow> quantize = Tasks(*store, "quantize");
  ASSERT_EQ(quantize.size(), 4u);
  for (const store::TaskRow& t : quantize) ASSERT_EQ(t.state, store::TaskState::kDone) << t.name;
  // Export ran when it started before the cancel; it runs once more either way (requeued when it
  // had indexed the changed shards, resumed when it had not run or was interrupted).
  const int export_attempts = Tasks(*store, "export")[0].attempt;
  store.reset();
  // Shard 1 deleted; shard 2 with one byte flipped (same size, other SHA-256).
  fs::remove(quantize[0].output_path);
  {
    std::fstream f(quantize[1].output_path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char last = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(last ^ 1));
  }

  ASSERT_TRUE(RunJob(Options(spec, "state.db")).ok()) << log_.str();
  EXPECT_NE(log_.str().find(quantize[0].output_path + " is gone"), std::string::npos)
      << log_.str();
  EXPECT_NE(log_.str().find(quantize[1].output_path + " no longer has the recorded SHA-256"),
            std::string::npos)
      << log_.str();
  store = OpenStore("state.db");
  const std::vector<store::TaskRow> after = Tasks(*store, "quantize");
  EXPECT_EQ(after[0].attempt, 2);
  EXPECT_EQ(after[1].attempt, 2);
  EXPECT_EQ(after[2].attempt, 1);
  EXPECT_EQ(after[3].attempt, 1);
  EXPECT_EQ(Tasks(*store, "export")[0].attempt, export_attempts + 1);
  for (const store::TaskRow& t : Tasks(*store, "verify")) {
    EXPECT_EQ(t.state, store::TaskState::kDone) << t.name;
  }
  ASSERT_TRUE(
      RunJob(Options(Spec("clean", ", \"weight_format\": \"w4a16_nvfp4\""), "clean.db")).ok());
  EXPECT_EQ(Hashes((root_ / "out").string()), Hashes((root_ / "clean").string()));
}

TEST(FindChangedOutputsTest, NamesMissingResizedAndRewrittenFilesOnly) {
  const fs::path dir = fs::temp_directory_path() / ("quantd_changed_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name, std::ios::binary) << text;
    return (dir / name).string();
  };
  const auto done = [](int64_t id, const std::string& path, int64_t bytes, const std::string& sha) {
    store::TaskRow t;
    t.id = id;
    t.stage_kind = "quantize";
    t.name = "t" + std::to_string(id);
    t.state = store::TaskState::kDone;
    t.output_path = path;
    t.output_bytes = bytes;
    t.output_sha256 = sha;
    return t;
  };
  // SHA-256("abc")
  const std::string abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
  std::vector<store::TaskRow> tasks = {
      done(1, write("same", "abc"), 3, abc),
      done(2, (dir / "gone").string(), 3, abc),
      done(3, write("longer", "abcd"), 3, abc),
      done(4, write("rewritten", "abd"), 3, abc),
      done(5, dir.string(), 0, "manifest"),  // a directory (export): not checked here
      done(6, "", 0, ""),                     // no output (inspect)
  };
  store::TaskRow pending = done(7, (dir / "gone").string(), 3, abc);
  pending.state = store::TaskState::kPending;
  tasks.push_back(pending);
  auto changed = FindChangedOutputs(tasks);
  ASSERT_TRUE(changed.ok()) << changed.status();
  ASSERT_EQ(changed->size(), 3u);
  EXPECT_EQ((*changed)[0].first, 2);
  EXPECT_EQ((*changed)[0].second, "quantize t2: output " + (dir / "gone").string() + " is gone");
  EXPECT_EQ((*changed)[1].first, 3);
  EXPECT_EQ((*changed)[1].second,
            "quantize t3: output " + (dir / "longer").string() + " has 4 bytes, recorded 3");
  EXPECT_EQ((*changed)[2].first, 4);
  fs::remove_all(dir);
}

TEST(RetryTest, TransientErrorsBackOffTwiceThenFailPermanentErrorsFailAtOnce) {
  using absl::StatusCode;
  for (StatusCode code :
       {StatusCode::kUnavailable, StatusCode::kResourceExhausted, StatusCode::kCancelled}) {
    EXPECT_EQ(RetryDelayMs(code, 1), 2000);
    EXPECT_EQ(RetryDelayMs(code, 2), 4000);
    EXPECT_EQ(RetryDelayMs(code, kMaxAttempts), std::nullopt);
  }
  for (StatusCode code : {StatusCode::kInvalidArgument, StatusCode::kDataLoss,
                          StatusCode::kFailedPrecondition, StatusCode::kInternal}) {
    EXPECT_EQ(RetryDelayMs(code, 1), std::nullopt);
  }
}

// A running stage as the scheduler's snapshots report it; `eta` < 0: none.
v1::StageProgress Running(const std::string& kind, int64_t done, int64_t total, int64_t bytes_done,
                          int64_t bytes_total, double rate = 0, double eta = -1,
                          const std::string& unit = "bytes") {
  v1::StageProgress s;
  s.set_kind(kind);
  s.set_unit(unit);
  s.set_state(v1::StageProgress::RUNNING);
  s.set_tasks_done(done);
  s.set_tasks_total(total);
  s.set_bytes_done(bytes_done);
  s.set_bytes_total(bytes_total);
  s.set_bytes_per_second(rate);
  if (eta >= 0) s.set_eta_seconds(eta);
  return s;
}

// `quantd run`'s line is quantctl's stage line without the bar (the same formatter).
TEST(ProgressTest, PlainLineFormat) {
  const auto line = [](const v1::StageProgress& s) {
    return FormatStageLine(s, StageLineStyle::kPlain);
  };
  // (805.3 - 140.2) GB / 2.31 GB/s = 287.9 s
  EXPECT_EQ(line(Running("quantize", 12, 64, 140'200'000'000, 805'300'000'000, 2.31e9, 287.9)),
            "quantize  12/64 tasks  140.2/805.3 GB  2.31 GB/s  ETA 4m48s");
  EXPECT_EQ(line(Running("quantize", 12, 64, 140'200'000'000, 805'300'000'000)),
            "quantize  12/64 tasks  140.2/805.3 GB");
  EXPECT_EQ(line(Running("verify", 3, 4, 4'500'000, 6'000'000, 1e6, 1.5)),
            "verify  3/4 tasks  4.5/6.0 MB  1.00 MB/s  ETA 2s");
  EXPECT_EQ(line(Running("export", 0, 1, 0, 0)), "export  0/1 tasks");
  // The calibrate stage counts tokens: (4096 - 1536) / 410 per s = 6.2 s.
  EXPECT_EQ(line(Running("calibrate", 3, 8, 1536, 4096, 410.0, 6.2, "tokens")),
            "calibrate  3/8 tasks  1.5k/4.1k tokens  410 tokens/s  ETA 6s");
  EXPECT_EQ(FormatStageLine(Running("calibrate", 3, 8, 1536, 4096, 410.0, 6.2, "tokens"),
                            StageLineStyle::kBar),
            "calibrate  [#######.............]  3/8 tasks  1.5k/4.1k tokens  410 tokens/s  ETA 6s");
  EXPECT_EQ(FormatDuration(0.4), "0s");
  EXPECT_EQ(FormatDuration(59.4), "59s");
  EXPECT_EQ(FormatDuration(60), "1m00s");
  EXPECT_EQ(FormatDuration(3599), "59m59s");
  EXPECT_EQ(FormatDuration(7500), "2h05m");
}

TEST(ProgressTest, PlainLinesPerTaskAndInPlaceRedrawOnATerminal) {
  std::ostringstream plain;
  {
    ProgressPrinter p(&plain, /*tty=*/false);
    p.Show(Running("quantize", 1, 4, 1'000'000, 4'000'000));
    p.Show(Running("quantize", 1, 4, 1'700'000, 4'000'000, 1e6, 2.3));  // bytes only: no line
    p.Show(Running("quantize", 2, 4, 2'000'000, 4'000'000, 1e6, 2));
    p.Message("hello");
  }
  // A line when the task count grows (the first snapshot's count counts as grown), nothing else.
  EXPECT_EQ(plain.str(),
            "quantize  1/4 tasks  1.0/4.0 MB\n"
            "quantize  2/4 tasks  2.0/4.0 MB  1.00 MB/s  ETA 2s\nhello\n");

  std::ostringstream tty;
  {
    ProgressPrinter p(&tty, /*tty=*/true);
    p.Show(Running("export", 0, 1, 0, 0));
    p.Message("hello");
    p.Show(Running("export", 1, 1, 0, 0));  // task count changed: drawn at once
    p.Finish();
  }
  EXPECT_EQ(tty.str(),
            "\rexport  0/1 tasks\x1b[K\r\x1b[Khello\n\rexport  1/1 tasks\x1b[K\rexport  1/1 "
            "tasks\x1b[K\n");
}

}  // namespace
}  // namespace quantd::pipeline
