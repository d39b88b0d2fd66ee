// Metrics: exact exposition lines for every family, the HTTP exposer, address errors, and
// promtool's lint over a full exposition.
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server/pipeline/stage_registry.h"
#include "tests/unit/test_dirs.h"

namespace quantd::metrics {
namespace {

const char* const kJobStates[] = {"PENDING",   "RUNNING", "PAUSED",
                                  "SUCCEEDED", "FAILED",  "CANCELLED"};
const char* const kTaskStates[] = {"PENDING", "LEASED", "DONE", "FAILED"};
const char* const kOutcomes[] = {"done", "failed", "retried", "interrupted"};

// The exposition's lines, so that a test can ask for one exact line.
std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

bool HasLine(const std::string& text, const std::string& line) {
  for (const std::string& l : Lines(text)) {
    if (l == line) return true;
  }
  return false;
}

// The lines that start with `prefix` (a family's samples).
std::vector<std::string> LinesWithPrefix(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  for (const std::string& l : Lines(text)) {
    if (l.rfind(prefix, 0) == 0) out.push_back(l);
  }
  return out;
}

// GET http://<address><path> over a plain socket; returns the whole response (status line,
// headers, body) or "" when the connection fails.
std::string HttpGet(const std::string& address, const std::string& path) {
  const size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  if (inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr) != 1) return "";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request =
        absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: ", address, "\r\nConnection: close\r\n\r\n");
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, n);
    }
  }
  close(fd);
  return response;
}

TEST(MetricsTest, FixedSeriesExistAtZeroBeforeAnyEvent) {
  const auto m = Metrics::Create("1.2.3", false);
  EXPECT_TRUE(LinesWithPrefix(m->Exposition(), "quantd_tasks{").empty());
  const std::vector<std::string> stages = pipeline::BuiltinStages().kinds();
  m->DeclareStages(stages);
  m->DeclareStages(stages);  // idempotent
  const std::string text = m->Exposition();
  EXPECT_TRUE(HasLine(text, "quantd_build_info{cuda=\"false\",version=\"1.2.3\"} 1")) << text;
  EXPECT_TRUE(HasLine(text, "# TYPE quantd_build_info gauge"));
  EXPECT_TRUE(HasLine(text, "quantd_queue_depth 0"));
  EXPECT_TRUE(HasLine(text, "quantd_read_bytes_total 0"));
  EXPECT_TRUE(HasLine(text, "quantd_written_bytes_total 0"));
  EXPECT_TRUE(HasLine(text, "quantd_calibrated_tokens_total 0"));
  EXPECT_TRUE(HasLine(text, "quantd_evaluated_tokens_total 0"));
  EXPECT_TRUE(HasLine(text, "quantd_calibration_layer_seconds_count 0"));
  for (const char* state : kJobStates) {
    EXPECT_TRUE(HasLine(text, absl::StrCat("quantd_jobs{state=\"", state, "\"} 0"))) << state;
  }
  EXPECT_EQ(LinesWithPrefix(text, "quantd_jobs{").size(), 6u);
  for (const std::string& stage : stages) {
    for (const char* state : kTaskStates) {
      EXPECT_TRUE(HasLine(
          text, absl::StrCat("quantd_tasks{stage=\"", stage, "\",state=\"", state, "\"} 0")));
    }
    for (const char* outcome : kOutcomes) {
      EXPECT_TRUE(HasLine(text, absl::StrCat("quantd_task_attempts_total{outcome=\"", outcome,
                                             "\",stage=\"", stage, "\"} 0")));
    }
    EXPECT_TRUE(HasLine(
        text, absl::StrCat("quantd_stage_duration_seconds_count{stage=\"", stage, "\"} 0")));
    EXPECT_TRUE(HasLine(text, absl::StrCat("quantd_stage_duration_seconds_bucket{stage=\"", stage,
                                           "\",le=\"+Inf\"} 0")));
  }
  EXPECT_EQ(LinesWithPrefix(text, "quantd_tasks{").size(), stages.size() * 4);
  EXPECT_EQ(LinesWithPrefix(text, "quantd_task_attempts_total{").size(), stages.size() * 4);
  // 13 finite buckets and +Inf per stage.
  EXPECT_EQ(LinesWithPrefix(text, "quantd_stage_duration_seconds_bucket{").size(),
            stages.size() * 14);
  // Open label sets have no series until their first event.
  EXPECT_TRUE(LinesWithPrefix(text, "quantd_device_").empty());
  EXPECT_TRUE(LinesWithPrefix(text, "quantd_task_retries_total").empty());
  EXPECT_TRUE(LinesWithPrefix(text, "quantd_job_failures_total").empty());
  EXPECT_TRUE(LinesWithPrefix(text, "quantd_rpc_requests_total").empty());
  EXPECT_EQ(LinesWithPrefix(text, "quantd_process_start_time_seconds ").size(), 1u);
  EXPECT_EQ(m->listen_address(), "");
}

