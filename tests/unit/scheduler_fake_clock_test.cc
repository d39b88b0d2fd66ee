// The scheduler with fake stages, fake devices and a fake clock (no sleeps but where a planning
// runs into its real-time deadline): placement by device
// memory, retries and back-off, lease expiry at run time with the late result ignored (and a task
// reporting progress keeping its lease), pause/resume and cancel mid-job, shutdown and restart
// mid-job, and a store that refuses writes (a completion is retried, not lost; a store that stays
// unusable stops the scheduler), and planning that cannot take the scheduler down (an exception
// fails the job naming its input; memory, deadline and cancel stop it; two jobs plan at once;
// shutdown abandons a wedged one after its grace; a job whose planning crashed twice fails).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backends.h"
#include "server/base/status_macros.h"
#include "server/base/thread_budget.h"
#include "server/scheduler/job_proto.h"
#include "server/scheduler/scheduler.h"
#include "server/store/job_store.h"
#include "server/store/sqlite_db.h"
#include "tests/unit/fake_clock.h"
#include "tests/unit/test_dirs.h"

namespace quantd::scheduler {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kLeaseMs = 3000;
constexpr auto kPatience = std::chrono::seconds(60);  // a safety net, never reached when passing

// One task attempt as a fake stage saw it.
struct Attempt {
  std::string task;
  int attempt;
  std::string device;
};

// What every fake task does, set by the test: fail with given errors per attempt, block until
// released (or cancelled), and the device memory each needs. Records starts and memory in use.
class FakeStages {
 public:
  std::vector<store::StagePlan> plan;                                // the one job's plan
  std::map<std::string, compute::DeviceRequirement> requirements;   // by task name
  std::map<std::string, std::vector<absl::Status>> errors;          // by task, per attempt
  std::map<std::string, std::set<int>> blocking;  // task -> attempts that wait for Release
  bool ignore_cancel = false;                     // blocked attempts wait even when cancelled
  bool report_while_blocked = false;              // blocked attempts report progress meanwhile
  std::atomic<int> progress_reports{0};           // how often they did

  void Plan(const std::vector<std::string>& names) {
    store::StagePlan stage;
    stage.kind = "quantize";
    for (const std::string& name : names) stage.tasks.push_back({name, "{}", 100});
    plan = {stage};
  }

  absl::StatusOr<pipeline::TaskOutput> Run(const store::TaskRow& task, compute::Device& device,
                                           const std::atomic<bool>* cancelled,
                                           const std::function<void(uint64_t)>& add_progress) {
    const auto req = requirements.find(task.name);
    const int64_t memory = req == requirements.end() ? 0 : req->second.memory_bytes;
    std::unique_lock<std::mutex> lock(mu_);
    starts_.push_back({task.name, task.attempt, device.name()});
    in_use_[device.name()] += memory;
    peak_[device.name()] = std::max(peak_[device.name()], in_use_[device.name()]);
    ++running_;
    max_running_ = std::max(max_running_, running_);
    cv_.notify_all();
    const auto block = blocking.find(task.name);
    if (block != blocking.end() && block->second.count(task.attempt) != 0) {
      // A real stage checks its cancel flag between tensors; this one every 2 ms.
      while (released_.count(task.name) == 0 && (ignore_cancel || !cancelled->load())) {
        cv_.wait_for(lock, std::chrono::milliseconds(2));
        if (report_while_blocked) {
          add_progress(1);
          progress_reports.fetch_add(1);
        }
      }
    }
    if (const auto r = released_.find(task.name); r != released_.end()) released_.erase(r);
    in_use_[device.name()] -= memory;
    --running_;
    if (cancelled->load() && !ignore_cancel) return absl::CancelledError("cancelled");
    const auto error = errors.find(task.name);
    if (error != errors.end() && task.attempt <= static_cast<int>(error->second.size()) &&
        !error->second[task.attempt - 1].ok()) {
      return error->second[task.attempt - 1];
    }
    pipeline::TaskOutput out;
    out.path = absl::StrCat(task.name, "@", task.attempt);
    return out;
  }

  void Release(const std::string& task) {
    std::lock_guard<std::mutex> lock(mu_);
    released_.insert(task);
    cv_.notify_all();
  }
  // Waits until `n` attempts have started in all.
  bool WaitForStarts(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kPatience, [&] { return starts_.size() >= n; });
  }
  std::vector<Attempt> starts() {
    std::lock_guard<std::mutex> lock(mu_);
    return starts_;
  }
  int64_t peak(const std::string& device) {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_[device];
  }
  int max_running() {
    std::lock_guard<std::mutex> lock(mu_);
    return max_running_;
  }

 private:
  std::mutex mu_;                      // guards the members below
  std::condition_variable cv_;         // signalled on starts and releases
  std::vector<Attempt> starts_;          // every attempt, in start order
  std::multiset<std::string> released_;  // one per Release whose attempt has not returned
  std::map<std::string, int64_t> in_use_;  // device -> memory of running tasks
  std::map<std::string, int64_t> peak_;    // device -> most memory in use at once
  int running_ = 0;
  int max_running_ = 0;
};

class FakeTasks final : public JobTasks {
 public:
  explicit FakeTasks(FakeStages* stages) : stages_(stages) {}
  absl::StatusOr<pipeline::TaskOutput> RunTask(const store::TaskRow& task, compute::Device& device,
                                               const std::atomic<bool>* cancelled,
                                               std::function<void(uint64_t)> add_progress)
      const override {
    return stages_->Run(task, device, cancelled, add_progress);
  }
  absl::Status Complete(store::JobStore& store, const store::TaskLease& lease,
                        const store::TaskRow& /*task*/, const pipeline::TaskOutput& output,
                        int64_t now_ms, bool /*written_here*/) const override {
    return store.CompleteTask(lease, output.path, static_cast<int64_t>(output.bytes),
                              output.sha256, now_ms);
  }
  compute::DeviceRequirement Requirement(const store::TaskRow& task) const override {
    const auto it = stages_->requirements.find(task.name);
    return it == stages_->requirements.end() ? compute::DeviceRequirement{} : it->second;
  }
  absl::StatusOr<int> SweepTmpFiles() const override { return 0; }

 private:
  FakeStages* stages_;
};

class FakeLoaded final : public LoadedJob {
 public:
  FakeLoaded(FakeStages* stages, int64_t job_id, std::atomic<int>* attached)
      : stages_(stages), job_id_(job_id), attached_(attached) {}
  absl::StatusOr<std::unique_ptr<JobTasks>> Attach(
      store::JobStore& store, int64_t, const std::function<void(const std::string&)>&) override {
    attached_->fetch_add(1);
    if (!store.HasPlan(job_id_)) RETURN_IF_ERROR(store.SetPlan(job_id_, stages_->plan));
    return std::unique_ptr<JobTasks>(new FakeTasks(stages_));
  }

