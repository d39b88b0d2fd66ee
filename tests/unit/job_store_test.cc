// JobStore and migrations on a real SQLite file: the job model's transitions, idempotent
// submission, task leases (expiry, lost leases, idempotent completion), dependency order, device
// requirements, records in the completion's transaction, requeue of done tasks, progress, amax
// merging, evaluation figures, who ran each task, refusal of a database newer than the code, and
// the upgrade of a version 1 and a version 3 database.
#include "server/store/job_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "server/base/status_macros.h"
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

  // A job with stages [quantize: 2 tasks, export: 1 task after both].
  int64_t PlannedJob() {
    auto id = store_->CreateJob("", "{}", 1000);
    EXPECT_TRUE(id.ok());
    TaskPlan exported{"export", "{}", 0};
    exported.depends_on = {{"quantize", "model-00001.safetensors"},
                           {"quantize", "model-00002.safetensors"}};
    std::vector<StagePlan> plan = {
        {"quantize", {{"model-00001.safetensors", "{}", 100}, {"model-00002.safetensors", "{}", 300}}},
        {"export", {exported}},
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

TEST_F(JobStoreTest, RetentionDeletesOnlyAJobThatIsStillFinished) {
  const int64_t id = PlannedJob();
  ASSERT_TRUE(store_->SetJobState(id, JobState::kFailed, "x", "", 2).ok());
  ASSERT_TRUE(store_->SetJobState(id, JobState::kPending, "resumed", "", 3).ok());
  const absl::Status kept = store_->DeleteJob(id, DeletePrecondition::kFinished);
  EXPECT_EQ(kept.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kept.message(), "job 1 is PENDING, no longer finished; kept");
  ASSERT_TRUE(store_->SetJobState(id, JobState::kCancelled, "", "", 4).ok());
  ASSERT_TRUE(store_->DeleteJob(id, DeletePrecondition::kFinished).ok());
  EXPECT_EQ(store_->GetJob(id).status().code(), absl::StatusCode::kNotFound);
  // DeleteJob's own rule takes a PENDING job.
  const int64_t pending = *store_->CreateJob("", "{}", 5);
  EXPECT_TRUE(store_->DeleteJob(pending).ok());
}

TEST_F(JobStoreTest, StoredMessagesAreCapped) {
  EXPECT_EQ(CapStoredMessage("short"), "short");
  const std::string exact(kMaxStoredMessageBytes, 'e');
  EXPECT_EQ(CapStoredMessage(exact), exact);
  const std::string big(5'000'000, 'x');
  const std::string note = "... (5000000 bytes in all)";
  EXPECT_EQ(CapStoredMessage(big), std::string(kMaxStoredMessageBytes - note.size(), 'x') + note);
  // Two-byte characters: the cut falls between two of them, never inside one.
  std::string wide;
  while (wide.size() < 5000) wide += "\xc3\xa9";  // é
  const std::string capped = CapStoredMessage(wide);
  const std::string wide_note = "... (5000 bytes in all)";
  ASSERT_LE(capped.size(), kMaxStoredMessageBytes);
  const std::string kept = capped.substr(0, capped.size() - wide_note.size());
  EXPECT_EQ(kept.size() % 2, 0u);
  EXPECT_EQ(kept, wide.substr(0, kept.size()));
  EXPECT_EQ(kMaxStoredMessageBytes - capped.size(), 1u);  // the half character left out

  // Written capped: the job's error, its state event, a task's error, an event.
  const int64_t id = PlannedJob();
  ASSERT_TRUE(store_->SetJobState(id, JobState::kRunning, "", "", 2).ok());
  TaskLease lease;
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 3, 1000, &lease)->has_value());
  ASSERT_TRUE(store_->FailTask(lease, big, /*permanent=*/true, 0, 4).ok());
  ASSERT_TRUE(store_->SetJobState(id, JobState::kFailed, "x", big, 5).ok());
  ASSERT_TRUE(store_->AddEvent(id, "note", big, 6).ok());
  auto longest = store_->db().Prepare(
      "SELECT MAX(LENGTH(CAST(error AS BLOB))) FROM jobs UNION ALL "
      "SELECT MAX(LENGTH(CAST(error AS BLOB))) FROM tasks UNION ALL "
      "SELECT MAX(LENGTH(CAST(message AS BLOB))) FROM events");
  ASSERT_TRUE(longest.ok()) << longest.status();
  for (int table = 0; table < 3; ++table) {
    ASSERT_TRUE(*longest->Step());
    EXPECT_EQ(longest->ColumnInt(0), static_cast<int64_t>(kMaxStoredMessageBytes)) << table;
  }
  EXPECT_EQ(store_->GetJob(id)->error, CapStoredMessage(big));

  // Rows an older release wrote uncapped are cut when read.
  ASSERT_TRUE(store_->db()
                  .Exec("UPDATE jobs SET error = replace(hex(zeroblob(2500000)), '0', 'x'); "
                        "UPDATE tasks SET error = replace(hex(zeroblob(2500000)), '0', 'x'); "
                        "UPDATE events SET message = replace(hex(zeroblob(2500000)), '0', 'x')")
                  .ok());
  EXPECT_EQ(store_->GetJob(id)->error, CapStoredMessage(big));
  EXPECT_EQ(store_->ListJobs(std::nullopt, 0, 10)->front().error, CapStoredMessage(big));
  const absl::StatusOr<std::vector<TaskRow>> tasks = store_->ListTasks(id);
  for (const TaskRow& t : *tasks) EXPECT_EQ(t.error, CapStoredMessage(big));
  const absl::StatusOr<std::vector<EventRow>> events = store_->ListEvents(id, 0);
  for (const EventRow& e : *events) EXPECT_EQ(e.message, CapStoredMessage(big));
}