TEST(MetricsTest, BuildInfoNamesCuda) {
  EXPECT_TRUE(HasLine(Metrics::Create("0.9.0", true)->Exposition(),
                      "quantd_build_info{cuda=\"true\",version=\"0.9.0\"} 1"));
}

TEST(MetricsTest, SetJobCountsReplacesEveryState) {
  const auto m = Metrics::Create("1", false);
  m->SetJobCounts({{"PENDING", 5}, {"FAILED", 1}});
  m->SetJobCounts({{"RUNNING", 2}});
  const std::string text = m->Exposition();
  EXPECT_TRUE(HasLine(text, "quantd_jobs{state=\"RUNNING\"} 2")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_jobs{state=\"PENDING\"} 0"));
  EXPECT_TRUE(HasLine(text, "quantd_jobs{state=\"FAILED\"} 0"));
  m->SetQueueDepth(7);
  EXPECT_TRUE(HasLine(m->Exposition(), "quantd_queue_depth 7"));
  m->SetQueueDepth(0);
  EXPECT_TRUE(HasLine(m->Exposition(), "quantd_queue_depth 0"));
}

TEST(MetricsTest, SchedulerHeartbeatIsTheLastSetJobCounts) {
  const absl::Time before = absl::Now();
  const auto m = Metrics::Create("1", false);
  const absl::Time created = m->scheduler_heartbeat();
  EXPECT_GE(created, before);
  const auto seconds = [&m] {
    const std::vector<std::string> lines =
        LinesWithPrefix(m->Exposition(), "quantd_scheduler_heartbeat_timestamp_seconds ");
    EXPECT_EQ(lines.size(), 1u);
    return lines.empty() ? 0.0 : std::stod(lines[0].substr(lines[0].find(' ') + 1));
  };
  // Until the first refresh: the creation time, which is also the start time.
  const std::vector<std::string> start =
      LinesWithPrefix(m->Exposition(), "quantd_process_start_time_seconds ");
  ASSERT_EQ(start.size(), 1u);
  EXPECT_EQ(seconds(), std::stod(start[0].substr(start[0].find(' ') + 1)));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  m->SetQueueDepth(1);  // other setters are no heartbeat
  EXPECT_EQ(m->scheduler_heartbeat(), created);
  m->SetJobCounts({});
  const absl::Time refreshed = m->scheduler_heartbeat();
  EXPECT_GE(refreshed - created, absl::Milliseconds(20));
  // The exposition prints 16 significant digits: the microsecond survives.
  EXPECT_NEAR(seconds(), absl::ToDoubleSeconds(refreshed - absl::UnixEpoch()), 2e-6);
}

TEST(MetricsTest, DiskSpaceSeriesAreSetAndCleared) {
  const auto m = Metrics::Create("1", false);
  EXPECT_TRUE(LinesWithPrefix(m->Exposition(), "quantd_disk_").empty());
  m->ClearDiskSpace("output");  // nothing to clear
  m->SetDiskSpace("state", 1000, 4000);
  m->SetDiskSpace("output", 5, 10);
  m->SetDiskSpace("output", 6, 12);
  std::string text = m->Exposition();
  EXPECT_TRUE(HasLine(text, "quantd_disk_free_bytes{dir=\"state\"} 1000")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_disk_size_bytes{dir=\"state\"} 4000"));
  EXPECT_TRUE(HasLine(text, "quantd_disk_free_bytes{dir=\"output\"} 6"));
  EXPECT_TRUE(HasLine(text, "quantd_disk_size_bytes{dir=\"output\"} 12"));
  m->ClearDiskSpace("output");
  text = m->Exposition();
  EXPECT_EQ(LinesWithPrefix(text, "quantd_disk_free_bytes{").size(), 1u) << text;
  EXPECT_EQ(LinesWithPrefix(text, "quantd_disk_size_bytes{").size(), 1u) << text;
  EXPECT_TRUE(HasLine(text, "quantd_disk_free_bytes{dir=\"state\"} 1000"));
}