 private:
  FakeStages* stages_;
  const int64_t job_id_;
  std::atomic<int>* attached_;  // counts Attach calls
};

// Loads instantly, unless a test holds the source phase: then Load waits until it is let go.
class FakePlanner final : public JobPlanner {
 public:
  explicit FakePlanner(FakeStages* stages) : stages_(stages) {}
  absl::StatusOr<std::unique_ptr<LoadedJob>> Load(const job::JobSpec&,
                                                  pipeline::StoredJob stored) override {
    int load = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      load = ++loads_;
      cv_.notify_all();
      cv_.wait(lock, [&] { return !held_; });
    }
    // What the source phase of the load-th Load does besides (from 1; throws, allocates, ...).
    if (const auto it = behaviour.find(load); it != behaviour.end()) it->second();
    return std::unique_ptr<LoadedJob>(
        new FakeLoaded(stages_, stored.identity.job_id, &attached_));
  }

  // By Load (from 1): run in its source phase before it returns; set before the Load begins.
  std::map<int, std::function<void()>> behaviour;

  // From now on, Load waits in the source phase until LetGo.
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = true;
  }
  void LetGo() {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = false;
    cv_.notify_all();
  }
  // Waits until `n` Loads have begun in all.
  bool WaitForLoads(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kPatience, [&] { return loads_ >= n; });
  }
  int attached() const { return attached_.load(); }

 private:
  FakeStages* stages_;
  std::mutex mu_;               // guards the members below
  std::condition_variable cv_;  // signalled on each Load and on LetGo
  bool held_ = false;           // Load waits while set
  int loads_ = 0;               // Loads begun
  std::atomic<int> attached_{0};
};

class FakeDevice final : public compute::Device {
 public:
  FakeDevice(std::string name, compute::DeviceKind kind, int64_t total)
      : name_(std::move(name)), kind_(kind), total_(total) {}
  compute::DeviceKind kind() const override { return kind_; }
  const std::string& name() const override { return name_; }
  int64_t total_memory_bytes() const override { return total_; }
  absl::StatusOr<int64_t> free_memory_bytes() const override { return total_; }
  bool host_visible() const override { return kind_ == compute::DeviceKind::kCpu; }
  kernels::Backend& backend() override {
    static kernels::Backend* cpu = kernels::MakeCpuBackend({1, kernels::SimdLevel::kAuto})->release();
    return *cpu;
  }
  kernels::Gemm* gemm() override { return nullptr; }  // fake stages multiply nothing

 private:
  const std::string name_;
  const compute::DeviceKind kind_;
  const int64_t total_;
};

// Lets a held source phase go when the test ends, however it ends (Shutdown waits for it).
struct LetGoAtExit {
  FakePlanner* planner;
  ~LetGoAtExit() { planner->LetGo(); }
};

class SchedulerFakeClockTest : public testing_util::TempDirTest {
 protected:
  std::unique_ptr<Scheduler> Start(std::vector<std::string> devices,
                                   SchedulerOptions options = {}) {
    auto store = store::JobStore::Open(dir_ + "/state.db");
    EXPECT_TRUE(store.ok()) << store.status();
    options.devices = std::move(devices);
    options.clock = &clock_;
    options.planner = planner_;
    options.lease_ms = kLeaseMs;
    options.open_device = [](const std::string& name)
        -> absl::StatusOr<std::unique_ptr<compute::Device>> {
      if (name == "cpu") {
        return std::make_unique<FakeDevice>(name, compute::DeviceKind::kCpu, 16 * kGiB);
      }
      return std::make_unique<FakeDevice>(name, compute::DeviceKind::kCuda, 10 * kGiB);
    };
    options.log = [this](int64_t, const std::string& kind, const std::string& message) {
      std::unique_lock<std::mutex> lock(log_mu_);
      const std::string line = kind + ": " + message;
      log_.push_back(line);
      log_cv_.notify_all();
      // The scheduler logs on its strand: waiting here holds the strand.
      if (!hold_at_.empty() && line.rfind(hold_at_, 0) == 0) {
        log_cv_.wait(lock, [&] { return hold_at_.empty(); });
      }
    };
    auto s = Scheduler::Start(std::move(*store), options);
    EXPECT_TRUE(s.ok()) << s.status();
    return std::move(*s);
  }

  job::JobSpec Spec() {
    auto spec = job::ParseJobSpec("{\"source\": \"" + dir_ + "/src\", \"output\": \"" + dir_ +
                                      "/out\", \"weight_format\": \"w4a16_nvfp4\"}",
                                  "test");
    EXPECT_TRUE(spec.ok()) << spec.status();
    return *spec;
  }

  int64_t Submit(Scheduler& s) {
    auto job = s.Submit("", Spec(), nullptr);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? job->id() : 0;
  }

  // Waits (woken by each snapshot, no sleep) until the job stops or `until` holds.
  v1::Job WaitFor(Scheduler& s, int64_t id, const std::function<bool(const v1::Job&)>& until) {
    auto job = s.WaitUntilStopped(id, [&](const v1::Job& j) { return !until(j); });
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }
  v1::Job WaitStopped(Scheduler& s, int64_t id) {
    return WaitFor(s, id, [](const v1::Job&) { return false; });
  }

  // Everything posted to the strand before this call has run when it returns.
  void Sync(Scheduler& s) { (void)s.Delete(1 << 30); }

  // From now on the strand stops in the log line that starts with `prefix` until ReleaseStrand.
  void HoldStrandAt(const std::string& prefix) {
    std::lock_guard<std::mutex> lock(log_mu_);
    hold_at_ = prefix;
  }
  void ReleaseStrand() {
    std::lock_guard<std::mutex> lock(log_mu_);
    hold_at_.clear();
    log_cv_.notify_all();
  }

  // Waits until a log line starts with `prefix`.
  bool WaitForLog(const std::string& prefix) {
    std::unique_lock<std::mutex> lock(log_mu_);
    return log_cv_.wait_for(lock, kPatience, [&] {
      return std::any_of(log_.begin(), log_.end(),
                         [&](const std::string& l) { return l.rfind(prefix, 0) == 0; });
    });
  }

  std::unique_ptr<store::JobStore> OpenStore() {
    auto store = store::JobStore::Open(dir_ + "/state.db");
    EXPECT_TRUE(store.ok()) << store.status();
    return std::move(*store);
  }

