// The gRPC API in process: a real JobStore (SQLite file), a real Scheduler on one CPU worker and
// the ApiServer on a unix socket (where this process's own uid is an admin), called through a
// real channel. Jobs run on the tiny V4 fixture
// (about 0.6 s each) or on a larger variant of it when a test needs a job that stays RUNNING for
// a few seconds. Covers every RPC's errors (codes, messages, the quantd-reason trailer), paging,
// idempotent submission, WatchJob ordering, deletion, client cancel and server shutdown, pause
// and resume, listen addresses, health, RPC metrics, and 50 streams plus 200 pollers on one
// running job.
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/api/server.h"
#include "server/fixture/fixture.h"
#include "server/pipeline/stages/verify_rules.h"
#include "server/store/job_store.h"
#include "server/store/sqlite_db.h"
#include "tests/unit/test_dirs.h"

namespace quantd::api {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

// A finished call: its status and its quantd-reason trailer ("" when none).
struct CallStatus {
  grpc::Status status;
  std::string reason;
};

std::string ReasonOf(const grpc::ClientContext& context) {
  const auto& trailers = context.GetServerTrailingMetadata();
  auto it = trailers.find(kReasonKey);
  return it == trailers.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

// Everything a WatchJob stream delivered.
struct WatchResult {
  std::vector<v1::Job> jobs;
  grpc::Status status;
  std::string reason;
};

bool IsFinal(v1::JobState s) {
  return s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED || s == v1::PAUSED;
}

void ExpectError(const CallStatus& c, grpc::StatusCode code, const std::string& reason,
                 const std::string& in_message) {
  EXPECT_EQ(c.status.error_code(), code) << c.status.error_message();
  EXPECT_EQ(c.reason, reason) << c.status.error_message();
  EXPECT_NE(c.status.error_message().find(in_message), std::string::npos)
      << "\"" << in_message << "\" not in: " << c.status.error_message();
}

class ApiTest : public testing_util::TempDirTest {
 protected:
  // The tiny fixture, and a larger one whose job runs for a few seconds: 64 routed experts of
  // width 512 instead of 8 of width 128, with requantized experts.
  static void SetUpTestSuite() {
    tiny_ = new std::string(testing_util::TestDir("tiny"));
    auto tiny = fixture::WriteFixture(
        fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny), 7, *tiny_, {});
    ASSERT_TRUE(tiny.ok()) << tiny.status();
    slow_ = new std::string(testing_util::TestDir("slow"));
    fixture::FixtureConfig config =
        fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny);
    config.n_routed_experts = 64;
    config.moe_intermediate_size = 512;
    config.shard_bytes = 8ull << 20;
    auto slow = fixture::WriteFixture(config, 7, *slow_, {});
    ASSERT_TRUE(slow.ok()) << slow.status();
  }
  static void TearDownTestSuite() {
    delete tiny_;
    delete slow_;
  }

  void SetUp() override {
    TempDirTest::SetUp();
    options_.devices = {"cpu"};
    options_.cpu_threads = 1;
    options_.lease_ms = 3000;
  }

  void TearDown() override {
    stub_.reset();
    if (server_ != nullptr) server_->Shutdown(std::chrono::milliseconds(0));
    server_.reset();
    scheduler_.reset();
    TempDirTest::TearDown();
  }

  // Starts the scheduler (with options_) and the server, and connects.
  void Start() {
    auto store = store::JobStore::Open(dir_ + "/quantd.db");
    ASSERT_TRUE(store.ok()) << store.status();
    auto scheduler = scheduler::Scheduler::Start(*std::move(store), options_);
    ASSERT_TRUE(scheduler.ok()) << scheduler.status();
    scheduler_ = *std::move(scheduler);
    auto server = ApiServer::Start(Listen({"unix:" + dir_ + "/api.sock"}), scheduler_.get(),
                                   metrics_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_EQ(server_->bound_addresses().size(), 1u);
    channel_ =
        grpc::CreateChannel(server_->bound_addresses()[0], grpc::InsecureChannelCredentials());
    stub_ = v1::QuantService::NewStub(channel_);
  }

  // Server options for `listen`, with the default access policy.
  static ApiServerOptions Listen(std::vector<std::string> listen) {
    ApiServerOptions options;
    options.listen = std::move(listen);
    auto policy = AccessPolicy::Load("", "", geteuid());
    EXPECT_TRUE(policy.ok()) << policy.status();
    options.policy = *std::move(policy);
    return options;
  }

  // A W4A16 experts spec on the tiny fixture (slow = the larger one, requantized) into
  // dir_/<out>.
  v1::JobSpec Spec(const std::string& out, bool slow = false) {
    v1::JobSpec spec;
    spec.set_source(slow ? *slow_ : *tiny_);
    spec.set_output(dir_ + "/" + out);
    spec.set_weight_format("w4a16_nvfp4");
    if (slow) spec.set_expert_cast("requantize");
    spec.add_devices("cpu");
    return spec;
  }

  template <typename Request, typename Response>
  CallStatus Call(grpc::Status (v1::QuantService::Stub::*method)(grpc::ClientContext*,
                                                                 const Request&, Response*),
                  const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(30));
    grpc::Status status = (stub_.get()->*method)(&context, request, response);
    return {status, ReasonOf(context)};
  }