TEST(MetricsTest, SetTaskCountsReplacesEveryPair) {
  const auto m = Metrics::Create("1", false);
  m->SetTaskCounts(
      {{{"quantize", "PENDING"}, 40}, {{"quantize", "LEASED"}, 2}, {{"verify", "PENDING"}, 4}});
  std::string text = m->Exposition();
  EXPECT_TRUE(HasLine(text, "quantd_tasks{stage=\"quantize\",state=\"PENDING\"} 40")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_tasks{stage=\"quantize\",state=\"LEASED\"} 2"));
  EXPECT_TRUE(HasLine(text, "quantd_tasks{stage=\"verify\",state=\"PENDING\"} 4"));
  m->SetTaskCounts({{{"quantize", "DONE"}, 42}});
  text = m->Exposition();
  EXPECT_TRUE(HasLine(text, "quantd_tasks{stage=\"quantize\",state=\"DONE\"} 42"));
  EXPECT_TRUE(HasLine(text, "quantd_tasks{stage=\"quantize\",state=\"PENDING\"} 0"));
  EXPECT_TRUE(HasLine(text, "quantd_tasks{stage=\"quantize\",state=\"LEASED\"} 0"));
  EXPECT_TRUE(HasLine(text, "quantd_tasks{stage=\"verify\",state=\"PENDING\"} 0"));
  m->SetTaskCounts({});
  EXPECT_TRUE(HasLine(m->Exposition(), "quantd_tasks{stage=\"quantize\",state=\"DONE\"} 0"));
}

TEST(MetricsTest, CountersAddUpExactly) {
  const auto m = Metrics::Create("1", false);
  m->DeclareStages(pipeline::BuiltinStages().kinds());
  m->AddBytesRead(3);
  m->AddBytesRead(uint64_t{1} << 40);
  m->AddBytesWritten(4096);
  m->AddBytesWritten(512);
  m->AddTaskFigure("quantd_calibrated_tokens_total", 1536);
  m->AddTaskFigure("quantd_calibration_layer_seconds", 0.25);
  m->AddTaskFigure("quantd_calibrated_tokens_total", 512);
  m->AddTaskFigure("quantd_calibration_layer_seconds", 2);
  m->AddTaskFigure("quantd_no_such_metric", 7);
  for (int i = 0; i < 3; ++i) m->TaskAttempt("quantize", "done");
  m->TaskAttempt("quantize", "retried");
  m->TaskAttempt("export", "interrupted");
  m->TaskRetried("UNAVAILABLE");
  m->TaskRetried("UNAVAILABLE");
  m->TaskRetried("RESOURCE_EXHAUSTED");
  m->JobFailed("corrupt input");
  m->RpcHandled("GetJob", "OK");
  m->RpcHandled("GetJob", "OK");
  m->RpcHandled("GetJob", "NOT_FOUND");
  m->AddDeviceBusy("cuda:0", 0.25);
  m->AddDeviceBusy("cuda:0", 0.5);
  m->AddDeviceBusy("cpu:1", 2);
  m->SetDeviceBusyRatio("cuda:0", 0.75);
  m->SetDeviceBusyRatio("cuda:0", 0.5);
  m->SetDeviceMemoryUsed("cuda:0", int64_t{80} << 30);
  const std::string text = m->Exposition();
  EXPECT_TRUE(HasLine(text, "quantd_calibrated_tokens_total 2048")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_calibration_layer_seconds_count 2")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_calibration_layer_seconds_sum 2.25")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_read_bytes_total 1099511627779")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_written_bytes_total 4608"));
  EXPECT_TRUE(HasLine(text, "quantd_task_attempts_total{outcome=\"done\",stage=\"quantize\"} 3"));
  EXPECT_TRUE(
      HasLine(text, "quantd_task_attempts_total{outcome=\"retried\",stage=\"quantize\"} 1"));
  EXPECT_TRUE(
      HasLine(text, "quantd_task_attempts_total{outcome=\"interrupted\",stage=\"export\"} 1"));
  EXPECT_TRUE(HasLine(text, "quantd_task_attempts_total{outcome=\"done\",stage=\"export\"} 0"));
  EXPECT_TRUE(HasLine(text, "quantd_task_retries_total{reason=\"UNAVAILABLE\"} 2"));
  EXPECT_TRUE(HasLine(text, "quantd_task_retries_total{reason=\"RESOURCE_EXHAUSTED\"} 1"));
  EXPECT_TRUE(HasLine(text, "quantd_job_failures_total{reason=\"corrupt input\"} 1"));
  EXPECT_TRUE(HasLine(text, "quantd_rpc_requests_total{code=\"OK\",method=\"GetJob\"} 2"));
  EXPECT_TRUE(HasLine(text, "quantd_rpc_requests_total{code=\"NOT_FOUND\",method=\"GetJob\"} 1"));
  EXPECT_TRUE(HasLine(text, "quantd_device_busy_seconds_total{device=\"cuda:0\"} 0.75"));
  EXPECT_TRUE(HasLine(text, "quantd_device_busy_seconds_total{device=\"cpu:1\"} 2"));
  EXPECT_TRUE(HasLine(text, "quantd_device_busy_ratio{device=\"cuda:0\"} 0.5"));
  EXPECT_TRUE(HasLine(text, "quantd_device_memory_used_bytes{device=\"cuda:0\"} 85899345920"));
}