TEST_F(JobStoreTest, PlanIsSetOnceAndNeedsTasks) {
  const int64_t id = PlannedJob();
  EXPECT_TRUE(store_->HasPlan(id));
  EXPECT_EQ(store_->SetPlan(id, {{"verify", {{"v", "{}", 0}}}}).code(),
            absl::StatusCode::kFailedPrecondition);
  auto other = store_->CreateJob("", "{}", 1);
  EXPECT_EQ(store_->SetPlan(*other, {{"verify", {}}}).code(), absl::StatusCode::kInvalidArgument);
  // A dependency must name a task planned before it: no later stage, no unknown task, no cycle.
  TaskPlan early{"x", "{}", 0};
  early.depends_on = {{"later", "y"}};
  EXPECT_EQ(store_->SetPlan(*other, {{"first", {early}}, {"later", {{"y", "{}", 0}}}}).code(),
            absl::StatusCode::kInvalidArgument);
  TaskPlan self{"x", "{}", 0};
  self.depends_on = {{"only", "x"}};
  EXPECT_EQ(store_->SetPlan(*other, {{"only", {self}}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->SetPlan(*other, {{"a", {{"x", "{}", 0}, {"x", "{}", 0}}}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->SetPlan(*other, {{"a", {{"x", "{}", 0}}}, {"a", {{"y", "{}", 0}}}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(store_->HasPlan(*other));  // the failed plans left nothing behind
  // Stage kinds are the registry's business: the store takes any name.
  EXPECT_TRUE(store_->SetPlan(*other, {{"bake", {{"x", "{}", 0}}}}).ok());
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
  // The export task waits for both quantize tasks.
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
}

}  // namespace
// A chain and a fan-in: layer 1 -> layer 2 (same stage), and each check after its own layer only.
TEST_F(JobStoreTest, DependenciesDecideWhatIsLeasedNotStageOrder) {
  auto id = store_->CreateJob("", "{}", 1);
  TaskPlan l1{"layer1", "{}", 10, "layer 1 of 2"};
  TaskPlan l2{"layer2", "{}", 10, "layer 2 of 2"};
  l2.depends_on = {{"forward", "layer1"}};
  TaskPlan c1{"layer1", "{}", 5};
  c1.depends_on = {{"forward", "layer1"}};
  TaskPlan c2{"layer2", "{}", 5};
  c2.depends_on = {{"forward", "layer2"}};
  ASSERT_TRUE(store_->SetPlan(*id, {{"forward", {l1, l2}}, {"check", {c1, c2}}}).ok());

  TaskLease a, b, none;
  auto first = store_->LeaseNextTask(*id, "w", 100, 1000, &a);
  ASSERT_TRUE(first.ok() && first->has_value());
  EXPECT_EQ((*first)->name, "layer1");
  EXPECT_EQ((*first)->label, "layer 1 of 2");
  // layer2 and both checks wait for layer1.
  EXPECT_FALSE(store_->LeaseNextTask(*id, "w", 100, 1000, &none)->has_value());
  ASSERT_TRUE(store_->CompleteTask(a, "", 0, "", 110).ok());
  auto second = store_->LeaseNextTask(*id, "w", 120, 1000, &a);
  ASSERT_TRUE(second->has_value());
  EXPECT_EQ((*second)->stage_kind, "forward");
  EXPECT_EQ((*second)->name, "layer2");
  // The check of layer 1 runs while layer 2 is still running.
  auto check = store_->LeaseNextTask(*id, "w", 120, 1000, &b);
  ASSERT_TRUE(check->has_value());
  EXPECT_EQ((*check)->stage_kind, "check");
  EXPECT_EQ((*check)->name, "layer1");
  EXPECT_FALSE(store_->LeaseNextTask(*id, "w", 120, 1000, &none)->has_value());
  auto progress = store_->Progress(*id);
  EXPECT_EQ((*progress)[0].state, StageState::kRunning);
  EXPECT_EQ((*progress)[1].state, StageState::kRunning);

  auto tasks = store_->ListTasks(*id);
  auto edges = store_->ListDependencies(*id);
  ASSERT_TRUE(edges.ok());
  const std::vector<std::pair<int64_t, int64_t>> want = {
      {(*tasks)[1].id, (*tasks)[0].id}, {(*tasks)[2].id, (*tasks)[0].id},
      {(*tasks)[3].id, (*tasks)[1].id}};
  EXPECT_EQ(*edges, want);
}

TEST_F(JobStoreTest, LeaseTakesOnlyTasksTheDeviceFits) {
  auto id = store_->CreateJob("", "{}", 1);
  TaskPlan gpu{"gpu", "{}", 0};
  gpu.requirement = {true, 1000};
  TaskPlan big{"big", "{}", 0};
  big.requirement = {false, 5000};
  TaskPlan any{"any", "{}", 0};
  ASSERT_TRUE(store_->SetPlan(*id, {{"s", {gpu, big, any}}}).ok());
  TaskLease l;
  // A CPU with 4000 bytes free: neither the GPU task nor the 5000-byte one.
  auto cpu_task = store_->LeaseNextTask(*id, "w", 1, 1000, &l, {false, 4000});
  ASSERT_TRUE(cpu_task->has_value());
  EXPECT_EQ((*cpu_task)->name, "any");
  EXPECT_FALSE(store_->LeaseNextTask(*id, "w", 1, 1000, &l, {false, 4999})->has_value());
  auto cpu_big = store_->LeaseNextTask(*id, "w", 1, 1000, &l, {false, 5000});
  ASSERT_TRUE(cpu_big->has_value());
  EXPECT_EQ((*cpu_big)->name, "big");
  EXPECT_EQ((*cpu_big)->requirement, (compute::DeviceRequirement{false, 5000}));
  EXPECT_FALSE(store_->LeaseNextTask(*id, "w", 1, 1000, &l, {true, 999})->has_value());
  auto on_gpu = store_->LeaseNextTask(*id, "w", 1, 1000, &l, {true, 1000});
  ASSERT_TRUE(on_gpu->has_value());
  EXPECT_EQ((*on_gpu)->name, "gpu");
  EXPECT_TRUE((*on_gpu)->requirement.gpu);
}

TEST_F(JobStoreTest, RecordCommitsWithTheCompletionOrNotAtAll) {
  const int64_t id = PlannedJob();
  TaskLease l;
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 100, 1000, &l)->has_value());
  const TensorStatsRow row{"m.weight", 0.1, 20.0, 0.5};
  // A failing record leaves the task LEASED and writes nothing.
  absl::Status s = store_->CompleteTask(l, "/o", 1, "s", 110, [&](TaskRecord& txn) {
    EXPECT_EQ(txn.job_id(), id);
    EXPECT_EQ(txn.task_id(), l.task_id);
    EXPECT_TRUE(txn.PutTensorStats({row}).ok());
    return absl::DataLossError("disk gone");
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ((*store_->ListTasks(id))[0].state, TaskState::kLeased);
  EXPECT_TRUE(store_->ListTensorStats(id)->empty());
  int records = 0;
  const auto record = [&](TaskRecord& txn) {
    ++records;
    return txn.PutTensorStats({row});
  };
  ASSERT_TRUE(store_->CompleteTask(l, "/o", 1, "s", 120, record).ok());
  EXPECT_EQ((*store_->ListTasks(id))[0].state, TaskState::kDone);
  EXPECT_EQ(*store_->ListTensorStats(id), std::vector<TensorStatsRow>{row});
  // The same completion again (a duplicate delivery) does not record again.
  ASSERT_TRUE(store_->CompleteTask(l, "/o", 1, "s", 130, record).ok());
  EXPECT_EQ(records, 1);
}

TEST_F(JobStoreTest, TaskAmaxIsReplacedWhenTheTaskRunsAgain) {
  const int64_t id = PlannedJob();
  ASSERT_TRUE(store_->MergeAmax(id, {{"m", "input", 1.0, 0}}).ok());  // from an amax file
  TaskLease l;
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 100, 1000, &l)->has_value());
  const auto contribute = [](TaskRecord& txn) {
    return txn.PutTaskAmax({{"m", "input", 3.0, 7}, {"n", "kv", 0.5, 7}});
  };
  ASSERT_TRUE(store_->CompleteTask(l, "/o", 1, "s", 110, contribute).ok());
  // Its output vanished: the task runs again and contributes the same rows again.
  ASSERT_EQ(*store_->RequeueDoneTasks(id, {l.task_id}, "gone", 120), 1);
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 130, 1000, &l)->has_value());
  EXPECT_EQ(l.attempt, 2);
  ASSERT_TRUE(store_->CompleteTask(l, "/o", 1, "s", 140, contribute).ok());
  auto rows = store_->ListAmax(id);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_EQ((*rows)[0].module, "m");
  EXPECT_EQ((*rows)[0].value, 3.0);
  EXPECT_EQ((*rows)[0].samples, 7);  // counted once, not 14
  EXPECT_EQ((*rows)[1].module, "n");
  EXPECT_EQ((*rows)[1].samples, 7);
  // The task's own contribution, without the job-level row of the amax file.
  auto task_rows = store_->ListTaskAmax(id);
  ASSERT_TRUE(task_rows.ok());
  ASSERT_EQ(task_rows->size(), 2u);
  EXPECT_EQ((*task_rows)[0].task_id, l.task_id);
  EXPECT_EQ((*task_rows)[0].amax.module, "m");
  EXPECT_EQ((*task_rows)[0].amax.value, 3.0);
  EXPECT_EQ((*task_rows)[0].amax.samples, 7);
  EXPECT_EQ((*task_rows)[1].task_id, l.task_id);
  EXPECT_EQ((*task_rows)[1].amax.module, "n");
  EXPECT_EQ((*task_rows)[1].amax.kind, "kv");
}

TEST_F(JobStoreTest, EvaluationFiguresRoundTripAndARerunReplacesThem) {
  const int64_t id = PlannedJob();
  EXPECT_FALSE(store_->GetEvaluation(id)->has_value());
  EXPECT_TRUE(store_->ListEvaluationLayers(id)->empty());
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Layer 1 identical in both models (noise 0: +inf dB), layer 0 not; a NaN figure reads as NaN.
  const EvaluationLayerRow layer1{1, 25.0, 0.0, 25.0, 0.0, 0.5};
  EvaluationLayerRow layer0{0, 100.0, 1.0, 100.0, 0.25, 0.75};
  EvaluationRow figures;
  figures.samples = 4;
  figures.tokens = 192;
  figures.numerics = "official";
  figures.positions = 192;
  figures.predicted = 188;
  figures.mean_kl = 0.125;
  figures.p99_kl = 0.5;
  figures.max_kl = inf;
  figures.top1_agreement = 0.75;
  figures.source_ppl = 3.5;
  figures.quantized_ppl = nan;
  figures.ppl_ratio = nan;
  figures.gate_passed = false;
  figures.gate_message = "quality gate: mean_kl 0.125 > max_mean_kl 0.1";
  figures.seconds = 2.5;
  TaskLease a, b;
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 1, 1000, &a)->has_value());
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 1, 1000, &b)->has_value());
  ASSERT_TRUE(store_->CompleteTask(a, "", 0, "", 2, [&](TaskRecord& txn) {
    return txn.PutEvaluationLayer(layer1);
  }).ok());
  ASSERT_TRUE(store_->CompleteTask(b, "", 0, "", 2, [&](TaskRecord& txn) {
    RETURN_IF_ERROR(txn.PutEvaluationLayer(layer0));
    return txn.PutEvaluation(figures);
  }).ok());
  auto layers = store_->ListEvaluationLayers(id);
  ASSERT_TRUE(layers.ok()) << layers.status();
  ASSERT_EQ(layers->size(), 2u);
  EXPECT_EQ((*layers)[0].layer, 0);  // by layer
  EXPECT_EQ((*layers)[0].teacher_forced_noise, 0.25);
  EXPECT_EQ((*layers)[1].layer, 1);
  EXPECT_EQ((*layers)[1].free_running_signal, 25.0);
  EXPECT_EQ((*layers)[1].free_running_noise, 0.0);  // +inf dB stays exact
  auto got = store_->GetEvaluation(id);
  ASSERT_TRUE(got.ok() && got->has_value()) << got.status();
  const EvaluationRow& r = **got;
  EXPECT_EQ(r.samples, 4);
  EXPECT_EQ(r.tokens, 192);
  EXPECT_EQ(r.numerics, "official");
  EXPECT_EQ(r.positions, 192);
  EXPECT_EQ(r.predicted, 188);
  EXPECT_EQ(r.mean_kl, 0.125);
  EXPECT_EQ(r.p99_kl, 0.5);
  EXPECT_EQ(r.max_kl, inf);
  EXPECT_EQ(r.top1_agreement, 0.75);
  EXPECT_EQ(r.source_ppl, 3.5);
  EXPECT_TRUE(std::isnan(r.quantized_ppl));
  EXPECT_TRUE(std::isnan(r.ppl_ratio));
  EXPECT_FALSE(r.gate_passed);
  EXPECT_EQ(r.gate_message, figures.gate_message);
  EXPECT_EQ(r.seconds, 2.5);

  // The task runs again (its output changed): its rows are replaced, never added.
  ASSERT_EQ(*store_->RequeueDoneTasks(id, {b.task_id}, "gone", 3), 1);
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 4, 1000, &b)->has_value());
  layer0.teacher_forced_noise = 0.5;
  figures.gate_passed = true;
  figures.gate_message = "";
  ASSERT_TRUE(store_->CompleteTask(b, "", 0, "", 5, [&](TaskRecord& txn) {
    RETURN_IF_ERROR(txn.PutEvaluationLayer(layer0));
    return txn.PutEvaluation(figures);
  }).ok());
  layers = store_->ListEvaluationLayers(id);
  ASSERT_EQ(layers->size(), 2u);
  EXPECT_EQ((*layers)[0].teacher_forced_noise, 0.5);
  EXPECT_TRUE((*store_->GetEvaluation(id))->gate_passed);
  // Deleting the job deletes its figures.
  ASSERT_TRUE(store_->DeleteJob(id).ok());
  EXPECT_TRUE(store_->ListEvaluationLayers(id)->empty());
  EXPECT_FALSE(store_->GetEvaluation(id)->has_value());
}