  testing_util::FakeClock clock_;
  FakeStages stages_;
  std::shared_ptr<FakePlanner> planner_ = std::make_shared<FakePlanner>(&stages_);
  std::mutex log_mu_;                 // guards log_
  std::condition_variable log_cv_;    // signalled per line
  std::vector<std::string> log_;      // "kind: message" lines of the scheduler
  std::string hold_at_;               // HoldStrandAt's prefix; "" = none
};

struct ReleaseStrandAtExit {
  std::function<void()> release;
  ~ReleaseStrandAtExit() { release(); }
};

TEST_F(SchedulerFakeClockTest, TasksNeverOvercommitADevicesMemory) {
  // Two workers share cuda:0 (10 GiB); the CPU worker can run none of these GPU tasks.
  stages_.Plan({"a", "b", "c", "d"});
  for (const char* t : {"a", "b", "c"}) stages_.requirements[t] = {true, 6 * kGiB};
  stages_.requirements["d"] = {true, 4 * kGiB};
  for (const char* t : {"a", "b", "c", "d"}) stages_.blocking[t] = {1};
  auto s = Start({"cuda:0", "cuda:0", "cpu"});
  const int64_t id = Submit(*s);

  ASSERT_TRUE(stages_.WaitForStarts(1));
  Sync(*s);
  EXPECT_EQ(stages_.starts().size(), 1u);  // b (6 GiB) waits: 6 + 6 > 10
  stages_.Release("a");
  ASSERT_TRUE(stages_.WaitForStarts(2));
  Sync(*s);
  EXPECT_EQ(stages_.starts().size(), 2u);
  stages_.Release("b");
  ASSERT_TRUE(stages_.WaitForStarts(4));  // c (6 GiB) and d (4 GiB) fit side by side
  EXPECT_EQ(stages_.max_running(), 2);
  stages_.Release("c");
  stages_.Release("d");
  const v1::Job done = WaitStopped(*s, id);
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.last_error();
  EXPECT_EQ(stages_.peak("cuda:0"), 10 * kGiB);
  EXPECT_EQ(stages_.peak("cpu"), 0);
  std::vector<std::string> order;
  for (const Attempt& st : stages_.starts()) {
    order.push_back(st.task);
    EXPECT_EQ(st.device, "cuda:0") << st.task;
  }
  // c and d are dispatched together to the two cuda:0 workers; either may record its start first.
  ASSERT_EQ(order.size(), 4u);
  std::sort(order.begin() + 2, order.end());
  EXPECT_EQ(order, (std::vector<std::string>{"a", "b", "c", "d"}));
}

TEST_F(SchedulerFakeClockTest, ATaskNoDeviceCanHoldFailsTheJobNamingWhatItNeeds) {
  stages_.Plan({"big"});
  stages_.requirements["big"] = {true, 20 * kGiB};
  auto s = Start({"cuda:0", "cpu"});
  const v1::Job done = WaitStopped(*s, Submit(*s));
  EXPECT_EQ(done.state(), v1::FAILED);
  EXPECT_EQ(done.last_error(),
            "quantize big: needs a GPU with 21474836480 bytes of memory; none of the job's "
            "devices (cuda:0, cpu) has that");
  EXPECT_TRUE(stages_.starts().empty());
}

TEST_F(SchedulerFakeClockTest, TransientErrorsRetryAfterTheirBackOffPermanentOnesFailTheJob) {
  stages_.Plan({"t"});
  stages_.errors["t"] = {absl::UnavailableError("t: disk busy")};
  auto s = Start({"cpu"});
  const int64_t id = Submit(*s);
  WaitFor(*s, id, [](const v1::Job& j) { return j.task_retries() == 1; });
  // pipeline::RetryDelayMs: 2 s after the first attempt.
  clock_.Advance(1999);
  Sync(*s);
  EXPECT_EQ(stages_.starts().size(), 1u);
  clock_.Advance(1);
  const v1::Job done = WaitStopped(*s, id);
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.last_error();
  ASSERT_EQ(stages_.starts().size(), 2u);
  EXPECT_EQ(stages_.starts()[1].attempt, 2);
  EXPECT_EQ(done.task_retries(), 1);

  stages_.errors["t"] = {absl::InvalidArgumentError("t: tensor x is not finite")};
  const v1::Job failed = WaitStopped(*s, Submit(*s));
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.reason(), "task_failed");
  EXPECT_EQ(failed.last_error(), "quantize: t: tensor x is not finite");
}

TEST_F(SchedulerFakeClockTest, ASilentTaskLosesItsLeaseToAnotherWorkerAndItsLateResultIsIgnored) {
  stages_.Plan({"stuck"});
  stages_.blocking["stuck"] = {1};  // the first attempt hangs, even when asked to stop
  stages_.ignore_cancel = true;
  auto s = Start({"cpu", "cpu"});
  const int64_t id = Submit(*s);
  ASSERT_TRUE(stages_.WaitForStarts(1));
  // The lease timer runs every lease/3. The scheduler renews the stored lease until the task has
  // been silent for over a whole lease (the 4th period), then stops; the stored lease lapses one
  // lease later and the task is requeued. One period at a time: each firing re-arms the timer
  // from the strand, which must have run before the clock moves past the next period.
  for (int i = 0; i < 9; ++i) {
    clock_.Advance(kLeaseMs / 3);
    Sync(*s);
  }
  const v1::Job done = WaitStopped(*s, id);
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.last_error();
  ASSERT_EQ(stages_.starts().size(), 2u);
  EXPECT_EQ(stages_.starts()[1].attempt, 2);
  stages_.Release("stuck");  // the hung attempt returns at last
  ASSERT_TRUE(WaitForLog("task_late: quantize stuck: result of an expired lease ignored"));
  s->Shutdown(std::chrono::seconds(0));
  auto store = OpenStore();
  auto tasks = store->ListTasks(id);
  ASSERT_TRUE(tasks.ok()) << tasks.status();
  ASSERT_EQ(tasks->size(), 1u);
  EXPECT_EQ((*tasks)[0].state, store::TaskState::kDone);
  EXPECT_EQ((*tasks)[0].output_path, "stuck@2");
  EXPECT_EQ(*store->CountEvents(id, "task_done"), 1);
}

