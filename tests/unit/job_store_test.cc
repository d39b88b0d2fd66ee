// JobStore and migrations on a real SQLite file: the job model's transitions, idempotent
// submission, task leases (expiry, lost leases, idempotent completion), stage ordering,
// progress, amax merging, and refusal of a database newer than the code.
#include "server/store/job_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "server/store/migrations.h"
#include "server/store/sqlite_db.h"
#include "tests/unit/test_dirs.h"

namespace quantd::store {
namespace {

class JobStoreTest : public testing_util::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    path_ = dir_ + "/state.db";
    auto store = JobStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }
  void TearDown() override {
    store_.reset();
    TempDirTest::TearDown();
  }

  // A job with stages [quantize: 2 tasks, export: 1 task].
  int64_t PlannedJob() {
    auto id = store_->CreateJob("", "{}", 1000);
    EXPECT_TRUE(id.ok());
    std::vector<StagePlan> plan = {
        {"quantize", {{"model-00001.safetensors", "{}", 100}, {"model-00002.safetensors", "{}", 300}}},
        {"export", {{"export", "{}", 0}}},
    };
    EXPECT_TRUE(store_->SetPlan(*id, plan).ok());
    return *id;
  }

  std::string path_;
  std::unique_ptr<JobStore> store_;
};

TEST_F(JobStoreTest, MigrationsSetUserVersionAndStrictTables) {
  auto st = store_->db().Prepare("PRAGMA user_version");
  ASSERT_TRUE(st.ok());
  ASSERT_TRUE(*st->Step());
  EXPECT_EQ(st->ColumnInt(0), static_cast<int64_t>(BuiltinMigrations().size()));
  // STRICT: a text value in an INTEGER column is rejected.
  absl::Status s = store_->db().Exec(
      "INSERT INTO jobs (spec_json, state, created_ms, updated_ms) VALUES ('{}', 'PENDING', "
      "'yesterday', 0)");
  EXPECT_FALSE(s.ok());
  // CHECK: unknown state names are rejected.
  s = store_->db().Exec(
      "INSERT INTO jobs (spec_json, state, created_ms, updated_ms) VALUES ('{}', 'DONE', 0, 0)");
  EXPECT_FALSE(s.ok());
}

TEST_F(JobStoreTest, ReopenKeepsDataAndAppliesNothingTwice) {
  auto id = store_->CreateJob("req-1", "{\"a\":1}", 5);
  ASSERT_TRUE(id.ok());
  store_.reset();
  auto again = JobStore::Open(path_);
  ASSERT_TRUE(again.ok()) << again.status();
  auto job = (*again)->GetJob(*id);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->spec_json, "{\"a\":1}");
  EXPECT_EQ(job->request_id, "req-1");
}

TEST_F(JobStoreTest, RefusesDatabaseNewerThanCode) {
  ASSERT_TRUE(store_->db().Exec("PRAGMA user_version=99").ok());
  store_.reset();
  auto again = JobStore::Open(path_);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("schema version 99"), std::string::npos);
}

TEST_F(JobStoreTest, FailedMigrationAppliesNothing) {
  auto db = SqliteDb::Open(dir_ + "/other.db");
  ASSERT_TRUE(db.ok());
  std::vector<Migration> migrations = {{1, "0001_a.sql", "CREATE TABLE a (x INTEGER) STRICT;"},
                                       {2, "0002_b.sql", "CREATE TABLE b (x BOGUS_TYPE) STRICT;"}};
  auto v = ApplyMigrations(**db, migrations);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("0002_b.sql"), std::string::npos);
  auto st = (*db)->Prepare("SELECT COUNT(*) FROM sqlite_schema WHERE name = 'a'");
  ASSERT_TRUE(st.ok());
  ASSERT_TRUE(*st->Step());
  EXPECT_EQ(st->ColumnInt(0), 0);
  auto ver = (*db)->Prepare("PRAGMA user_version");
  ASSERT_TRUE(*ver->Step());
  EXPECT_EQ(ver->ColumnInt(0), 0);
}