TEST(MetricsTest, StageDurationBuckets) {
  const auto m = Metrics::Create("1", false);
  m->DeclareStages(pipeline::BuiltinStages().kinds());
  // Binary-exact values, so that the sum is exact; 0.5 sits on a bound (le is inclusive).
  for (double s : {0.0625, 0.5, 3.0, 50000.0}) m->ObserveStageDuration("quantize", s);
  const std::string text = m->Exposition();
  const std::pair<const char*, int> expected[] = {
      {"0.1", 1}, {"0.5", 2},  {"1", 2},    {"5", 3},    {"15", 3},    {"60", 3},    {"300", 3},
      {"900", 3}, {"1800", 3}, {"3600", 3}, {"7200", 3}, {"14400", 3}, {"43200", 3}, {"+Inf", 4}};
  for (const auto& [le, count] : expected) {
    const std::string line = absl::StrCat(
        "quantd_stage_duration_seconds_bucket{stage=\"quantize\",le=\"", le, "\"} ", count);
    EXPECT_TRUE(HasLine(text, line)) << line << "\n" << text;
  }
  EXPECT_TRUE(HasLine(text, "quantd_stage_duration_seconds_count{stage=\"quantize\"} 4"));
  EXPECT_TRUE(HasLine(text, "quantd_stage_duration_seconds_sum{stage=\"quantize\"} 50003.5625"));
  EXPECT_TRUE(HasLine(text, "quantd_stage_duration_seconds_count{stage=\"verify\"} 0"));
}

