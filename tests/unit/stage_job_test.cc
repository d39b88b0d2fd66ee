// PreparedJob and a stage's per-job object (pipeline/stage.h StageJob): the engine opens it once
// per start with what the store knows, attaches it after the plan is stored, hands it to the
// stage's own tasks (and, by kind, to other stages' tasks), and tells it each committed
// completion with the stage's own result; a stateless stage's tasks get none.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/fixture/fixture.h"
#include "server/job/job_spec.h"
#include "server/pipeline/prepared_job.h"
#include "server/pipeline/stage_registry.h"
#include "server/store/job_store.h"
#include "tests/unit/test_dirs.h"

namespace quantd::pipeline {
namespace {

// What a "count" task hands its job object: the task's name, marked.
struct CountResult final : StageResult {
  std::string marked;
};

// Logs every call the engine makes into `log`.
class CountJob final : public StageJob {
 public:
  explicit CountJob(std::vector<std::string>* log) : log_(log) {}
  absl::Status Attach(StageJobAttach& attach) override {
    int64_t done = 0;
    for (const store::TaskRow& t : *attach.tasks) done += t.state == store::TaskState::kDone;
    log_->push_back(absl::StrCat("attach tasks=", attach.tasks->size(), " done=", done));
    return absl::OkStatus();
  }
  void TaskDone(const store::TaskRow& task, const TaskOutput& output) override {
    log_->push_back(absl::StrCat("done ", task.name, " ",
                                 static_cast<const CountResult*>(output.result.get())->marked));
  }

 private:
  std::vector<std::string>* log_;
};

// Two tasks, "a" then "b", and a job object.
class CountStage final : public Stage {
 public:
  explicit CountStage(std::vector<std::string>* log) : log_(log) {}
  std::string_view kind() const override { return "count"; }
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput&) const override {
    return std::vector<store::TaskPlan>{{"a", "{}", 0, "a", {}, {}},
                                        {"b", "{}", 0, "b", {}, {{"count", "a"}}}};
  }
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device&,
                                 const StageContext& ctx) const override {
    EXPECT_NE(ctx.job, nullptr);
    EXPECT_EQ(ctx.job_of("count"), ctx.job);
    log_->push_back("run " + task.name);
    TaskOutput out;
    auto result = std::make_unique<CountResult>();
    result->marked = task.name + "!";
    out.result = std::move(result);
    return out;
  }
  absl::StatusOr<std::unique_ptr<StageJob>> OpenJob(const StageJobInput& input) const override {
    log_->push_back(absl::StrCat("open planned=", input.stored->planned,
                                 " stored=", input.stored->tasks.size(),
                                 " changed=", input.changed_outputs->size()));
    return std::make_unique<CountJob>(log_);
  }

 private:
  std::vector<std::string>* log_;
};

// One task after the count stage's, and no job object.
class PlainStage final : public Stage {
 public:
  explicit PlainStage(std::vector<std::string>* log) : log_(log) {}
  std::string_view kind() const override { return "plain"; }
  absl::StatusOr<std::vector<store::TaskPlan>> Plan(const PlanInput&) const override {
    return std::vector<store::TaskPlan>{{"p", "{}", 0, "p", {}, {{"count", "b"}}}};
  }
  absl::StatusOr<TaskOutput> Run(const store::TaskRow& task, compute::Device&,
                                 const StageContext& ctx) const override {
    EXPECT_EQ(ctx.job, nullptr);
    EXPECT_NE(ctx.job_of("count"), nullptr);
    log_->push_back("run " + task.name);
    return TaskOutput();
  }

 private:
  std::vector<std::string>* log_;
};

class StageJobTest : public testing_util::TempDirTest {};

TEST_F(StageJobTest, OpenedPerStartAttachedGivenToItsTasksAndToldOfEachCompletion) {
  const std::string src = dir_ + "/src";
  ASSERT_TRUE(fixture::WriteFixture(
                  fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny), 7,
                  src, {})
                  .ok());
  const std::string spec_json = absl::StrCat(R"({"source": ")", src, R"(", "output": ")", dir_,
                                             R"(/out", "weight_format": "w4a16_nvfp4"})");
  absl::StatusOr<job::JobSpec> spec = job::ParseJobSpec(spec_json, "test");
  ASSERT_TRUE(spec.ok()) << spec.status();
  std::vector<std::string> log;
  std::vector<std::unique_ptr<Stage>> stages;
  stages.push_back(std::make_unique<CountStage>(&log));
  stages.push_back(std::make_unique<PlainStage>(&log));
  const StageRegistry registry(std::move(stages));
  auto store = store::JobStore::Open(dir_ + "/state.db");
  ASSERT_TRUE(store.ok()) << store.status();
  auto job_id = (*store)->CreateJob("r", spec_json, 0);
  ASSERT_TRUE(job_id.ok()) << job_id.status();
  compute::DeviceOptions cpu;
  cpu.cpu_threads = 1;
  auto device = compute::OpenDevice("cpu", cpu);
  ASSERT_TRUE(device.ok()) << device.status();

  for (int start = 0; start < 2; ++start) {
    auto stored = ReadStoredJob(**store, *job_id);
    ASSERT_TRUE(stored.ok()) << stored.status();
    auto job = PreparedJob::Load(*spec, *std::move(stored), {}, registry);
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_TRUE((*job)->Attach(**store, 0, nullptr).ok());
    for (;;) {
      store::TaskLease lease;
      auto task = (*store)->LeaseNextTask(*job_id, "test", 0, 60000, &lease);
      ASSERT_TRUE(task.ok()) << task.status();
      if (!task->has_value()) break;
      auto output = (*job)->RunTask(**task, **device, nullptr, nullptr);
      ASSERT_TRUE(output.ok()) << output.status();
      ASSERT_TRUE((*job)->CompleteTask(**store, lease, **task, *output, 0).ok());
    }
  }
  EXPECT_EQ(log, (std::vector<std::string>{
                     "open planned=0 stored=0 changed=0", "attach tasks=3 done=0", "run a",
                     "done a a!", "run b", "done b b!", "run p",
                     // The second start finds every task done: nothing runs.
                     "open planned=1 stored=3 changed=0", "attach tasks=3 done=3"}));
}

}  // namespace
}  // namespace quantd::pipeline