  CallStatus Submit(const v1::JobSpec& spec, const std::string& request_id, v1::Job* job) {
    v1::SubmitJobRequest request;
    request.set_request_id(request_id);
    *request.mutable_spec() = spec;
    return Call(&v1::QuantService::Stub::SubmitJob, request, job);
  }
  int64_t MustSubmit(const v1::JobSpec& spec, const std::string& request_id = "") {
    v1::Job job;
    const CallStatus c = Submit(spec, request_id, &job);
    EXPECT_TRUE(c.status.ok()) << c.status.error_message();
    return job.id();
  }
  CallStatus Get(int64_t id, v1::Job* job) {
    v1::GetJobRequest request;
    request.set_id(id);
    return Call(&v1::QuantService::Stub::GetJob, request, job);
  }
  CallStatus Cancel(int64_t id, bool pause, v1::Job* job) {
    v1::CancelJobRequest request;
    request.set_id(id);
    request.set_pause(pause);
    return Call(&v1::QuantService::Stub::CancelJob, request, job);
  }
  CallStatus Resume(int64_t id, v1::Job* job) {
    v1::ResumeJobRequest request;
    request.set_id(id);
    return Call(&v1::QuantService::Stub::ResumeJob, request, job);
  }
  CallStatus Delete(int64_t id) {
    v1::DeleteJobRequest request;
    request.set_id(id);
    v1::DeleteJobResponse response;
    return Call(&v1::QuantService::Stub::DeleteJob, request, &response);
  }
  CallStatus Report(int64_t id, int worst, v1::JobReport* report) {
    v1::GetJobReportRequest request;
    request.set_id(id);
    request.set_worst(worst);
    return Call(&v1::QuantService::Stub::GetJobReport, request, report);
  }
  CallStatus List(v1::JobState state, int page_size, const std::string& token,
                  v1::ListJobsResponse* response) {
    v1::ListJobsRequest request;
    request.set_state(state);
    request.set_page_size(page_size);
    request.set_page_token(token);
    return Call(&v1::QuantService::Stub::ListJobs, request, response);
  }

  WatchResult Watch(int64_t id) {
    WatchResult r;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(60));
    v1::WatchJobRequest request;
    request.set_id(id);
    std::unique_ptr<grpc::ClientReader<v1::Job>> reader = stub_->WatchJob(&context, request);
    v1::Job job;
    while (reader->Read(&job)) r.jobs.push_back(job);
    r.status = reader->Finish();
    r.reason = ReasonOf(context);
    return r;
  }

  // Polls GetJob until the job is in `state` (or in a final state); returns the last snapshot.
  v1::Job WaitFor(int64_t id, v1::JobState state) {
    v1::Job job;
    const auto until = std::chrono::steady_clock::now() + seconds(60);
    while (std::chrono::steady_clock::now() < until) {
      const CallStatus c = Get(id, &job);
      EXPECT_TRUE(c.status.ok()) << c.status.error_message();
      if (!c.status.ok() || job.state() == state || IsFinal(job.state())) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return job;
  }

  // The job's output passes every export rule.
  void ExpectVerified(const std::string& out) {
    absl::StatusOr<pipeline::VerifyReport> report = pipeline::VerifyCheckpoint(dir_ + "/" + out);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->ok()) << pipeline::FormatViolations(report->violations);
    EXPECT_GT(report->nvfp4_modules, 0);
  }

  static std::string* tiny_;  // the tiny fixture's directory
  static std::string* slow_;  // the larger fixture's directory

  scheduler::SchedulerOptions options_;        // for Start()
  std::unique_ptr<metrics::Metrics> metrics_;  // passed to the server when set
  std::unique_ptr<scheduler::Scheduler> scheduler_;
  std::unique_ptr<ApiServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::QuantService::Stub> stub_;
};