TEST_F(SchedulerFakeClockTest, ATaskThatLosesItsLeaseThreeTimesFailsTheJobInsteadOfLooping) {
  stages_.Plan({"stuck"});
  stages_.blocking["stuck"] = {1, 2, 3, 4};  // every attempt hangs, even when asked to stop
  stages_.ignore_cancel = true;
  auto s = Start({"cpu", "cpu", "cpu", "cpu"});  // a free worker for each requeued attempt
  const int64_t id = Submit(*s);
  ASSERT_TRUE(stages_.WaitForStarts(1));
  // Each attempt loses its lease after 4 silent periods and is requeued when the stored lease
  // lapses a lease later (see the test above); 30 periods hold three expiries and more.
  for (int i = 0; i < 30; ++i) {
    clock_.Advance(kLeaseMs / 3);
    Sync(*s);
  }
  const v1::Job failed = WaitStopped(*s, id);
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.reason(), "LEASE_EXPIRED");
  EXPECT_EQ(failed.last_error(),
            "quantize stuck: no progress for 3000 ms, 3 times; the job fails instead of "
            "requeuing the task again");
  EXPECT_EQ(stages_.starts().size(), 3u);  // no fourth attempt
  for (int i = 0; i < 3; ++i) stages_.Release("stuck");  // one release per hung attempt
  s->Shutdown(std::chrono::seconds(1));
}

TEST_F(SchedulerFakeClockTest, ATaskThatReportsProgressKeepsItsLeaseForAsLongAsItRuns) {
  stages_.Plan({"long"});
  stages_.blocking["long"] = {1};
  stages_.report_while_blocked = true;
  auto s = Start({"cpu", "cpu"});
  const int64_t id = Submit(*s);
  ASSERT_TRUE(stages_.WaitForStarts(1));
  for (int i = 0; i < 3 * kLeaseMs / 1000; ++i) {  // three leases long, one timer tick at a time
    // Each lease period sees progress: wait (real time) for a report before the clock moves on.
    const int reports = stages_.progress_reports.load();
    while (stages_.progress_reports.load() == reports) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    clock_.Advance(kLeaseMs / 3);
    Sync(*s);
  }
  stages_.Release("long");
  const v1::Job done = WaitStopped(*s, id);
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.last_error();
  EXPECT_EQ(stages_.starts().size(), 1u);
  EXPECT_EQ(done.task_attempts(), 1);
}

TEST_F(SchedulerFakeClockTest, PauseResumeAndCancelMidJob) {
  stages_.Plan({"a", "b", "c"});
  stages_.blocking["a"] = {1};
  auto s = Start({"cpu"});
  const int64_t id = Submit(*s);
  ASSERT_TRUE(stages_.WaitForStarts(1));
  auto pausing = s->Cancel(id, /*pause=*/true);
  ASSERT_TRUE(pausing.ok()) << pausing.status();
  EXPECT_EQ(pausing->state(), v1::RUNNING);
  EXPECT_EQ(pausing->reason(), "pausing");
  const v1::Job paused = WaitStopped(*s, id);
  ASSERT_EQ(paused.state(), v1::PAUSED);
  EXPECT_EQ(paused.stages(0).tasks_done(), 0);
  auto resumed = s->Resume(id);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  const v1::Job done = WaitStopped(*s, id);
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.last_error();
  EXPECT_EQ(done.stages(0).tasks_done(), 3);
  // a: attempt 1 interrupted, attempt 2 done; b and c once each.
  EXPECT_EQ(stages_.starts().size(), 4u);

  stages_.blocking["a"] = {1};
  const int64_t second = Submit(*s);
  ASSERT_TRUE(stages_.WaitForStarts(5));
  ASSERT_TRUE(s->Cancel(second, /*pause=*/false).ok());
  const v1::Job cancelled = WaitStopped(*s, second);
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_EQ(cancelled.reason(), "cancelled");
  EXPECT_EQ(stages_.starts().size(), 5u);
}

TEST_F(SchedulerFakeClockTest, ShutdownMidJobLeavesItRunningAndTheNextStartFinishesIt) {
  stages_.Plan({"a", "b"});
  stages_.blocking["a"] = {1};
  int64_t id = 0;
  {
    auto s = Start({"cpu"});
    id = Submit(*s);
    ASSERT_TRUE(stages_.WaitForStarts(1));
    s->Shutdown(std::chrono::milliseconds(0));
    EXPECT_EQ(s->Submit("", Spec(), nullptr).status().code(), absl::StatusCode::kUnavailable);
  }
  {
    auto store = OpenStore();
    EXPECT_EQ(store->GetJob(id)->state, store::JobState::kRunning);
    auto tasks = store->ListTasks(id);
    ASSERT_TRUE(tasks.ok()) << tasks.status();
    for (const store::TaskRow& t : *tasks) EXPECT_EQ(t.state, store::TaskState::kPending) << t.name;
  }
  auto s = Start({"cpu"});
  const v1::Job done = WaitStopped(*s, id);
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.last_error();
  EXPECT_EQ(done.reason(), "");
  std::vector<std::string> order;
  for (const Attempt& st : stages_.starts()) {
    order.push_back(absl::StrCat(st.task, "@", st.attempt));
  }
  EXPECT_EQ(order, (std::vector<std::string>{"a@1", "a@2", "b@1"}));
}

TEST_F(SchedulerFakeClockTest, ACompletionTheLockedStoreRefusedIsRecordedOnceItIsFree) {
  stages_.Plan({"a"});
  stages_.blocking["a"] = {1};
  auto s = Start({"cpu"});
  const int64_t id = Submit(*s);
  ASSERT_TRUE(stages_.WaitForStarts(1));
  // Another connection holds the write lock past the store's busy timeout (5 s).
  auto locker = store::SqliteDb::Open(dir_ + "/state.db");
  ASSERT_TRUE(locker.ok()) << locker.status();
  ASSERT_TRUE((*locker)->Exec("BEGIN IMMEDIATE").ok());
  stages_.Release("a");
  ASSERT_TRUE(WaitForLog("store_error: recording quantize a: "));
  EXPECT_EQ(s->board().Get(id)->state(), v1::RUNNING);
  ASSERT_TRUE((*locker)->Exec("ROLLBACK").ok());
  clock_.Advance(1000);
  const v1::Job done = WaitStopped(*s, id);
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.last_error();
  EXPECT_TRUE(s->serving());
  EXPECT_EQ(stages_.starts().size(), 1u);
}