TEST_F(JobStoreTest, RequeueDoneTasksTakesTheirDependentsAlong) {
  const int64_t id = PlannedJob();
  TaskLease a, b, e;
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 1, 1000, &a)->has_value());
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 1, 1000, &b)->has_value());
  ASSERT_TRUE(store_->CompleteTask(a, "/o/1", 1, "s1", 2).ok());
  ASSERT_TRUE(store_->CompleteTask(b, "/o/2", 1, "s2", 2).ok());
  ASSERT_TRUE(store_->LeaseNextTask(id, "w", 3, 1000, &e)->has_value());
  ASSERT_TRUE(store_->CompleteTask(e, "/o", 2, "m", 4).ok());
  // Shard 2's output is gone: it and export (which indexed it) are redone, shard 1 is not.
  EXPECT_EQ(*store_->RequeueDoneTasks(id, {b.task_id}, "output /o/2 is gone", 5), 2);
  auto tasks = store_->ListTasks(id);
  EXPECT_EQ((*tasks)[0].state, TaskState::kDone);
  EXPECT_EQ((*tasks)[1].state, TaskState::kPending);
  EXPECT_EQ((*tasks)[1].error, "output /o/2 is gone");
  EXPECT_EQ((*tasks)[1].output_path, "");
  EXPECT_EQ((*tasks)[2].state, TaskState::kPending);
  auto progress = store_->Progress(id);
  EXPECT_EQ((*progress)[0].state, StageState::kRunning);
  EXPECT_EQ((*progress)[1].state, StageState::kRunning);
  EXPECT_EQ(*store_->CountEvents(id, "requeue"), 1);
  TaskLease again;
  auto next = store_->LeaseNextTask(id, "w", 6, 1000, &again);
  ASSERT_TRUE(next->has_value());
  EXPECT_EQ((*next)->id, b.task_id);
  EXPECT_FALSE(store_->LeaseNextTask(id, "w", 6, 1000, &e)->has_value());  // export waits
  EXPECT_EQ(*store_->RequeueDoneTasks(id, {}, "nothing", 7), 0);
}

