// History retention: which finished jobs a policy prunes, and a pass that keeps a job resumed
// between its selection and its deletion (api/history_pruner.h).
#include "server/api/history_pruner.h"

#include <gtest/gtest.h>

#include <google/protobuf/util/time_util.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "absl/strings/match.h"
#include "server/scheduler/scheduler.h"
#include "server/store/job_store.h"
#include "tests/unit/test_dirs.h"

namespace quantd::api {
namespace {

constexpr int64_t kDayMs = 24 * 3600 * 1000;
constexpr int64_t kNow = 100 * kDayMs;

v1::Job Job(int64_t id, v1::JobState state, int64_t ended_days_ago = -1) {
  v1::Job job;
  job.set_id(id);
  job.set_state(state);
  if (ended_days_ago >= 0) {
    *job.mutable_end_time() =
        google::protobuf::util::TimeUtil::MillisecondsToTimestamp(kNow - ended_days_ago * kDayMs);
  }
  return job;
}

TEST(JobsToPruneTest, KeepsTheNewestFinishedJobsAndEveryUnfinishedOne) {
  const std::vector<v1::Job> jobs = {
      Job(1, v1::SUCCEEDED, 9), Job(2, v1::FAILED, 8), Job(3, v1::PAUSED),
      Job(4, v1::CANCELLED, 7), Job(5, v1::RUNNING), Job(6, v1::PENDING), Job(7, v1::SUCCEEDED, 1)};
  EXPECT_EQ(JobsToPrune(jobs, {2, 0}, kNow), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(JobsToPrune(jobs, {0, 7.5}, kNow), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(JobsToPrune(jobs, {1, 0}, kNow), (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(JobsToPrune(jobs, {10, 30}, kNow), (std::vector<int64_t>{}));
  EXPECT_EQ(JobsToPrune(jobs, {0, 0.5}, kNow), (std::vector<int64_t>{1, 2, 4, 7}));
}

// Every job fails in its source phase; one whose output ends in "/held" waits there until LetGo,
// holding the only worker, so that a resumed job stays PENDING behind it.
class FailingPlanner final : public scheduler::JobPlanner {
 public:
  absl::StatusOr<std::unique_ptr<scheduler::LoadedJob>> Load(const job::JobSpec& spec,
                                                             pipeline::StoredJob) override {
    if (absl::EndsWith(spec.output, "/held")) {
      std::unique_lock<std::mutex> lock(mu_);
      holding_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return let_go_; });
    }
    return absl::NotFoundError("no source here");
  }
  bool WaitUntilHolding() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(60), [&] { return holding_; });
  }
  void LetGo() {
    std::lock_guard<std::mutex> lock(mu_);
    let_go_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;               // guards the members below
  std::condition_variable cv_;  // signalled when a held load begins and on LetGo
  bool holding_ = false;        // a held load waits
  bool let_go_ = false;         // held loads may end
};

class PruneHistoryTest : public testing_util::TempDirTest {
 protected:
  job::JobSpec Spec(const std::string& out) {
    auto spec = job::ParseJobSpec(
        "{\"source\": \"" + dir_ + "/src\", \"output\": \"" + dir_ + "/" + out + "\"}", "test");
    EXPECT_TRUE(spec.ok()) << spec.status();
    return *spec;
  }
};

TEST_F(PruneHistoryTest, AJobResumedBetweenSelectionAndDeleteIsKept) {
  auto planner = std::make_shared<FailingPlanner>();
  auto store = store::JobStore::Open(dir_ + "/state.db");
  ASSERT_TRUE(store.ok()) << store.status();
  scheduler::SchedulerOptions options;
  options.devices = {"cpu"};
  options.cpu_threads = 1;
  options.planner = planner;
  auto s = scheduler::Scheduler::Start(std::move(*store), options);
  ASSERT_TRUE(s.ok()) << s.status();
  scheduler::Scheduler& scheduler = **s;
  // However the test ends, the held load ends before the scheduler shuts down (it waits for it).
  struct LetGoAtExit {
    FailingPlanner* planner;
    ~LetGoAtExit() { planner->LetGo(); }
  } let_go_at_exit{planner.get()};

  auto failed = scheduler.Submit("", Spec("a"), nullptr);
  ASSERT_TRUE(failed.ok()) << failed.status();
  auto stopped = scheduler.WaitUntilStopped(failed->id(), nullptr);
  ASSERT_EQ(stopped->state(), v1::FAILED) << stopped->DebugString();
  auto held = scheduler.Submit("", Spec("held"), nullptr);
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_TRUE(planner->WaitUntilHolding());

  // Ten days on, a one-day policy selects the failed job; the operator resumes it before the
  // delete, and it waits PENDING for the worker the held job has.
  const RetentionPolicy one_day{0, 1.0};
  const int64_t later_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count() +
                           10 * kDayMs;
  int resumed = 0;
  EXPECT_EQ(PruneHistory(scheduler, one_day, later_ms,
                         [&] {
                           auto job = scheduler.Resume(failed->id());
                           ASSERT_TRUE(job.ok()) << job.status();
                           EXPECT_EQ(job->state(), v1::PENDING);
                           ++resumed;
                         }),
            0);
  EXPECT_EQ(resumed, 1);
  std::optional<v1::Job> kept = scheduler.board().Get(failed->id());
  ASSERT_TRUE(kept.has_value());
  EXPECT_EQ(kept->state(), v1::PENDING);
  EXPECT_EQ(scheduler.Delete(failed->id(), store::DeletePrecondition::kFinished).message(),
            "job " + std::to_string(failed->id()) + " is PENDING, no longer finished; kept");

  // Once both have failed again, the next pass deletes them.
  planner->LetGo();
  for (int64_t id : {held->id(), failed->id()}) {
    auto job = scheduler.WaitUntilStopped(id, nullptr);
    ASSERT_EQ(job->state(), v1::FAILED) << job->DebugString();
  }
  EXPECT_EQ(PruneHistory(scheduler, one_day, later_ms), 2);
  EXPECT_FALSE(scheduler.board().Get(failed->id()).has_value());
  EXPECT_FALSE(scheduler.board().Get(held->id()).has_value());
}

}  // namespace
}  // namespace quantd::api