TEST_F(SchedulerFakeClockTest, AStoreThatStaysUnusableStopsTheScheduler) {
  stages_.Plan({"a"});
  stages_.blocking["a"] = {1};
  SchedulerOptions options;
  options.store_retry_limit_ms = 1000;
  std::mutex mu;
  std::vector<std::string> unusable;  // on_store_unusable's messages
  options.on_store_unusable = [&](const absl::Status& error) {
    std::lock_guard<std::mutex> lock(mu);
    unusable.push_back(std::string(error.message()));
  };
  auto s = Start({"cpu"}, options);
  const int64_t id = Submit(*s);
  ASSERT_TRUE(stages_.WaitForStarts(1));
  auto locker = store::SqliteDb::Open(dir_ + "/state.db");
  ASSERT_TRUE(locker.ok()) << locker.status();
  ASSERT_TRUE((*locker)->Exec("BEGIN IMMEDIATE").ok());
  stages_.Release("a");
  ASSERT_TRUE(WaitForLog("store_error: recording quantize a: "));
  clock_.Advance(1000);  // the retry fails too, store_retry_limit_ms after the first failure
  auto stopped = s->WaitUntilStopped(id, nullptr);
  ASSERT_FALSE(stopped.ok());
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kUnavailable);
  // The retried record or the lease renewal, whichever the strand ran first, hit the limit.
  EXPECT_EQ(stopped.status().message().rfind("the job store failed for 1 s; last error (", 0), 0u)
      << stopped.status();
  EXPECT_FALSE(s->serving());
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(unusable.size(), 1u);
    EXPECT_EQ(unusable[0], std::string(stopped.status().message()));
  }
  EXPECT_EQ(s->Submit("", Spec(), nullptr).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE((*locker)->Exec("ROLLBACK").ok());
}

TEST_F(SchedulerFakeClockTest, CommandsAreAnsweredWhileAJobsSourceIsReadAndAStoppedReadIsDropped) {
  stages_.Plan({"a"});
  planner_->Hold();
  auto s = Start({"cpu"});
  const LetGoAtExit let_go{planner_.get()};
  const int64_t first = Submit(*s);
  ASSERT_TRUE(planner_->WaitForLoads(1));  // its source phase waits on the planning pool
  // Commands still go through the strand.
  const int64_t second = Submit(*s);
  EXPECT_EQ(s->board().Get(second)->state(), v1::PENDING);  // the one worker is the first job's
  auto report = s->Report(first, 0);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->state(), v1::RUNNING);
  auto pausing = s->Cancel(first, /*pause=*/true);
  ASSERT_TRUE(pausing.ok()) << pausing.status();
  EXPECT_EQ(WaitStopped(*s, first).state(), v1::PAUSED);
  // Resumed before that source phase ended: the job waits for it, its result is dropped and
  // the job reads its source again.
  auto resumed = s->Resume(first);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->state(), v1::PENDING);
  EXPECT_EQ(planner_->attached(), 0);
  planner_->LetGo();
  const v1::Job second_done = WaitStopped(*s, second);
  EXPECT_EQ(second_done.state(), v1::SUCCEEDED) << second_done.last_error();
  const v1::Job first_done = WaitStopped(*s, first);
  EXPECT_EQ(first_done.state(), v1::SUCCEEDED) << first_done.last_error();
  EXPECT_EQ(planner_->attached(), 2);
  ASSERT_TRUE(planner_->WaitForLoads(3));
  EXPECT_EQ(stages_.starts().size(), 2u);
}