// ran_by: the owner of the attempt that completed a task, or failed it for good; a retry leaves
// it, a requeue keeps it until the task ends again.
TEST_F(JobStoreTest, RanByRecordsWhoEndedTheTaskAndSurvivesARequeue) {
  const int64_t id = PlannedJob();
  TaskLease a, b, e;
  ASSERT_TRUE(store_->LeaseNextTask(id, "worker:a", 1, 1000, &a)->has_value());
  ASSERT_TRUE(store_->LeaseNextTask(id, "quantd:42", 1, 1000, &b)->has_value());
  EXPECT_EQ((*store_->ListTasks(id))[0].ran_by, "");  // leased, not run yet
  ASSERT_TRUE(store_->CompleteTask(a, "/o/1", 1, "s1", 2).ok());
  ASSERT_TRUE(store_->CompleteTask(a, "/o/1", 1, "s1", 2).ok());  // repeated: no change
  ASSERT_TRUE(store_->FailTask(b, "EAGAIN", /*permanent=*/false, 0, 2).ok());
  auto tasks = store_->ListTasks(id);
  EXPECT_EQ((*tasks)[0].ran_by, "worker:a");
  EXPECT_EQ((*tasks)[0].lease_owner, "");
  EXPECT_EQ((*tasks)[1].ran_by, "");  // a transient failure records nobody
  ASSERT_TRUE(store_->LeaseNextTask(id, "worker:b", 3, 1000, &b)->has_value());
  ASSERT_TRUE(store_->CompleteTask(b, "/o/2", 1, "s2", 4).ok());
  ASSERT_TRUE(store_->LeaseNextTask(id, "worker:b", 5, 1000, &e)->has_value());
  ASSERT_TRUE(store_->CompleteTask(e, "/o", 2, "m", 6).ok());
  EXPECT_EQ(*store_->ListStageRunners(id),
            (std::vector<StageRunner>{{(*tasks)[0].stage_id, "worker:a", 1},
                                      {(*tasks)[0].stage_id, "worker:b", 1},
                                      {(*tasks)[2].stage_id, "worker:b", 1}}));

  // Requeued, shard 2 and export keep who ran them while PENDING, and are not counted as done.
  ASSERT_EQ(*store_->RequeueDoneTasks(id, {b.task_id}, "gone", 7), 2);
  tasks = store_->ListTasks(id);
  EXPECT_EQ((*tasks)[1].state, TaskState::kPending);
  EXPECT_EQ((*tasks)[1].ran_by, "worker:b");
  EXPECT_EQ((*tasks)[2].ran_by, "worker:b");
  EXPECT_EQ(*store_->ListStageRunners(id),
            (std::vector<StageRunner>{{(*tasks)[0].stage_id, "worker:a", 1}}));
  // Its next run replaces it, a permanent failure included.
  ASSERT_TRUE(store_->LeaseNextTask(id, "quantd:42", 8, 1000, &b)->has_value());
  ASSERT_TRUE(store_->FailTask(b, "corrupt", /*permanent=*/true, 0, 9).ok());
  tasks = store_->ListTasks(id);
  EXPECT_EQ((*tasks)[1].state, TaskState::kFailed);
  EXPECT_EQ((*tasks)[1].ran_by, "quantd:42");
  ASSERT_EQ(*store_->ResetFailedTasks(id, 10), 1);
  ASSERT_TRUE(store_->LeaseNextTask(id, "worker:c", 11, 1000, &b)->has_value());
  ASSERT_TRUE(store_->CompleteTask(b, "/o/2", 1, "s2", 12).ok());
  EXPECT_EQ((*store_->ListTasks(id))[1].ran_by, "worker:c");
}