TEST(MetricsTest, ConcurrentUpdatesAreNotLost) {
  const auto m = Metrics::Create("1", false);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&m, t] {
      const std::string device = absl::StrCat("cpu:", t % 2);
      for (int i = 0; i < 5000; ++i) {
        m->TaskAttempt("dequant", "done");
        m->AddDeviceBusy(device, 1);
        m->RpcHandled("GetJob", "OK");
        m->SetJobCounts({{"RUNNING", t}});
        m->SetTaskCounts({{{"dequant", "LEASED"}, t}});
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const std::string text = m->Exposition();
  EXPECT_TRUE(
      HasLine(text, "quantd_task_attempts_total{outcome=\"done\",stage=\"dequant\"} 20000"));
  EXPECT_TRUE(HasLine(text, "quantd_device_busy_seconds_total{device=\"cpu:0\"} 10000"));
  EXPECT_TRUE(HasLine(text, "quantd_device_busy_seconds_total{device=\"cpu:1\"} 10000"));
  EXPECT_TRUE(HasLine(text, "quantd_rpc_requests_total{code=\"OK\",method=\"GetJob\"} 20000"));
  EXPECT_EQ(LinesWithPrefix(text, "quantd_jobs{").size(), 6u);
}

TEST(MetricsTest, ServesMetricsOverHttp) {
  absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Serve("127.0.0.1:0", "1.2.3", false);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string address = (*m)->listen_address();
  ASSERT_EQ(address.rfind("127.0.0.1:", 0), 0u) << address;
  const int port = std::stoi(address.substr(10));
  EXPECT_GT(port, 0);
  EXPECT_LE(port, 65535);
  (*m)->SetJobCounts({{"RUNNING", 2}});
  (*m)->RpcHandled("SubmitJob", "OK");
  const std::string response = HttpGet(address, "/metrics");
  ASSERT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << response;
  const size_t body_at = response.find("\r\n\r\n");
  ASSERT_NE(body_at, std::string::npos);
  const std::string body = response.substr(body_at + 4);
  // Every line of the exposition is served, the process start time included.
  for (const std::string& line : Lines((*m)->Exposition())) {
    EXPECT_TRUE(HasLine(body, line)) << line;
  }
  EXPECT_TRUE(HasLine(body, "quantd_jobs{state=\"RUNNING\"} 2"));
  EXPECT_TRUE(HasLine(body, "quantd_rpc_requests_total{code=\"OK\",method=\"SubmitJob\"} 1"));
}

TEST(MetricsTest, MalformedAddressIsInvalidArgument) {
  for (const std::string address :
       {"", "9464", "127.0.0.1", "127.0.0.1:", ":9464", "127.0.0.1:65536", "127.0.0.1:-1",
        "127.0.0.1:94a4", "127.0.0.1:123456", "::1:9464", "127.0.0.1:1,127.0.0.1:2",
        "127.0.0.1 :9464"}) {
    const absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Serve(address, "1", false);
    ASSERT_FALSE(m.ok()) << address;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
    EXPECT_NE(m.status().message().find(absl::StrCat("\"", address, "\"")), std::string::npos)
        << m.status();
  }
}

TEST(MetricsTest, AddressInUseIsUnavailable) {
  // A plain listening socket holds a port.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string taken = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Serve(taken, "1", false);
  close(fd);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable) << m.status();
  EXPECT_NE(m.status().message().find(taken), std::string::npos) << m.status();

  // So does another exposer.
  absl::StatusOr<std::unique_ptr<Metrics>> first = Metrics::Serve("127.0.0.1:0", "1", false);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->listen_address();
  m = Metrics::Serve(address, "1", false);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable) << m.status();
  EXPECT_NE(m.status().message().find(address), std::string::npos) << m.status();
  // The first one still serves.
  EXPECT_EQ(HttpGet(address, "/metrics").rfind("HTTP/1.1 200 OK\r\n", 0), 0u);
}

