// The scheduler on the tiny V4 fixture with CPU workers: jobs run to SUCCEEDED with the board
// following them, idempotent submission, device holding and the queue limit, cancel / pause /
// resume / delete transitions with their reasons, shutdown that leaves jobs for the next start,
// and the report.
#include "server/scheduler/scheduler.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "server/fixture/fixture.h"
#include "server/scheduler/job_proto.h"
#include "server/store/job_store.h"
#include "tests/unit/test_dirs.h"

namespace quantd::scheduler {
namespace {

namespace fs = std::filesystem;

class SchedulerTest : public testing_util::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    src_ = dir_ + "/src";
    auto summary = fixture::WriteFixture(
        fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny), 3, src_, {});
    ASSERT_TRUE(summary.ok()) << summary.status();
  }

  job::JobSpec Spec(const std::string& out, const std::string& extra = "") {
    auto spec = job::ParseJobSpec("{\"source\": \"" + src_ + "\", \"output\": \"" + dir_ + "/" +
                                      out + "\", \"weight_format\": \"w4a16_nvfp4\"" + extra + "}",
                                  "test");
    EXPECT_TRUE(spec.ok()) << spec.status();
    return *spec;
  }

  std::unique_ptr<Scheduler> Start(std::vector<std::string> devices, int queue_limit = 64) {
    auto store = store::JobStore::Open(dir_ + "/state.db");
    EXPECT_TRUE(store.ok()) << store.status();
    SchedulerOptions options;
    options.devices = std::move(devices);
    options.cpu_threads = 1;
    options.queue_limit = queue_limit;
    auto scheduler = Scheduler::Start(std::move(*store), options);
    EXPECT_TRUE(scheduler.ok()) << scheduler.status();
    return std::move(*scheduler);
  }

  v1::Job Submit(Scheduler& s, const job::JobSpec& spec, const std::string& request_id = "") {
    auto job = s.Submit(request_id, spec, nullptr);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  // Waits until the job has at least one finished task of `stage` (and is still RUNNING).
  void WaitForDoneTask(Scheduler& s, int64_t id, const std::string& stage) {
    auto job = s.WaitUntilStopped(id, [&](const v1::Job& j) {
      for (const v1::StageProgress& p : j.stages()) {
        if (p.kind() == stage && p.tasks_done() > 0) return false;
      }
      return true;
    });
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_EQ(job->state(), v1::RUNNING) << job->DebugString();
  }

  std::string src_;  // the tiny V4 fixture
};

TEST_F(SchedulerTest, AJobRunsToSucceededAndTheBoardFollowsIt) {
  auto s = Start({"cpu", "cpu"});
  const v1::Job submitted = Submit(*s, Spec("out"));
  EXPECT_EQ(submitted.state(), v1::PENDING);
  EXPECT_EQ(submitted.spec().weight_format(), "w4a16_nvfp4");
  EXPECT_EQ(submitted.spec().recipe(), "experts");
  auto done = s->WaitUntilStopped(submitted.id(), nullptr);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::SUCCEEDED) << done->last_error();
  EXPECT_TRUE(done->has_end_time());
  EXPECT_EQ(done->current_stage(), "");
  // inspect, quantize x4, export, verify x4: every task once, no retries.
  std::vector<std::string> kinds;
  int64_t tasks = 0;
  for (const v1::StageProgress& p : done->stages()) {
    kinds.push_back(p.kind());
    EXPECT_EQ(p.state(), v1::StageProgress::SUCCEEDED) << p.kind();
    EXPECT_EQ(p.tasks_done(), p.tasks_total()) << p.kind();
    EXPECT_EQ(p.bytes_done(), p.bytes_total()) << p.kind();
    EXPECT_EQ(p.task_attempts(), p.tasks_total()) << p.kind();
    tasks += p.tasks_total();
  }
  EXPECT_EQ(kinds, (std::vector<std::string>{"inspect", "quantize", "export", "verify"}));
  EXPECT_EQ(done->task_attempts(), tasks);
  EXPECT_EQ(done->task_retries(), 0);
  EXPECT_TRUE(fs::exists(dir_ + "/out/model.safetensors.index.json"));
  EXPECT_EQ(s->board().CountByState(), (std::map<std::string, int64_t>{{"SUCCEEDED", 1}}));

  auto report = s->Report(submitted.id(), 3);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->state(), v1::SUCCEEDED);
  ASSERT_EQ(report->tensors_size(), 3);
  EXPECT_GT(report->tensors_total(), 3);
  EXPECT_EQ(report->min_sqnr_db(), report->tensors(0).sqnr_db());
  EXPECT_LE(report->tensors(0).sqnr_db(), report->tensors(1).sqnr_db());
  EXPECT_LE(report->tensors(1).sqnr_db(), report->tensors(2).sqnr_db());
  EXPECT_GE(report->mean_sqnr_db(), report->min_sqnr_db());
  ASSERT_EQ(report->rules_size(), 4);  // one verify task per output shard
  for (const v1::RuleCheck& r : report->rules()) {
    EXPECT_TRUE(r.passed()) << r.name() << ": " << r.message();
    EXPECT_EQ(r.name().rfind("verify model-", 0), 0u) << r.name();
  }
}