TEST_F(SchedulerFakeClockTest, AReportIsAnsweredWhileTheStrandIsHeld) {
  stages_.Plan({"a"});
  auto s = Start({"cpu"});
  const int64_t kept = Submit(*s);
  const int64_t deleted = Submit(*s);
  ASSERT_EQ(WaitStopped(*s, kept).state(), v1::SUCCEEDED);
  ASSERT_EQ(WaitStopped(*s, deleted).state(), v1::SUCCEEDED);
  std::promise<absl::Status> deleting;
  std::promise<absl::StatusOr<v1::JobReport>> reporting;
  // The strand stops inside the delete command, after its store write.
  HoldStrandAt("state: deleted");
  const ReleaseStrandAtExit release{[this] { ReleaseStrand(); }};
  s->DeleteAsync(deleted, store::DeletePrecondition::kNotRunning,
                 [&](absl::Status status) { deleting.set_value(std::move(status)); });
  ASSERT_TRUE(WaitForLog("state: deleted"));
  s->ReportAsync(kept, 0, [&](absl::StatusOr<v1::JobReport> r) {
    reporting.set_value(std::move(r));
  });
  std::future<absl::StatusOr<v1::JobReport>> report = reporting.get_future();
  ASSERT_EQ(report.wait_for(kPatience), std::future_status::ready);
  ASSERT_TRUE(report.get().ok());
  // The report was answered while the command that holds the strand had not finished.
  std::future<absl::Status> deleted_done = deleting.get_future();
  EXPECT_EQ(deleted_done.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  // It read committed state: the deleted job is gone already.
  auto gone = s->Report(deleted, 0);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  ReleaseStrand();
  ASSERT_EQ(deleted_done.wait_for(kPatience), std::future_status::ready);
  EXPECT_TRUE(deleted_done.get().ok());
}

TEST_F(SchedulerFakeClockTest, AJobCancelledWhileItsSourceIsReadCanBeDeleted) {
  stages_.Plan({"a"});
  planner_->Hold();
  auto s = Start({"cpu"});
  const LetGoAtExit let_go{planner_.get()};
  const int64_t id = Submit(*s);
  ASSERT_TRUE(planner_->WaitForLoads(1));
  ASSERT_TRUE(s->Cancel(id, /*pause=*/false).ok());
  EXPECT_EQ(WaitStopped(*s, id).state(), v1::CANCELLED);
  ASSERT_TRUE(s->Delete(id).ok());
  EXPECT_FALSE(s->board().Get(id).has_value());
  planner_->LetGo();
  const v1::Job next = WaitStopped(*s, Submit(*s));
  EXPECT_EQ(next.state(), v1::SUCCEEDED) << next.last_error();
  EXPECT_EQ(planner_->attached(), 1);  // the deleted job's source phase was dropped
  EXPECT_EQ(stages_.starts().size(), 1u);
}

// A source phase that allocates until its budget stops it (a parser working through a huge
// input that polls its budget): only the budget's cancel, deadline or memory ends it.
void AllocateForever() {
  std::vector<std::string> held;
  while (true) {
    base::ThreadBudgetCheck();
    held.push_back(std::string(1 << 16, 'x'));
    if (held.size() > 64) held.erase(held.begin());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST_F(SchedulerFakeClockTest, AnExceptionWhilePlanningFailsTheJobNamingItsInputNotTheProcess) {
  stages_.Plan({"a"});
  planner_->behaviour[1] = [] { throw std::bad_alloc(); };
  planner_->behaviour[2] = [] {
    const base::ScopedInput outer("/models/m");
    const base::ScopedInput reading("/models/m/tokenizer.json");
    throw std::runtime_error("normalizer \x01 went wrong");
  };
  auto s = Start({"cpu"});
  const v1::Job oom = WaitStopped(*s, Submit(*s));
  EXPECT_EQ(oom.state(), v1::FAILED);
  EXPECT_EQ(oom.reason(), "PLANNING_LIMIT");
  EXPECT_EQ(oom.last_error(), "planning ran out of memory reading the source " + dir_ +
                                  "/src or the job's inputs (a job's planning may hold "
                                  "8589934592 bytes: --planning-memory-bytes)");
  const v1::Job parser = WaitStopped(*s, Submit(*s));
  EXPECT_EQ(parser.state(), v1::FAILED);
  EXPECT_EQ(parser.reason(), "cannot_start");
  EXPECT_EQ(parser.last_error(),
            "planning failed reading /models/m/tokenizer.json: \"normalizer \\x01 went wrong\"");
  const v1::Job next = WaitStopped(*s, Submit(*s));
  EXPECT_EQ(next.state(), v1::SUCCEEDED) << next.last_error();
}

TEST_F(SchedulerFakeClockTest, PlanningPastItsMemoryBudgetFailsTheJob) {
  stages_.Plan({"a"});
  planner_->behaviour[1] = AllocateForever;
  SchedulerOptions options;
  options.planning.memory_bytes = 1 << 20;
  auto s = Start({"cpu"}, options);
  const v1::Job job = WaitStopped(*s, Submit(*s));
  EXPECT_EQ(job.state(), v1::FAILED);
  EXPECT_EQ(job.reason(), "PLANNING_LIMIT");
  EXPECT_EQ(job.last_error(), "planning ran out of memory reading the source " + dir_ +
                                  "/src or the job's inputs (a job's planning may hold 1048576 "
                                  "bytes: --planning-memory-bytes)");
}

TEST_F(SchedulerFakeClockTest, PlanningPastItsDeadlineFailsTheJob) {
  stages_.Plan({"a"});
  planner_->behaviour[1] = AllocateForever;
  SchedulerOptions options;
  options.planning.deadline_ms = 200;
  auto s = Start({"cpu"}, options);
  const v1::Job job = WaitStopped(*s, Submit(*s));
  EXPECT_EQ(job.state(), v1::FAILED);
  EXPECT_EQ(job.reason(), "PLANNING_LIMIT");
  EXPECT_EQ(job.last_error(), "planning took longer than 0.2 s reading the source " + dir_ +
                                  "/src or the job's inputs (--planning-deadline-seconds)");
}

TEST_F(SchedulerFakeClockTest, CancelStopsAPlanningAndJobsPlanSideBySide) {
  stages_.Plan({"a"});
  planner_->behaviour[1] = AllocateForever;
  planner_->behaviour[2] = AllocateForever;
  auto s = Start({"cpu", "cuda:0"});
  auto on = [&](const std::string& device) {
    auto spec = Spec();
    spec.devices = {device};
    auto job = s->Submit("", spec, nullptr);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? job->id() : 0;
  };
  const int64_t first = on("cpu");
  const int64_t second = on("cuda:0");
  // Two plannings run at once (the default pool has two threads), neither ends on its own.
  ASSERT_TRUE(planner_->WaitForLoads(2));
  ASSERT_TRUE(s->Cancel(first, /*pause=*/false).ok());
  ASSERT_TRUE(s->Cancel(second, /*pause=*/false).ok());
  EXPECT_EQ(WaitStopped(*s, first).state(), v1::CANCELLED);
  EXPECT_EQ(WaitStopped(*s, second).state(), v1::CANCELLED);
  // Their plannings stopped: a third job gets a thread and runs.
  const v1::Job third = WaitStopped(*s, on("cpu"));
  EXPECT_EQ(third.state(), v1::SUCCEEDED) << third.last_error();
  EXPECT_EQ(planner_->attached(), 1);
}

TEST_F(SchedulerFakeClockTest, ShutdownAbandonsAWedgedPlanningAfterItsGrace) {
  stages_.Plan({"a"});
  // Shared with the abandoned thread, which may outlive this test.
  auto wedged = std::make_shared<std::atomic<bool>>(true);
  planner_->behaviour[1] = [wedged] {
    while (wedged->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  auto s = Start({"cpu"});
  Submit(*s);
  ASSERT_TRUE(planner_->WaitForLoads(1));
  const auto start = std::chrono::steady_clock::now();
  s->Shutdown(std::chrono::milliseconds(300));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(s->abandoned_planning(), 1);
  *wedged = false;  // lets the abandoned thread end
}

TEST_F(SchedulerFakeClockTest, AJobWhosePlanningCrashesTwiceFailsPlanningCrashed) {
  stages_.Plan({"a"});
  int64_t id = 0;
  {
    auto store = OpenStore();
    bool created = false;
    auto job = store->CreateJob("", job::JobSpecToJson(Spec()), clock_.NowMs(), &created);
    ASSERT_TRUE(job.ok()) << job.status();
    id = *job;
    // Two starts began planning it and never ended: each was a crash.
    ASSERT_TRUE(store->SetJobState(id, store::JobState::kRunning, "started", "", 0).ok());
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(store->AddEvent(id, "planning", "began", 0).ok());
  }
  auto s = Start({"cpu"});
  const v1::Job job = WaitStopped(*s, id);
  EXPECT_EQ(job.state(), v1::FAILED);
  EXPECT_EQ(job.reason(), "PLANNING_CRASHED");
  EXPECT_EQ(job.last_error(),
            "planning this job was interrupted 2 times by a crash or a hang of quantd; it is not "
            "planned again (resume it to try once more)");
  EXPECT_TRUE(planner_->WaitForLoads(0));
  // A resume plans it once more.
  ASSERT_TRUE(s->Resume(id).ok());
  EXPECT_EQ(WaitStopped(*s, id).state(), v1::SUCCEEDED);
}

// Remote workers (issue 22 item 2): the attempt number fences renewals and results. A remote
// attempt that goes silent loses its lease like a local one; its late renewal and completion are
// refused (LEASE_LOST) and change nothing; the new attempt's completion is recorded once.
template <typename T>
T Await(const std::function<void(std::function<void(T)>)>& call) {
  std::promise<T> promise;
  call([&promise](T value) { promise.set_value(std::move(value)); });
  return promise.get_future().get();
}

TEST_F(SchedulerFakeClockTest, ARemoteAttemptThatLostItsLeaseIsFencedOff) {
  stages_.Plan({"a"});
  auto s = Start({});  // no local worker: a coordinator of remote workers only
  const int64_t id = Submit(*s);
  WaitFor(*s, id, [](const v1::Job& j) { return j.stages_size() > 0; });
  const std::vector<RemoteDevice> cpu = {{"cpu", false, 16 * kGiB}};
  auto reg = [&](const std::string& name) {
    return Await<absl::StatusOr<RemoteRegistration>>([&](auto done) {
      s->RegisterWorkerAsync(name, "peer-" + name, cpu, done);
    });
  };
  auto lease = [&](const std::string& worker, std::set<int64_t> open_jobs) {
    return Await<absl::StatusOr<std::optional<RemoteLease>>>([&](auto done) {
      s->LeaseRemoteAsync(worker, 0, 0, open_jobs, done);
    });
  };
  auto renew = [&](const std::string& worker, int64_t task, int attempt) {
    return Await<absl::StatusOr<bool>>([&](auto done) {
      s->RenewRemoteAsync(worker, task, attempt, 50, done);
    });
  };
  auto complete = [&](const std::string& worker, int64_t task, int attempt, std::string path) {
    pipeline::TaskOutput out;
    out.path = std::move(path);
    out.bytes = 7;
    out.sha256 = std::string(64, 'a');
    return Await<absl::Status>([&](auto done) {
      s->CompleteRemoteAsync(worker, task, attempt, std::move(out), done);
    });
  };
  const absl::StatusOr<RemoteRegistration> w1 = reg("w1");
  ASSERT_TRUE(w1.ok()) << w1.status();
  EXPECT_EQ(w1->lease_ms, kLeaseMs);
  const auto first = lease(w1->worker_id, {});
  ASSERT_TRUE(first.ok() && first->has_value()) << first.status();
  const RemoteLease& l1 = **first;
  EXPECT_EQ(l1.job_id, id);
  EXPECT_EQ(l1.task.name, "a");
  EXPECT_EQ(l1.task.attempt, 1);
  EXPECT_TRUE(l1.job_included);
  EXPECT_EQ(l1.work_dir, dir_ + "/state.db.work/job-" + std::to_string(id));
  ASSERT_EQ(l1.tasks.size(), 1u);
  // Nothing else to lease.
  const auto none = lease(w1->worker_id, {id});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());

  // The wrong attempt, an unknown worker: refused.
  EXPECT_EQ(ReasonOf(renew(w1->worker_id, l1.task.id, 2).status()), "LEASE_LOST");
  EXPECT_EQ(ReasonOf(renew("no-such-worker", l1.task.id, 1).status()), "WORKER_UNKNOWN");
  const absl::StatusOr<bool> renewed = renew(w1->worker_id, l1.task.id, 1);
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_FALSE(*renewed);  // the job is not stopping

  // w1 goes silent: 8 timer periods take its lease (the 4th) and requeue the task once the stored
  // lease lapsed (the 7th), before the worker itself is forgotten (after three leases).
  for (int i = 0; i < 8; ++i) {
    clock_.Advance(kLeaseMs / 3);
    Sync(*s);
  }
  const absl::StatusOr<RemoteRegistration> w2 = reg("w2");
  ASSERT_TRUE(w2.ok()) << w2.status();
  // A job the worker holds is not sent again; its creation time always is (ids may be reused).
  const auto second = lease(w2->worker_id, {id});
  ASSERT_TRUE(second.ok() && second->has_value()) << second.status();
  EXPECT_EQ((*second)->task.attempt, 2);
  EXPECT_EQ((*second)->job_created_ms, l1.job_created_ms);
  EXPECT_FALSE((*second)->job_included);

  // The silent attempt returns: its renewal and its completion change nothing.
  const std::string out = dir_ + "/out/a.safetensors";
  EXPECT_EQ(ReasonOf(renew(w1->worker_id, l1.task.id, 1).status()), "LEASE_LOST");
  const absl::Status late = complete(w1->worker_id, l1.task.id, 1, out + ".late");
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonOf(late), "LEASE_LOST");
  EXPECT_EQ(late.message(),
            "task " + std::to_string(l1.task.id) +
                " attempt 1 no longer holds its lease (it expired, or the job stopped); the "
                "result is not recorded");
  // A path outside the job's output is refused; the attempt keeps its lease.
  EXPECT_EQ(ReasonOf(complete(w2->worker_id, l1.task.id, 2, "/etc/passwd")), "INVALID_REQUEST");
  EXPECT_TRUE(complete(w2->worker_id, l1.task.id, 2, out).ok());
  // Recorded once: a repeated completion is refused too.
  EXPECT_EQ(ReasonOf(complete(w2->worker_id, l1.task.id, 2, out)), "LEASE_LOST");
  EXPECT_EQ(WaitStopped(*s, id).state(), v1::SUCCEEDED);
  const std::vector<RemoteWorkerView> views =
      Await<std::vector<RemoteWorkerView>>([&](auto done) { s->ListWorkersAsync(done); });
  ASSERT_EQ(views.size(), 2u);
  EXPECT_EQ(views[0].name, "w1");
  EXPECT_EQ(views[0].tasks_leased, 1);
  EXPECT_EQ(views[1].name, "w2");
  EXPECT_EQ(views[1].peer, "peer-w2");
  EXPECT_EQ(views[1].tasks_leased, 1);
  EXPECT_TRUE(views[1].tasks.empty());
  s->Shutdown(std::chrono::seconds(0));
  auto store = OpenStore();
  auto tasks = store->ListTasks(id);
  ASSERT_TRUE(tasks.ok()) << tasks.status();
  ASSERT_EQ(tasks->size(), 1u);
  EXPECT_EQ((*tasks)[0].state, store::TaskState::kDone);
  EXPECT_EQ((*tasks)[0].attempt, 2);
  EXPECT_EQ((*tasks)[0].output_path, out);
  EXPECT_EQ(*store->CountEvents(id, "task_done"), 1);
}

// Issue 22 item 1: on a coordinator without local workers, a runnable task that no registered
// worker's device fits fails its job (NO_WORKER) once the newest registration is a lease old,
// naming the task and the largest device; with no worker registered the job keeps waiting, and a
// task whose dependency is not DONE is not judged yet.
TEST_F(SchedulerFakeClockTest, ATaskNoRegisteredWorkerFitsFailsTheJobButNoWorkerMeansWait) {
  stages_.Plan({"a", "big"});
  stages_.plan[0].tasks[1].requirement = {false, 20 * kGiB};
  stages_.plan[0].tasks[1].depends_on = {{"quantize", "a"}};
  auto s = Start({});
  const int64_t id = Submit(*s);
  WaitFor(*s, id, [](const v1::Job& j) { return j.stages_size() > 0; });
  auto tick = [&](int n) {
    for (int i = 0; i < n; ++i) {
      clock_.Advance(kLeaseMs / 3);
      Sync(*s);
    }
  };
  auto reg = [&](const std::string& name, std::vector<RemoteDevice> devices) {
    auto r = Await<absl::StatusOr<RemoteRegistration>>([&](auto done) {
      s->RegisterWorkerAsync(name, "peer-" + name, devices, done);
    });
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->worker_id : std::string();
  };
  auto lease = [&](const std::string& worker) {
    auto l = Await<absl::StatusOr<std::optional<RemoteLease>>>([&](auto done) {
      s->LeaseRemoteAsync(worker, 0, 0, {}, done);
    });
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? *l : std::nullopt;
  };
  // No worker: the job waits, however long.
  tick(30);
  EXPECT_EQ(WaitFor(*s, id, [](const v1::Job&) { return true; }).state(), v1::RUNNING);
  // A small worker: "big" waits for "a", so nothing is judged while "a" runs.
  const std::string small = reg("small", {{"cpu", false, 16 * kGiB}, {"cpu", false, 8 * kGiB}});
  const std::optional<RemoteLease> a = lease(small);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->task.name, "a");
  for (int i = 0; i < 6; ++i) {  // two leases, "a" renewed meanwhile
    tick(1);
    EXPECT_TRUE(Await<absl::StatusOr<bool>>([&](auto done) {
                  s->RenewRemoteAsync(small, a->task.id, a->task.attempt, 0, done);
                }).ok());
  }
  EXPECT_EQ(WaitFor(*s, id, [](const v1::Job&) { return true; }).state(), v1::RUNNING);
  pipeline::TaskOutput out;
  out.path = dir_ + "/out/a.safetensors";
  EXPECT_TRUE(Await<absl::Status>([&](auto done) {
                s->CompleteRemoteAsync(small, a->task.id, a->task.attempt, std::move(out), done);
              }).ok());
  // "big" is runnable now, and no registered device holds 20 GiB: the next lease timer fails
  // the job.
  tick(1);
  const v1::Job done = WaitStopped(*s, id);
  EXPECT_EQ(done.state(), v1::FAILED);
  EXPECT_EQ(done.reason(), "NO_WORKER");
  EXPECT_EQ(done.last_error(),
            "quantize big: needs a device with 21474836480 bytes of memory; the largest device "
            "of the 1 registered worker(s) has 17179869184 bytes (worker small, cpu), and this "
            "quantd runs no local worker (--devices none)");
}

TEST_F(SchedulerFakeClockTest, AGpuTaskFailsOnlyOnceTheWorkersRegisteredTogetherHaveNoGpu) {
  stages_.Plan({"gpu"});
  stages_.plan[0].tasks[0].requirement = {true, 0};
  auto s = Start({});
  const int64_t id = Submit(*s);
  WaitFor(*s, id, [](const v1::Job& j) { return j.stages_size() > 0; });
  auto reg = [&](const std::string& name, std::vector<RemoteDevice> devices) {
    auto r = Await<absl::StatusOr<RemoteRegistration>>([&](auto done) {
      s->RegisterWorkerAsync(name, "peer-" + name, devices, done);
    });
    EXPECT_TRUE(r.ok()) << r.status();
  };
  reg("cpu-only", {{"cpu", false, 16 * kGiB}});
  // Within a lease of the newest registration nothing is judged: a GPU worker may still come.
  clock_.Advance(kLeaseMs / 3);
  Sync(*s);
  clock_.Advance(kLeaseMs / 3);
  Sync(*s);
  EXPECT_EQ(WaitFor(*s, id, [](const v1::Job&) { return true; }).state(), v1::RUNNING);
  reg("also-cpu", {{"cpu", false, 64 * kGiB}});
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(kLeaseMs / 3);
    Sync(*s);
  }
  const v1::Job done = WaitStopped(*s, id);
  EXPECT_EQ(done.state(), v1::FAILED);
  EXPECT_EQ(done.reason(), "NO_WORKER");
  EXPECT_EQ(done.last_error(),
            "quantize gpu: needs a GPU; none of the 2 registered worker(s) has a GPU, and this "
            "quantd runs no local worker (--devices none)");
  EXPECT_TRUE(stages_.starts().empty());
}

// Issue 22 item 5: a lease carries the whole plan only with the job itself (the worker checks it
// against its own); a worker that holds the job gets the leased task and what it depends on.
TEST_F(SchedulerFakeClockTest, ALeaseCarriesTheWholePlanOnlyWithTheJob) {
  stages_.Plan({"a", "b", "c"});
  stages_.plan[0].tasks[2].depends_on = {{"quantize", "a"}};
  auto s = Start({});
  const int64_t id = Submit(*s);
  WaitFor(*s, id, [](const v1::Job& j) { return j.stages_size() > 0; });
  const auto w = Await<absl::StatusOr<RemoteRegistration>>([&](auto done) {
    s->RegisterWorkerAsync("w", "peer", {{"cpu", false, 16 * kGiB}}, done);
  });
  ASSERT_TRUE(w.ok()) << w.status();
  auto lease = [&](std::set<int64_t> open_jobs) {
    auto l = Await<absl::StatusOr<std::optional<RemoteLease>>>([&](auto done) {
      s->LeaseRemoteAsync(w->worker_id, 0, 0, open_jobs, done);
    });
    EXPECT_TRUE(l.ok() && l->has_value()) << l.status();
    return l.ok() && l->has_value() ? **l : RemoteLease();
  };
  auto complete = [&](const RemoteLease& l) {
    pipeline::TaskOutput out;
    out.path = dir_ + "/out/" + l.task.name + ".safetensors";
    out.bytes = 7;
    out.sha256 = std::string(64, 'b');
    EXPECT_TRUE(Await<absl::Status>([&](auto done) {
                  s->CompleteRemoteAsync(w->worker_id, l.task.id, l.task.attempt,
                                         std::move(out), done);
                }).ok());
  };
  auto names = [](const RemoteLease& l) {
    std::vector<std::string> out;
    for (const store::TaskRow& t : l.tasks) out.push_back(t.name);
    return out;
  };
  const RemoteLease a = lease({});
  EXPECT_TRUE(a.job_included);
  EXPECT_EQ(a.task.name, "a");
  EXPECT_EQ(names(a), (std::vector<std::string>{"a", "b", "c"}));
  complete(a);
  const RemoteLease b = lease({id});
  EXPECT_FALSE(b.job_included);
  EXPECT_EQ(b.task.name, "b");
  EXPECT_EQ(names(b), (std::vector<std::string>{"b"}));
  const RemoteLease c = lease({id});
  EXPECT_EQ(c.task.name, "c");
  ASSERT_EQ(names(c), (std::vector<std::string>{"a", "c"}));
  EXPECT_EQ(c.tasks[0].state, store::TaskState::kDone);
  EXPECT_EQ(c.tasks[0].output_path, dir_ + "/out/a.safetensors");
  EXPECT_EQ(c.tasks[0].output_sha256, std::string(64, 'b'));
  complete(b);
  complete(c);
  EXPECT_EQ(WaitStopped(*s, id).state(), v1::SUCCEEDED);
}

}  // namespace
}  // namespace quantd::scheduler