TEST(MetricsTest, PromtoolAcceptsEveryFamily) {
  const char* const promtool = "/usr/bin/promtool";
  if (access(promtool, X_OK) != 0) GTEST_SKIP() << promtool << " is missing";
  const auto m = Metrics::Create("1.2.3", true);
  m->SetJobCounts({{"RUNNING", 1}, {"PENDING", 3}});
  m->SetQueueDepth(3);
  m->SetTaskCounts({{{"quantize", "LEASED"}, 1}});
  m->TaskAttempt("quantize", "retried");
  m->AddBytesRead(100);
  m->AddBytesWritten(50);
  m->ObserveStageDuration("inspect", 0.2);
  m->AddDeviceBusy("cuda:0", 1.5);
  m->SetDeviceBusyRatio("cuda:0", 0.25);
  m->SetDeviceMemoryUsed("cuda:0", 1 << 20);
  m->TaskRetried("UNAVAILABLE");
  m->JobFailed("corrupt input");
  m->AddTaskFigure("quantd_calibrated_tokens_total", 8);
  m->AddTaskFigure("quantd_calibration_layer_seconds", 0.5);
  m->AddTaskFigure("quantd_evaluated_tokens_total", 8);
  m->RpcHandled("WatchJob", "CANCELLED");
  m->SetDiskSpace("state", 1 << 30, 1LL << 40);
  m->SetWorkersConnected(2);
  m->WorkerTaskLeased("node-07");
  m->LeaseExpired();
  m->StaleWorkerCall("complete");
  const std::string text = m->Exposition();
  // Every family of the header has samples now.
  for (const char* family :
       {"quantd_build_info", "quantd_jobs", "quantd_queue_depth", "quantd_tasks",
        "quantd_task_attempts_total", "quantd_read_bytes_total", "quantd_written_bytes_total",
        "quantd_stage_duration_seconds", "quantd_device_busy_seconds_total",
        "quantd_device_busy_ratio", "quantd_device_memory_used_bytes", "quantd_task_retries_total",
        "quantd_job_failures_total", "quantd_calibrated_tokens_total",
        "quantd_calibration_layer_seconds", "quantd_evaluated_tokens_total",
        "quantd_rpc_requests_total", "quantd_process_start_time_seconds",
        "quantd_scheduler_heartbeat_timestamp_seconds", "quantd_disk_free_bytes",
        "quantd_disk_size_bytes", "quantd_workers_connected", "quantd_worker_tasks_leased_total",
        "quantd_lease_expiries_total", "quantd_worker_stale_calls_total"}) {
    EXPECT_TRUE(HasLine(text, absl::StrCat("# TYPE ", family, " ", "counter")) ||
                HasLine(text, absl::StrCat("# TYPE ", family, " ", "gauge")) ||
                HasLine(text, absl::StrCat("# TYPE ", family, " ", "histogram")))
        << family;
  }
  const std::string path = testing_util::TestDir("exposition");
  std::ofstream(path) << text;
  FILE* pipe = popen(absl::StrCat(promtool, " check metrics < ", path, " 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[512];
  while (fgets(buf, sizeof(buf), pipe) != nullptr) output += buf;
  const int status = pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << output;
  // promtool prints one line per lint problem and nothing when the exposition is clean.
  EXPECT_EQ(output, "");
}

}  // namespace

TEST(MetricsTest, RemoteWorkerMetricsCountWhatTheSchedulerReports) {
  std::unique_ptr<Metrics> m = Metrics::Create("9.9.9", false);
  std::string text = m->Exposition();
  // The refused calls exist at 0 before the first one.
  for (const char* call : {"renew", "complete", "fail"}) {
    EXPECT_TRUE(HasLine(text, absl::StrCat("quantd_worker_stale_calls_total{call=\"", call,
                                           "\"} 0")))
        << text;
  }
  EXPECT_TRUE(HasLine(text, "quantd_workers_connected 0")) << text;
  m->SetWorkersConnected(3);
  m->WorkerTaskLeased("w1");
  m->WorkerTaskLeased("w1");
  m->WorkerTaskLeased("w2");
  m->LeaseExpired();
  m->StaleWorkerCall("complete");
  m->StaleWorkerCall("complete");
  text = m->Exposition();
  EXPECT_TRUE(HasLine(text, "quantd_workers_connected 3")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_worker_tasks_leased_total{worker=\"w1\"} 2")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_worker_tasks_leased_total{worker=\"w2\"} 1")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_lease_expiries_total 1")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_worker_stale_calls_total{call=\"complete\"} 2")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_worker_stale_calls_total{call=\"renew\"} 0")) << text;
}

// Worker names are free-form: the first 64 get series of their own, the later ones share
// "other", so a token that registers name after name cannot grow the scrape without bound.
TEST(MetricsTest, TasksLeasedHasAtMost64WorkerSeriesAndOther) {
  std::unique_ptr<Metrics> m = Metrics::Create("9.9.9", false);
  for (int i = 0; i < 100; ++i) m->WorkerTaskLeased(absl::StrCat("w", i));
  m->WorkerTaskLeased("w0");
  m->WorkerTaskLeased("w99");
  const std::string text = m->Exposition();
  int series = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    series += absl::StartsWith(line, "quantd_worker_tasks_leased_total{");
  }
  EXPECT_EQ(series, 65) << text;
  EXPECT_TRUE(HasLine(text, "quantd_worker_tasks_leased_total{worker=\"w0\"} 2")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_worker_tasks_leased_total{worker=\"w63\"} 1")) << text;
  EXPECT_TRUE(HasLine(text, "quantd_worker_tasks_leased_total{worker=\"other\"} 37")) << text;
  EXPECT_EQ(text.find("worker=\"w64\""), std::string::npos) << text;
}

}  // namespace quantd::metrics