std::string* ApiTest::tiny_ = nullptr;
std::string* ApiTest::slow_ = nullptr;

TEST_F(ApiTest, JobRunsToSucceededAndWatchSeesItsStatesInOrder) {
  Start();
  const int64_t id = MustSubmit(Spec("out"));
  ASSERT_EQ(id, 1);
  const WatchResult w = Watch(id);
  ASSERT_TRUE(w.status.ok()) << w.status.error_message();
  ASSERT_FALSE(w.jobs.empty());
  for (size_t i = 0; i < w.jobs.size(); ++i) {
    EXPECT_EQ(w.jobs[i].id(), id);
    if (i > 0) {
      EXPECT_LE(w.jobs[i - 1].state(), w.jobs[i].state()) << "message " << i;
    }
  }
  const v1::Job& last = w.jobs.back();
  EXPECT_EQ(last.state(), v1::SUCCEEDED);
  EXPECT_EQ(last.last_error(), "");
  EXPECT_TRUE(last.has_end_time());
  ASSERT_FALSE(last.stages().empty());
  for (const v1::StageProgress& stage : last.stages()) {
    EXPECT_EQ(stage.state(), v1::StageProgress::SUCCEEDED) << stage.kind();
    EXPECT_EQ(stage.tasks_done(), stage.tasks_total()) << stage.kind();
    EXPECT_EQ(stage.workers_size(), 0) << stage.kind();  // no remote worker ran a task
  }
  EXPECT_EQ(last.spec().weight_format(), "w4a16_nvfp4");
  EXPECT_EQ(last.spec().recipe(), "experts");
  ExpectVerified("out");

  // A stream on a finished job: the snapshot, then the end.
  const WatchResult again = Watch(id);
  EXPECT_TRUE(again.status.ok());
  ASSERT_EQ(again.jobs.size(), 1u);
  EXPECT_EQ(again.jobs[0].state(), v1::SUCCEEDED);

  // The report: worst SQNR first, one passed check per output shard.
  v1::JobReport all;
  ASSERT_TRUE(Report(id, 0, &all).status.ok());
  EXPECT_EQ(all.job_id(), id);
  EXPECT_EQ(all.state(), v1::SUCCEEDED);
  ASSERT_GT(all.tensors_total(), 3);
  ASSERT_EQ(all.tensors_size(), all.tensors_total());
  for (int i = 1; i < all.tensors_size(); ++i) {
    EXPECT_LE(all.tensors(i - 1).sqnr_db(), all.tensors(i).sqnr_db());
  }
  EXPECT_EQ(all.min_sqnr_db(), all.tensors(0).sqnr_db());
  int shards = 0;
  for (const auto& entry : fs::directory_iterator(dir_ + "/out")) {
    shards += entry.path().extension() == ".safetensors";
  }
  ASSERT_EQ(all.rules_size(), shards);
  for (const v1::RuleCheck& rule : all.rules()) EXPECT_TRUE(rule.passed()) << rule.name();
  EXPECT_EQ(all.layers_size(), 0);  // W4A16: no input amax
  EXPECT_EQ(all.modules_without_statistics(), 0);
  // Every task ran once, on this daemon (worker ""), in plan order.
  int64_t tasks = 0;
  for (const v1::StageProgress& stage : last.stages()) tasks += stage.tasks_total();
  ASSERT_EQ(all.tasks_size(), tasks);
  EXPECT_EQ(all.tasks(0).stage(), last.stages(0).kind());
  for (const v1::TaskRun& run : all.tasks()) {
    EXPECT_EQ(run.worker(), "") << run.name();
    EXPECT_EQ(run.attempt(), 1) << run.name();
    EXPECT_TRUE(run.done()) << run.name();
  }
  v1::JobReport worst;
  ASSERT_TRUE(Report(id, 3, &worst).status.ok());
  ASSERT_EQ(worst.tensors_size(), 3);
  EXPECT_EQ(worst.tensors(2).tensor(), all.tensors(2).tensor());

  // Two modules quantized by an earlier release, which recorded no statistics: the report counts
  // them instead of leaving them out silently.
  auto db = store::SqliteDb::Open(dir_ + "/quantd.db");
  ASSERT_TRUE(db.ok()) << db.status();
  ASSERT_TRUE((*db)->Exec("DELETE FROM tensor_stats WHERE tensor IN ('" + all.tensors(0).tensor() +
                          "', '" + all.tensors(1).tensor() + "')")
                  .ok());
  v1::JobReport upgraded;
  ASSERT_TRUE(Report(id, 0, &upgraded).status.ok());
  EXPECT_EQ(upgraded.tensors_total(), all.tensors_total() - 2);
  EXPECT_EQ(upgraded.modules_without_statistics(), 2);
}