TEST_F(SchedulerTest, SubmitIsIdempotentOnRequestId) {
  auto s = Start({"cpu"});
  bool created = false;
  auto first = s->Submit("req-1", Spec("out"), &created);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(created);
  auto again = s->Submit("req-1", Spec("out"), &created);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(created);
  EXPECT_EQ(again->id(), first->id());
  auto other = s->Submit("req-1", Spec("elsewhere"), &created);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ReasonOf(other.status()), "REQUEST_ID_REUSED");
  EXPECT_EQ(other.status().message(),
            "request_id \"req-1\" was used for job " + std::to_string(first->id()) +
                " with another spec");
  auto missing = s->Submit("", Spec("gpu", ", \"devices\": [\"cuda:0\"]"), &created);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.status().message(),
            "spec.devices: cuda:0 is not a device of this quantd (it has cpu)");
  EXPECT_EQ(ReasonOf(missing.status()), "INVALID_SPEC");
}

TEST_F(SchedulerTest, JobsHoldTheirDevicesRunInOrderAndTheQueueIsBounded) {
  auto s = Start({"cpu"}, /*queue_limit=*/1);
  const v1::Job a = Submit(*s, Spec("a"));
  WaitForDoneTask(*s, a.id(), "inspect");
  const v1::Job b = Submit(*s, Spec("b"));
  // b waits for the one worker; the queue holds one PENDING job, so a third is refused.
  EXPECT_EQ(s->board().Get(b.id())->state(), v1::PENDING);
  auto c = s->Submit("", Spec("c"), nullptr);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ReasonOf(c.status()), "QUEUE_FULL");
  EXPECT_EQ(c.status().message(), "the queue is full: 1 jobs are PENDING (limit 1)");
  auto a_done = s->WaitUntilStopped(a.id(), nullptr);
  auto b_done = s->WaitUntilStopped(b.id(), nullptr);
  ASSERT_TRUE(a_done.ok() && b_done.ok());
  ASSERT_EQ(a_done->state(), v1::SUCCEEDED) << a_done->last_error();
  ASSERT_EQ(b_done->state(), v1::SUCCEEDED) << b_done->last_error();
  // b started only once a had released the device.
  const auto ms = [](const google::protobuf::Timestamp& t) {
    return t.seconds() * 1000 + t.nanos() / 1'000'000;
  };
  EXPECT_GE(ms(b_done->start_time()), ms(a_done->end_time()));
}