// A version 3 database (the migrations before 0004 applied, a task done): it gains ran_by, NULL
// for the task done before, and records it from then on.
TEST_F(JobStoreTest, UpgradesAVersion3DatabaseWithoutARunnerForOldTasks) {
  store_.reset();
  const std::string path = dir_ + "/v3.db";
  {
    auto db = SqliteDb::Open(path);
    ASSERT_TRUE(db.ok()) << db.status();
    const std::vector<Migration> v3(BuiltinMigrations().begin(), BuiltinMigrations().begin() + 3);
    ASSERT_EQ(v3.back().name, "0003_evaluation.sql");
    ASSERT_EQ(*ApplyMigrations(**db, v3), 3);
    ASSERT_TRUE((*db)->Exec(
        "INSERT INTO jobs (id, spec_json, state, created_ms, updated_ms) "
        "VALUES (1, '{}', 'RUNNING', 0, 0);"
        "INSERT INTO stages (id, job_id, ordinal, kind, state) VALUES (1, 1, 0, 'quantize', "
        "'RUNNING');"
        "INSERT INTO tasks (id, job_id, stage_id, ordinal, name, payload_json, bytes_total, "
        "state, attempt) VALUES (1, 1, 1, 0, 'a', '{}', 1, 'DONE', 1), "
        "(2, 1, 1, 1, 'b', '{}', 1, 'PENDING', 0);").ok());
  }
  auto opened = JobStore::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  store_ = std::move(*opened);
  auto version = store_->db().Prepare("PRAGMA user_version");
  ASSERT_TRUE(*version->Step());
  EXPECT_EQ(version->ColumnInt(0), 4);
  EXPECT_EQ((*store_->ListTasks(1))[0].ran_by, "");
  EXPECT_TRUE(store_->ListStageRunners(1)->empty());
  TaskLease l;
  ASSERT_TRUE(store_->LeaseNextTask(1, "worker:a", 1, 1000, &l)->has_value());
  ASSERT_TRUE(store_->CompleteTask(l, "/o/b", 1, "s", 2).ok());
  EXPECT_EQ(*store_->ListStageRunners(1), (std::vector<StageRunner>{{1, "worker:a", 1}}));
}