TEST_F(ApiTest, SubmitIsIdempotentOnRequestId) {
  Start();
  v1::Job first;
  ASSERT_TRUE(Submit(Spec("out"), "req-1", &first).status.ok());
  v1::Job second;
  ASSERT_TRUE(Submit(Spec("out"), "req-1", &second).status.ok());
  EXPECT_EQ(second.id(), first.id());
  EXPECT_EQ(second.request_id(), "req-1");
  v1::Job other;
  ExpectError(Submit(Spec("elsewhere"), "req-1", &other), grpc::StatusCode::ALREADY_EXISTS,
              "REQUEST_ID_REUSED", "req-1");
  v1::ListJobsResponse list;
  ASSERT_TRUE(List(v1::JOB_STATE_UNSPECIFIED, 0, "", &list).status.ok());
  EXPECT_EQ(list.jobs_size(), 1);
  EXPECT_EQ(WaitFor(first.id(), v1::SUCCEEDED).state(), v1::SUCCEEDED);
}

TEST_F(ApiTest, SubmitRejectsBadRequests) {
  Start();
  v1::Job job;
  v1::JobSpec spec = Spec("out");
  spec.set_weight_format("int3");
  ExpectError(Submit(spec, "", &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_SPEC",
              "weight_format");
  spec = Spec("out");
  spec.clear_source();
  ExpectError(Submit(spec, "", &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_SPEC", "source");
  spec = Spec("out");
  spec.set_kv_cache("fp16");
  ExpectError(Submit(spec, "", &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_SPEC",
              "kv_cache");
  spec = Spec("out");
  spec.clear_devices();
  spec.add_devices("cuda:7");
  ExpectError(Submit(spec, "", &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_SPEC",
              "spec.devices: cuda:7");
  // The calibration's paths: each is checked and named, datasets entries by index.
  spec = Spec("out");
  spec.mutable_calibration()->add_datasets()->set_path(dir_ + "/a.jsonl");
  spec.mutable_calibration()->add_datasets()->set_path("/" + std::string(4095, 'p'));
  ExpectError(Submit(spec, "", &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_SPEC",
              "SubmitJobRequest.spec: field 'calibration.datasets[1].path' is 4096 bytes, more "
              "than 4095 (PATH_MAX)");
  spec = Spec("out");
  spec.mutable_calibration()->add_datasets()->set_path("rel.jsonl");
  ExpectError(Submit(spec, "", &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_SPEC",
              "SubmitJobRequest.spec: calibration.datasets[0].path: must be an absolute path");
  spec = Spec("out");
  spec.mutable_calibration()->set_amax_out(*tiny_ + "/amax.json");
  ExpectError(Submit(spec, "", &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_SPEC",
              "SubmitJobRequest.spec: calibration.amax_out: " + *tiny_ +
                  "/amax.json lies inside the source directory " + *tiny_);
  ExpectError(Submit(Spec("out"), std::string(129, 'a'), &job), grpc::StatusCode::INVALID_ARGUMENT,
              "INVALID_REQUEST", "request_id: at most 128 characters, got 129");
  ExpectError(Submit(Spec("out"), "a\nb", &job), grpc::StatusCode::INVALID_ARGUMENT,
              "INVALID_REQUEST", "byte 0x0a at offset 1");
  // None of them created a job; 128 characters is fine.
  v1::ListJobsResponse list;
  ASSERT_TRUE(List(v1::JOB_STATE_UNSPECIFIED, 0, "", &list).status.ok());
  EXPECT_EQ(list.jobs_size(), 0);
  EXPECT_TRUE(Submit(Spec("out"), std::string(128, '~'), &job).status.ok());
}

TEST_F(ApiTest, UnknownAndInvalidIds) {
  Start();
  v1::Job job;
  v1::JobReport report;
  ExpectError(Get(42, &job), grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND", "job 42 not found");
  ExpectError(Cancel(42, false, &job), grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND", "job 42");
  ExpectError(Cancel(42, true, &job), grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND", "job 42");
  ExpectError(Resume(42, &job), grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND", "job 42");
  ExpectError(Delete(42), grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND", "job 42");
  ExpectError(Report(42, 0, &report), grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND", "job 42");
  const WatchResult w = Watch(42);
  EXPECT_TRUE(w.jobs.empty());
  ExpectError({w.status, w.reason}, grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND",
              "job 42 not found");

  for (const int64_t bad : {int64_t{0}, int64_t{-3}}) {
    const std::string message = absl::StrCat("id: must be > 0, got ", bad);
    ExpectError(Get(bad, &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_REQUEST", message);
    ExpectError(Cancel(bad, false, &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_REQUEST",
                message);
    ExpectError(Resume(bad, &job), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_REQUEST", message);
    ExpectError(Delete(bad), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_REQUEST", message);
    ExpectError(Report(bad, 0, &report), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_REQUEST",
                message);
    const WatchResult bad_watch = Watch(bad);
    EXPECT_TRUE(bad_watch.jobs.empty());
    ExpectError({bad_watch.status, bad_watch.reason}, grpc::StatusCode::INVALID_ARGUMENT,
                "INVALID_REQUEST", message);
  }
  const int64_t id = MustSubmit(Spec("out"));
  ExpectError(Report(id, -1, &report), grpc::StatusCode::INVALID_ARGUMENT, "INVALID_REQUEST",
              "worst: must be >= 0, got -1");
  EXPECT_EQ(WaitFor(id, v1::SUCCEEDED).state(), v1::SUCCEEDED);
}

TEST_F(ApiTest, ForbiddenTransitions) {
  Start();
  v1::Job job;
  // A finished job can be neither resumed nor cancelled nor paused.
  const int64_t done = MustSubmit(Spec("done"));
  ASSERT_EQ(WaitFor(done, v1::SUCCEEDED).state(), v1::SUCCEEDED);
  ExpectError(Resume(done, &job), grpc::StatusCode::FAILED_PRECONDITION, "TRANSITION_FORBIDDEN",
              "SUCCEEDED");
  ExpectError(Cancel(done, false, &job), grpc::StatusCode::FAILED_PRECONDITION,
              "TRANSITION_FORBIDDEN", "SUCCEEDED");
  ExpectError(Cancel(done, true, &job), grpc::StatusCode::FAILED_PRECONDITION,
              "TRANSITION_FORBIDDEN", "SUCCEEDED");

  // A running job cannot be deleted; once cancelled it cannot be cancelled again, but deleted.
  const int64_t running = MustSubmit(Spec("running", /*slow=*/true));
  ASSERT_EQ(WaitFor(running, v1::RUNNING).state(), v1::RUNNING);
  ExpectError(Delete(running), grpc::StatusCode::FAILED_PRECONDITION, "JOB_RUNNING", "RUNNING");
  ASSERT_TRUE(Cancel(running, false, &job).status.ok());
  EXPECT_EQ(WaitFor(running, v1::CANCELLED).state(), v1::CANCELLED);
  ExpectError(Cancel(running, false, &job), grpc::StatusCode::FAILED_PRECONDITION,
              "TRANSITION_FORBIDDEN", "CANCELLED");
  ExpectError(Resume(running, &job), grpc::StatusCode::FAILED_PRECONDITION, "TRANSITION_FORBIDDEN",
              "CANCELLED");
  EXPECT_TRUE(Delete(running).status.ok());
  ExpectError(Get(running, &job), grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND", "not found");
  EXPECT_TRUE(Delete(done).status.ok());
  ExpectError(Delete(done), grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND", "not found");
}

TEST_F(ApiTest, QueueFullIsResourceExhausted) {
  options_.queue_limit = 1;
  Start();
  const int64_t running = MustSubmit(Spec("a", /*slow=*/true));
  ASSERT_EQ(WaitFor(running, v1::RUNNING).state(), v1::RUNNING);
  // The only device is busy: the next job waits in PENDING and fills the queue.
  const int64_t waiting = MustSubmit(Spec("b"));
  v1::Job job;
  ASSERT_TRUE(Get(waiting, &job).status.ok());
  EXPECT_EQ(job.state(), v1::PENDING);
  ExpectError(Submit(Spec("c"), "", &job), grpc::StatusCode::RESOURCE_EXHAUSTED, "QUEUE_FULL",
              "queue is full");

  // A stream on the waiting job ends with NOT_FOUND once the job is deleted.
  grpc::ClientContext context;
  v1::WatchJobRequest request;
  request.set_id(waiting);
  std::unique_ptr<grpc::ClientReader<v1::Job>> reader = stub_->WatchJob(&context, request);
  ASSERT_TRUE(reader->Read(&job));
  EXPECT_EQ(job.state(), v1::PENDING);
  ASSERT_TRUE(Delete(waiting).status.ok());
  EXPECT_FALSE(reader->Read(&job));
  ExpectError({reader->Finish(), ReasonOf(context)}, grpc::StatusCode::NOT_FOUND, "JOB_NOT_FOUND",
              absl::StrCat("job ", waiting, " was deleted"));

  // That made room: the next job is queued, and a PENDING job cancels at once.
  const int64_t next = MustSubmit(Spec("c"));
  ASSERT_TRUE(Cancel(next, false, &job).status.ok());
  EXPECT_EQ(job.state(), v1::CANCELLED);
  ASSERT_TRUE(Cancel(running, false, &job).status.ok());
  EXPECT_EQ(WaitFor(running, v1::CANCELLED).state(), v1::CANCELLED);
}

TEST_F(ApiTest, ListJobsPagesAndFilters) {
  Start();
  std::vector<int64_t> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(MustSubmit(Spec(absl::StrCat("out", i))));
  v1::ListJobsResponse page;
  ASSERT_TRUE(List(v1::JOB_STATE_UNSPECIFIED, 2, "", &page).status.ok());
  ASSERT_EQ(page.jobs_size(), 2);
  EXPECT_EQ(page.jobs(0).id(), ids[0]);
  EXPECT_EQ(page.jobs(1).id(), ids[1]);
  ASSERT_FALSE(page.next_page_token().empty());
  v1::ListJobsResponse rest;
  ASSERT_TRUE(List(v1::JOB_STATE_UNSPECIFIED, 2, page.next_page_token(), &rest).status.ok());
  ASSERT_EQ(rest.jobs_size(), 1);
  EXPECT_EQ(rest.jobs(0).id(), ids[2]);
  EXPECT_EQ(rest.next_page_token(), "");

  for (const int64_t id : ids) ASSERT_EQ(WaitFor(id, v1::SUCCEEDED).state(), v1::SUCCEEDED);
  v1::ListJobsResponse succeeded;
  ASSERT_TRUE(List(v1::SUCCEEDED, 0, "", &succeeded).status.ok());
  EXPECT_EQ(succeeded.jobs_size(), 3);
  v1::ListJobsResponse failed;
  ASSERT_TRUE(List(v1::FAILED, 0, "", &failed).status.ok());
  EXPECT_EQ(failed.jobs_size(), 0);

  v1::ListJobsResponse r;
  ExpectError(List(v1::JOB_STATE_UNSPECIFIED, 0, "abc", &r), grpc::StatusCode::INVALID_ARGUMENT,
              "INVALID_REQUEST", "page_token: \"abc\" is not a token from ListJobs");
  ExpectError(List(v1::JOB_STATE_UNSPECIFIED, 0, "-1", &r), grpc::StatusCode::INVALID_ARGUMENT,
              "INVALID_REQUEST", "page_token");
  ExpectError(List(v1::JOB_STATE_UNSPECIFIED, 0, " 1", &r), grpc::StatusCode::INVALID_ARGUMENT,
              "INVALID_REQUEST", "page_token");
  ExpectError(List(v1::JOB_STATE_UNSPECIFIED, 1001, "", &r), grpc::StatusCode::INVALID_ARGUMENT,
              "INVALID_REQUEST", "page_size: must be in [0, 1000], got 1001");
  ExpectError(List(v1::JOB_STATE_UNSPECIFIED, -1, "", &r), grpc::StatusCode::INVALID_ARGUMENT,
              "INVALID_REQUEST", "page_size");
  ExpectError(List(static_cast<v1::JobState>(42), 0, "", &r), grpc::StatusCode::INVALID_ARGUMENT,
              "INVALID_REQUEST", "state: unknown value 42");
}

TEST_F(ApiTest, PauseThenResumeFinishes) {
  Start();
  const int64_t id = MustSubmit(Spec("out", /*slow=*/true));
  ASSERT_EQ(WaitFor(id, v1::RUNNING).state(), v1::RUNNING);
  v1::Job job;
  ASSERT_TRUE(Cancel(id, true, &job).status.ok());
  EXPECT_TRUE(job.state() == v1::PAUSED ||
              (job.state() == v1::RUNNING && job.reason() == "pausing"))
      << v1::JobState_Name(job.state()) << " " << job.reason();
  // The stream ends with the PAUSED snapshot.
  const WatchResult paused = Watch(id);
  ASSERT_TRUE(paused.status.ok()) << paused.status.error_message();
  ASSERT_FALSE(paused.jobs.empty());
  EXPECT_EQ(paused.jobs.back().state(), v1::PAUSED);
  // Pausing a PAUSED job returns it unchanged.
  ASSERT_TRUE(Cancel(id, true, &job).status.ok());
  EXPECT_EQ(job.state(), v1::PAUSED);
  ASSERT_TRUE(Resume(id, &job).status.ok());
  EXPECT_EQ(job.state(), v1::PENDING);
  const WatchResult resumed = Watch(id);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  EXPECT_EQ(resumed.jobs.back().state(), v1::SUCCEEDED);
  ExpectVerified("out");
}

TEST_F(ApiTest, FiftyStreamsAndTwoHundredPollersDuringOneJob) {
  Start();
  const int64_t id = MustSubmit(Spec("out", /*slow=*/true));
  std::atomic<int> failed_calls{0};
  std::atomic<int64_t> polls{0};
  std::vector<std::future<WatchResult>> streams;
  for (int i = 0; i < 50; ++i) {
    streams.push_back(std::async(std::launch::async, [this, id] { return Watch(id); }));
  }
  std::vector<std::thread> pollers;
  for (int i = 0; i < 200; ++i) {
    pollers.emplace_back([&] {
      v1::Job job;
      do {
        if (!Get(id, &job).status.ok()) {
          ++failed_calls;
          return;
        }
        ++polls;
      } while (!IsFinal(job.state()));
    });
  }
  for (std::thread& t : pollers) t.join();
  EXPECT_EQ(failed_calls.load(), 0);
  EXPECT_GE(polls.load(), 200);
  int running_seen = 0;
  for (std::future<WatchResult>& f : streams) {
    const WatchResult w = f.get();
    ASSERT_TRUE(w.status.ok()) << w.status.error_message();
    ASSERT_FALSE(w.jobs.empty());
    EXPECT_EQ(w.jobs.back().state(), v1::SUCCEEDED);
    for (size_t i = 1; i < w.jobs.size(); ++i) {
      EXPECT_LE(w.jobs[i - 1].state(), w.jobs[i].state());
    }
    for (const v1::Job& job : w.jobs) running_seen += job.state() == v1::RUNNING;
  }
  EXPECT_GE(running_seen, 50);  // every stream saw the job run
  EXPECT_EQ(scheduler_->board().subscribers(), 0);
}

TEST_F(ApiTest, ShutdownEndsStreamsWithUnavailable) {
  Start();
  const int64_t id = MustSubmit(Spec("out", /*slow=*/true));
  ASSERT_EQ(WaitFor(id, v1::RUNNING).state(), v1::RUNNING);
  std::future<WatchResult> stream =
      std::async(std::launch::async, [this, id] { return Watch(id); });
  while (scheduler_->board().subscribers() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto start = std::chrono::steady_clock::now();
  server_->Shutdown(std::chrono::milliseconds(10'000));
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(5));
  const WatchResult w = stream.get();
  ExpectError({w.status, w.reason}, grpc::StatusCode::UNAVAILABLE, "SHUTTING_DOWN",
              "shutting down");
  ASSERT_FALSE(w.jobs.empty());
  EXPECT_EQ(w.jobs[0].state(), v1::RUNNING);
  EXPECT_EQ(scheduler_->board().subscribers(), 0);
  v1::Job job;
  EXPECT_EQ(Get(id, &job).status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(ApiTest, ClientCancelEndsStreamAndUnsubscribes) {
  Start();
  const int64_t id = MustSubmit(Spec("out", /*slow=*/true));
  grpc::ClientContext context;
  v1::WatchJobRequest request;
  request.set_id(id);
  std::unique_ptr<grpc::ClientReader<v1::Job>> reader = stub_->WatchJob(&context, request);
  v1::Job job;
  ASSERT_TRUE(reader->Read(&job));
  EXPECT_EQ(job.id(), id);
  EXPECT_EQ(scheduler_->board().subscribers(), 1);
  context.TryCancel();
  while (reader->Read(&job)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  const auto until = std::chrono::steady_clock::now() + seconds(10);
  while (scheduler_->board().subscribers() != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(scheduler_->board().subscribers(), 0);
  EXPECT_EQ(WaitFor(id, v1::SUCCEEDED).state(), v1::SUCCEEDED);
}

TEST_F(ApiTest, ListenAddresses) {
  Start();
  const std::string unix_address = server_->bound_addresses()[0];
  EXPECT_EQ(unix_address, "unix:" + dir_ + "/api.sock");

  // A second server: a TCP port next to a unix socket, both reported as bound, in that order.
  const std::string second_unix = "unix:" + dir_ + "/second.sock";
  auto second = ApiServer::Start(Listen({"127.0.0.1:0", second_unix}), scheduler_.get(),
                                 /*metrics=*/nullptr);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ((*second)->bound_addresses().size(), 2u);
  const std::string tcp = (*second)->bound_addresses()[0];
  ASSERT_TRUE(tcp.rfind("127.0.0.1:", 0) == 0) << tcp;
  EXPECT_NE(tcp, "127.0.0.1:0");
  EXPECT_EQ((*second)->bound_addresses()[1], second_unix);
  v1::GetJobRequest request;
  request.set_id(5);
  v1::Job job;
  auto over_unix = v1::QuantService::NewStub(
      grpc::CreateChannel(second_unix, grpc::InsecureChannelCredentials()));
  grpc::ClientContext unix_context;
  EXPECT_EQ(over_unix->GetJob(&unix_context, request, &job).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // Over TCP no one is known without a token (this policy has none).
  auto over_tcp =
      v1::QuantService::NewStub(grpc::CreateChannel(tcp, grpc::InsecureChannelCredentials()));
  grpc::ClientContext tcp_context;
  EXPECT_EQ(over_tcp->GetJob(&tcp_context, request, &job).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);

  auto in_use = ApiServer::Start(Listen({"127.0.0.1:0", tcp}), scheduler_.get(), nullptr);
  EXPECT_EQ(in_use.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(in_use.status().message(),
            absl::StrCat("cannot listen on ", tcp, " (in use, or not a usable address)"));
  auto unix_in_use = ApiServer::Start(Listen({second_unix}), scheduler_.get(), nullptr);
  EXPECT_EQ(unix_in_use.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(unix_in_use.status().message(),
            absl::StrCat("cannot listen on ", second_unix, ": another process accepts on it"));
  (*second)->Shutdown(std::chrono::milliseconds(0));
  second->reset();
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/second.sock"));  // removed at shutdown

  auto malformed = ApiServer::Start(Listen({"localhost"}), scheduler_.get(), nullptr);
  EXPECT_EQ(malformed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(malformed.status().message(),
            "listen address \"localhost\": expected HOST:PORT (PORT 0-65535) or unix:PATH");
  EXPECT_EQ(
      ApiServer::Start(Listen({"127.0.0.1:65536"}), scheduler_.get(), nullptr).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApiServer::Start(Listen({}), scheduler_.get(), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ApiTest, HealthServingAndRpcMetrics) {
  metrics_ = metrics::Metrics::Create("test", false);
  Start();
  grpc::GenericStub generic(channel_);
  // grpc.health.v1.HealthCheckRequest{service} encoded by hand: field 1, length-delimited.
  auto check = [&](const std::string& service, std::string* response_bytes) {
    std::string request_bytes;
    if (!service.empty()) {
      request_bytes = std::string(1, '\x0a') + static_cast<char>(service.size()) + service;
    }
    grpc::Slice slice(request_bytes);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::ClientContext context;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                      &response, [&](grpc::Status s) { done.set_value(s); });
    const grpc::Status status = done.get_future().get();
    std::vector<grpc::Slice> slices;
    if (status.ok()) {
      EXPECT_TRUE(response.Dump(&slices).ok());
      response_bytes->clear();
      for (const grpc::Slice& s : slices) {
        response_bytes->append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    return status;
  };
  std::string serving;
  ASSERT_TRUE(check("", &serving).ok());
  EXPECT_EQ(serving, std::string("\x08\x01", 2));  // status: SERVING
  ASSERT_TRUE(check("quantd.v1.QuantService", &serving).ok());
  EXPECT_EQ(serving, std::string("\x08\x01", 2));
  EXPECT_EQ(check("no.such.Service", &serving).error_code(), grpc::StatusCode::NOT_FOUND);

  v1::Job job;
  EXPECT_EQ(Get(7, &job).status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Get(8, &job).status.error_code(), grpc::StatusCode::NOT_FOUND);
  const int64_t id = MustSubmit(Spec("out"));
  ASSERT_TRUE(Get(id, &job).status.ok());
  const WatchResult w = Watch(id);
  ASSERT_TRUE(w.status.ok());
  const std::string text = metrics_->Exposition();
  for (const char* line : {"quantd_rpc_requests_total{code=\"NOT_FOUND\",method=\"GetJob\"} 2\n",
                           "quantd_rpc_requests_total{code=\"OK\",method=\"SubmitJob\"} 1\n",
                           "quantd_rpc_requests_total{code=\"OK\",method=\"WatchJob\"} 1\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "not in:\n" << text;
  }
}

}  // namespace
}  // namespace quantd::api