TEST_F(JobStoreTest, NotADatabaseIsAClearError) {
  const std::string bogus = dir_ + "/bogus.db";
  FILE* f = fopen(bogus.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  fputs("this is not a sqlite database, just some text that is long enough..............", f);
  fclose(f);
  auto store = JobStore::Open(bogus);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find(bogus), std::string::npos) << store.status();
}

TEST_F(JobStoreTest, SubmissionIsIdempotentOnRequestId) {
  bool created = false;
  auto a = store_->CreateJob("req-7", "{\"x\":1}", 10, &created);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(created);
  auto b = store_->CreateJob("req-7", "{\"x\":2}", 20, &created);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(created);
  EXPECT_EQ(*a, *b);
  auto c = store_->CreateJob("", "{}", 30, &created);
  auto d = store_->CreateJob("", "{}", 30, &created);
  EXPECT_NE(*c, *d);
  auto job = store_->GetJob(*a);
  EXPECT_EQ(job->spec_json, "{\"x\":1}");
}

TEST_F(JobStoreTest, StateTransitionsFollowTheJobModel) {
  auto id = store_->CreateJob("", "{}", 1);
  ASSERT_TRUE(store_->SetJobState(*id, JobState::kRunning, "", "", 2).ok());
  auto job = store_->GetJob(*id);
  EXPECT_EQ(job->started_ms, 2);
  ASSERT_TRUE(store_->SetJobState(*id, JobState::kPaused, "cancelled", "", 3).ok());
  ASSERT_TRUE(store_->SetJobState(*id, JobState::kRunning, "", "", 4).ok());
  EXPECT_EQ(store_->GetJob(*id)->started_ms, 2);  // first start is kept
  ASSERT_TRUE(store_->SetJobState(*id, JobState::kSucceeded, "", "", 5).ok());
  job = store_->GetJob(*id);
  EXPECT_EQ(job->finished_ms, 5);
  absl::Status s = store_->SetJobState(*id, JobState::kRunning, "", "", 6);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("SUCCEEDED to RUNNING"), std::string::npos);
  EXPECT_EQ(store_->GetJob(999).status().code(), absl::StatusCode::kNotFound);
  auto events = store_->ListEvents(*id, 0);
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 5u);
  EXPECT_EQ((*events)[2].message, "PAUSED (cancelled)");
}

TEST_F(JobStoreTest, DeleteRefusesRunningJob) {
  const int64_t id = PlannedJob();
  ASSERT_TRUE(store_->SetJobState(id, JobState::kRunning, "", "", 2).ok());
  EXPECT_EQ(store_->DeleteJob(id).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store_->SetJobState(id, JobState::kCancelled, "", "", 3).ok());
  ASSERT_TRUE(store_->DeleteJob(id).ok());
  EXPECT_EQ(store_->GetJob(id).status().code(), absl::StatusCode::kNotFound);
  auto tasks = store_->ListTasks(id);
  EXPECT_TRUE(tasks->empty());  // cascaded
}