// tests/data/upgrade_v1: a PAUSED job of the version-1 schema, quantize 2 of 4 done.
TEST_F(JobStoreTest, UpgradesAVersion1DatabaseKeepingStageOrder) {
  store_.reset();
  const std::string path = dir_ + "/v1.db";
  std::filesystem::copy_file(
      std::string(QUANTD_SOURCE_DIR) + "/tests/data/upgrade_v1/v1_paused_mid_quantize.db", path);
  auto opened = JobStore::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  store_ = std::move(*opened);
  auto version = store_->db().Prepare("PRAGMA user_version");
  ASSERT_TRUE(*version->Step());
  EXPECT_EQ(version->ColumnInt(0), static_cast<int64_t>(BuiltinMigrations().size()));

  auto job = store_->GetJob(1);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state, JobState::kPaused);
  auto tasks = store_->ListTasks(1);
  ASSERT_EQ(tasks->size(), 14u);  // inspect, 4 dequant, 4 quantize, export, 4 verify
  std::map<int64_t, const TaskRow*> by_id;
  for (const TaskRow& t : *tasks) by_id[t.id] = &t;
  EXPECT_EQ((*tasks)[5].stage_kind, "quantize");
  EXPECT_EQ((*tasks)[5].label, "shard 1 of 4");
  EXPECT_EQ((*tasks)[0].label, "");
  EXPECT_EQ((*tasks)[9].label, "");  // export
  // Every task depends on exactly the tasks of the stage before it, as version 1 ran them.
  std::map<int64_t, std::set<std::string>> deps;
  auto edges = store_->ListDependencies(1);
  ASSERT_TRUE(edges.ok());
  for (const auto& [task, on] : *edges) deps[task].insert(by_id.at(on)->stage_kind);
  EXPECT_EQ(edges->size(), 4u + 4 * 4 + 4 + 4);
  EXPECT_EQ(deps[(*tasks)[1].id], std::set<std::string>{"inspect"});
  EXPECT_EQ(deps[(*tasks)[5].id], std::set<std::string>{"dequant"});
  EXPECT_EQ(deps[(*tasks)[9].id], std::set<std::string>{"quantize"});
  EXPECT_EQ(deps[(*tasks)[10].id], std::set<std::string>{"export"});
  // Resuming leases quantize 3 and 4, and nothing after them until they are done.
  ASSERT_TRUE(store_->SetJobState(1, JobState::kRunning, "resumed", "", 1).ok());
  TaskLease l3, l4, none;
  auto t3 = store_->LeaseNextTask(1, "w", 2, 1000, &l3);
  ASSERT_TRUE(t3.ok() && t3->has_value());
  EXPECT_EQ((*t3)->stage_kind, "quantize");
  EXPECT_EQ((*t3)->ordinal, 2);
  auto t4 = store_->LeaseNextTask(1, "w", 2, 1000, &l4);
  EXPECT_EQ((*t4)->ordinal, 3);
  EXPECT_FALSE(store_->LeaseNextTask(1, "w", 2, 1000, &none)->has_value());
  // The stage CHECK of version 1 is gone; the tables' references survived the rebuild.
  EXPECT_TRUE(store_->db().Exec("UPDATE stages SET kind = 'calibrate-v2' WHERE id = 1").ok());
  auto fk = store_->db().Prepare("PRAGMA foreign_key_check");
  EXPECT_FALSE(*fk->Step());
}

}  // namespace quantd::store