TEST_F(SchedulerTest, CancelPauseResumeAndDeleteFollowTheJobModel) {
  auto s = Start({"cpu"});
  const std::string bf16 = ", \"materialize_bf16\": \"" + dir_ + "/bf16\"";
  const v1::Job job = Submit(*s, Spec("out", bf16));
  WaitForDoneTask(*s, job.id(), "inspect");

  auto running_delete = s->Delete(job.id());
  EXPECT_EQ(running_delete.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonOf(running_delete), "JOB_RUNNING");

  auto pausing = s->Cancel(job.id(), /*pause=*/true);
  ASSERT_TRUE(pausing.ok()) << pausing.status();
  auto paused = s->WaitUntilStopped(job.id(), nullptr);
  ASSERT_TRUE(paused.ok());
  ASSERT_EQ(paused->state(), v1::PAUSED) << paused->DebugString();
  EXPECT_EQ(paused->reason(), "paused");
  // Pausing a PAUSED job changes nothing; resuming a PAUSED one queues it again.
  EXPECT_EQ(s->Cancel(job.id(), true)->state(), v1::PAUSED);
  auto resumed = s->Resume(job.id());
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->state(), v1::PENDING);
  EXPECT_EQ(resumed->reason(), "resumed");
  auto done = s->WaitUntilStopped(job.id(), nullptr);
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::SUCCEEDED) << done->last_error();

  auto again = s->Resume(job.id());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonOf(again.status()), "TRANSITION_FORBIDDEN");
  EXPECT_EQ(again.status().message(),
            "job 1 is SUCCEEDED; only a PAUSED or FAILED job can be resumed");
  auto cancel_done = s->Cancel(job.id(), false);
  EXPECT_EQ(cancel_done.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cancel_done.status().message(), "job 1 is SUCCEEDED; it cannot be cancelled");

  // A queued job can be cancelled but not paused; a cancelled one is final.
  auto s_busy = Submit(*s, Spec("second", bf16));
  auto queued = Submit(*s, Spec("third"));
  auto pause_queued = s->Cancel(queued.id(), true);
  if (s->board().Get(queued.id())->state() == v1::PENDING) {
    EXPECT_EQ(pause_queued.status().code(), absl::StatusCode::kFailedPrecondition);
  }
  auto cancelled = s->Cancel(queued.id(), false);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  auto final_state = s->WaitUntilStopped(queued.id(), nullptr);
  EXPECT_EQ(final_state->state(), v1::CANCELLED);
  EXPECT_EQ(final_state->reason(), "cancelled");
  EXPECT_EQ(s->Cancel(queued.id(), false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s->Cancel(s_busy.id(), false).ok());
  EXPECT_EQ(s->WaitUntilStopped(s_busy.id(), nullptr)->state(), v1::CANCELLED);

  EXPECT_TRUE(s->Delete(queued.id()).ok());
  EXPECT_FALSE(s->board().Get(queued.id()).has_value());
  auto gone = s->Cancel(queued.id(), false);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ReasonOf(gone.status()), "JOB_NOT_FOUND");
  EXPECT_EQ(gone.status().message(), "job 3 not found");
  EXPECT_EQ(s->Report(99, 0).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SchedulerTest, ShutdownLeavesTheJobRunningAndTheNextStartFinishesIt) {
  int64_t id = 0;
  {
    auto s = Start({"cpu"});
    id = Submit(*s, Spec("out", ", \"materialize_bf16\": \"" + dir_ + "/bf16\"")).id();
    WaitForDoneTask(*s, id, "dequant");
    s->Shutdown(std::chrono::seconds(30));
    EXPECT_EQ(s->Submit("", Spec("late"), nullptr).status().code(),
              absl::StatusCode::kUnavailable);
  }
  {
    auto store = store::JobStore::Open(dir_ + "/state.db");
    ASSERT_TRUE(store.ok());
    EXPECT_EQ((*store)->GetJob(id)->state, store::JobState::kRunning);
    auto tasks = (*store)->ListTasks(id);
    ASSERT_TRUE(tasks.ok()) << tasks.status();
    for (const store::TaskRow& t : *tasks) EXPECT_NE(t.state, store::TaskState::kLeased) << t.name;
  }
  auto s = Start({"cpu"});
  auto done = s->WaitUntilStopped(id, nullptr);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::SUCCEEDED) << done->last_error();
  EXPECT_EQ(done->reason(), "");
  EXPECT_EQ(done->task_retries(), 0);
}

// Threads of this process whose nice value (field 19 of /proc/self/task/<tid>/stat) is `nice`.
int ThreadsWithNice(int nice) {
  int n = 0;
  for (const auto& task : fs::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // The command name (field 2) may hold spaces; the fields after its closing ')' do not.
    std::istringstream rest(stat.substr(stat.rfind(')') + 2));
    std::string field;
    for (int i = 3; i <= 19 && rest >> field; ++i) {
      if (i == 19 && std::stoi(field) == nice) ++n;
    }
  }
  return n;
}

TEST_F(SchedulerTest, WorkerThreadsRunAtTheirNiceValue) {
  auto store = store::JobStore::Open(dir_ + "/state.db");
  ASSERT_TRUE(store.ok());
  SchedulerOptions options;
  options.devices = {"cpu", "cpu", "cpu"};
  options.worker_nice = 7;
  const int base = getpriority(PRIO_PROCESS, static_cast<id_t>(gettid()));
  if (base + 7 > 19) GTEST_SKIP() << "the test runs at nice " << base;
  ASSERT_EQ(ThreadsWithNice(base + 7), 0);
  auto s = Scheduler::Start(std::move(*store), options);
  ASSERT_TRUE(s.ok()) << s.status();
  // Each worker lowers its own priority as it starts; the other threads keep theirs.
  for (int i = 0; i < 100 && ThreadsWithNice(base + 7) < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(ThreadsWithNice(base + 7), 3);
  EXPECT_GE(ThreadsWithNice(base), 2);  // this thread and the scheduler thread
}

}  // namespace
}  // namespace quantd::scheduler