TEST_F(JobStoreTest, PlanIsSetOnceAndNeedsTasks) {
  const int64_t id = PlannedJob();
  EXPECT_TRUE(store_->HasPlan(id));
  EXPECT_EQ(store_->SetPlan(id, {{"verify", {{"v", "{}", 0}}}}).code(),
            absl::StatusCode::kFailedPrecondition);
  auto other = store_->CreateJob("", "{}", 1);
  EXPECT_EQ(store_->SetPlan(*other, {{"verify", {}}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->SetPlan(*other, {{"bake", {{"x", "{}", 0}}}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(store_->HasPlan(*other));  // the failed plan left nothing behind
}

TEST_F(JobStoreTest, LeasesRunStagesInOrderAndCompleteIdempotently) {
  const int64_t id = PlannedJob();
  TaskLease l1, l2, l3;
  auto t1 = store_->LeaseNextTask(id, "w1", 100, 1000, &l1);
  ASSERT_TRUE(t1.ok() && t1->has_value());
  EXPECT_EQ((*t1)->name, "model-00001.safetensors");
  EXPECT_EQ((*t1)->attempt, 1);
  auto t2 = store_->LeaseNextTask(id, "w2", 100, 1000, &l2);
  ASSERT_TRUE(t2.ok() && t2->has_value());
  EXPECT_EQ((*t2)->name, "model-00002.safetensors");
  // The export stage waits for quantize to finish.
  auto none = store_->LeaseNextTask(id, "w3", 100, 1000, &l3);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());

  ASSERT_TRUE(store_->CompleteTask(l1, "/out/1", 10, "abc", 200).ok());
  ASSERT_TRUE(store_->CompleteTask(l1, "/out/1", 10, "abc", 201).ok());  // repeated: no-op
  auto progress = store_->Progress(id);
  ASSERT_TRUE(progress.ok());
  ASSERT_EQ(progress->size(), 2u);
  EXPECT_EQ((*progress)[0].tasks_done, 1);
  EXPECT_EQ((*progress)[0].tasks_total, 2);
  EXPECT_EQ((*progress)[0].bytes_done, 100);
  EXPECT_EQ((*progress)[0].bytes_total, 400);
  EXPECT_EQ((*progress)[0].state, StageState::kRunning);

  ASSERT_TRUE(store_->CompleteTask(l2, "/out/2", 30, "def", 300).ok());
  progress = store_->Progress(id);
  EXPECT_EQ((*progress)[0].state, StageState::kSucceeded);
  EXPECT_EQ((*progress)[0].finished_ms, 300);
  auto t3 = store_->LeaseNextTask(id, "w3", 400, 1000, &l3);
  ASSERT_TRUE(t3->has_value());
  EXPECT_EQ((*t3)->stage_kind, "export");
  ASSERT_TRUE(store_->CompleteTask(l3, "", 0, "", 500).ok());
  auto after = store_->LeaseNextTask(id, "w3", 600, 1000, &l3);
  EXPECT_FALSE(after->has_value());
  auto tasks = store_->ListTasks(id);
  EXPECT_EQ((*tasks)[1].output_sha256, "def");
  EXPECT_EQ((*tasks)[1].output_bytes, 30);
}

TEST_F(JobStoreTest, ExpiredLeaseIsRequeuedAndTheOldHolderLosesIt) {
  const int64_t id = PlannedJob();
  TaskLease old_lease, new_lease;
  ASSERT_TRUE(store_->LeaseNextTask(id, "w1", 100, 50, &old_lease)->has_value());
  EXPECT_EQ(*store_->RequeueExpiredLeases(140), 0);  // not yet expired
  EXPECT_EQ(*store_->RequeueExpiredLeases(151), 1);
  auto again = store_->LeaseNextTask(id, "w2", 160, 1000, &new_lease);
  ASSERT_TRUE(again->has_value());
  EXPECT_EQ((*again)->id, old_lease.task_id);
  EXPECT_EQ((*again)->attempt, 2);
  absl::Status s = store_->CompleteTask(old_lease, "/x", 1, "x", 170);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->RenewLease(old_lease, 170, 100).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store_->RenewLease(new_lease, 170, 100).ok());
  EXPECT_EQ(new_lease.expires_ms, 270);
  EXPECT_TRUE(store_->CompleteTask(new_lease, "/x", 1, "x", 180).ok());
}

TEST_F(JobStoreTest, RestartRequeuesTheJobsLeases) {
  const int64_t id = PlannedJob();
  TaskLease a, b;
  ASSERT_TRUE(store_->LeaseNextTask(id, "run", 100, 1 << 30, &a)->has_value());
  ASSERT_TRUE(store_->LeaseNextTask(id, "run", 100, 1 << 30, &b)->has_value());
  EXPECT_EQ(*store_->RequeueJobLeases(id, 200), 2);
  auto tasks = store_->ListTasks(id);
  EXPECT_EQ((*tasks)[0].state, TaskState::kPending);
  EXPECT_EQ((*tasks)[0].error, "interrupted");
  EXPECT_EQ((*tasks)[0].attempt, 1);
}

TEST_F(JobStoreTest, TransientFailureRetriesAfterBackoffPermanentFailsTheStage) {
  const int64_t id = PlannedJob();
  TaskLease l;
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 100, 1000, &l)->has_value());
  ASSERT_TRUE(store_->FailTask(l, "EAGAIN", /*permanent=*/false, 500, 110).ok());
  TaskLease l2;
  auto next = store_->LeaseNextTask(id, "w", 120, 1000, &l2);
  ASSERT_TRUE(next->has_value());
  EXPECT_EQ((*next)->ordinal, 1);  // the failed one waits for its back-off
  auto retried = store_->LeaseNextTask(id, "w", 500, 1000, &l);
  ASSERT_TRUE(retried->has_value());
  EXPECT_EQ((*retried)->ordinal, 0);
  EXPECT_EQ((*retried)->attempt, 2);
  ASSERT_TRUE(store_->FailTask(l, "corrupt shard x.safetensors", /*permanent=*/true, 0, 510).ok());
  auto progress = store_->Progress(id);
  EXPECT_EQ((*progress)[0].state, StageState::kFailed);
  auto tasks = store_->ListTasks(id);
  EXPECT_EQ((*tasks)[0].state, TaskState::kFailed);
  EXPECT_EQ((*tasks)[0].error, "corrupt shard x.safetensors");
  EXPECT_EQ(*store_->ResetFailedTasks(id, 600), 1);
  auto again = store_->LeaseNextTask(id, "w", 600, 1000, &l);
  ASSERT_TRUE(again->has_value());
  EXPECT_EQ((*again)->attempt, 3);
}

TEST_F(JobStoreTest, ListJobsPagesAndFilters) {
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(store_->CreateJob("", "{}", i).ok());
  ASSERT_TRUE(store_->SetJobState(2, JobState::kRunning, "", "", 9).ok());
  auto page1 = store_->ListJobs(std::nullopt, 0, 2);
  ASSERT_EQ(page1->size(), 2u);
  auto page2 = store_->ListJobs(std::nullopt, page1->back().id, 10);
  ASSERT_EQ(page2->size(), 3u);
  EXPECT_EQ(page2->front().id, 3);
  auto running = store_->ListJobs(JobState::kRunning, 0, 10);
  ASSERT_EQ(running->size(), 1u);
  EXPECT_EQ(running->front().id, 2);
}

TEST_F(JobStoreTest, AmaxMergesByMaxAndSumsSamples) {
  auto id = store_->CreateJob("", "{}", 1);
  ASSERT_TRUE(store_->MergeAmax(*id, {{"layers.0.attn.wq_a", "input", 2.5, 10}}).ok());
  ASSERT_TRUE(store_->MergeAmax(*id, {{"layers.0.attn.wq_a", "input", 1.5, 6},
                                      {"layers.0.attn.wq_a", "kv", 0.25, 6}}).ok());
  auto rows = store_->ListAmax(*id);
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_EQ((*rows)[0].kind, "input");
  EXPECT_EQ((*rows)[0].value, 2.5);
  EXPECT_EQ((*rows)[0].samples, 16);
  EXPECT_FALSE(store_->MergeAmax(*id, {{"m", "input", -1.0, 1}}).ok());  // CHECK value >= 0
  ASSERT_TRUE(store_->PutTensorStats(*id, {{"w", 0.1, 20.0, 0.5}}).ok());
  auto stats = store_->ListTensorStats(*id);
  ASSERT_EQ(stats->size(), 1u);
  EXPECT_EQ((*stats)[0].sqnr_db, 20.0);
}

}  // namespace
}  // namespace quantd::store
