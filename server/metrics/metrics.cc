#include "server/metrics/metrics.h"

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/base/status_macros.h"
#include "server/metrics/http_server.h"

namespace quantd::metrics {
namespace {

// Worker names that get a quantd_worker_tasks_leased_total series of their own (metrics.h).
constexpr size_t kMaxWorkerSeries = 64;

// The fixed label sets whose series exist (at 0) from the start.
const char* const kJobStates[] = {"PENDING",   "RUNNING", "PAUSED",
                                  "SUCCEEDED", "FAILED",  "CANCELLED"};
const char* const kTaskStates[] = {"PENDING", "LEASED", "DONE", "FAILED"};
const char* const kOutcomes[] = {"done", "failed", "retried", "interrupted"};

// Stage runs take from a fraction of a second (inspect) to hours (a 1.6 TB quantize).
const prometheus::Histogram::BucketBoundaries& StageBuckets() {
  static const prometheus::Histogram::BucketBoundaries buckets = {
      0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 14400, 43200};
  return buckets;
}

// Checks that `listen` is "host:port" with a non-empty host ("[v6]" bracketed) and a decimal port
// in 0..65535 (0 = let the system pick).
absl::Status ValidateListen(const std::string& listen) {
  const auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen address \"", listen, "\": ", why, " (want host:port)"));
  };
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return bad("no port");
  const std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.empty()) return bad("empty host");
  for (char c : host) {
    // ',' (a list separator where addresses are listed) and whitespace are never part of a host.
    if (c == ',' || absl::ascii_isspace(static_cast<unsigned char>(c))) {
      return bad("bad character in host");
    }
  }
  const bool bracketed = host.front() == '[' && host.back() == ']' && host.size() > 2;
  if (!bracketed && host.find_first_of("[]:") != std::string::npos) {
    return bad("IPv6 hosts must be written [addr]");
  }
  if (port.empty() || port.size() > 5) return bad("port is not a number in 0..65535");
  for (char c : port) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      return bad("port is not a number in 0..65535");
    }
  }
  int value = 0;
  if (!absl::SimpleAtoi(port, &value) || value > 65535) {
    return bad("port is not a number in 0..65535");
  }
  return absl::OkStatus();
}

class PrometheusMetrics final : public Metrics {
 public:
  PrometheusMetrics(const std::string& version, bool cuda)
      : registry_(std::make_shared<prometheus::Registry>()),
        build_info_(prometheus::BuildGauge()
                        .Name("quantd_build_info")
                        .Help("Build of the running quantd; always 1.")
                        .Register(*registry_)),
        start_time_(prometheus::BuildGauge()
                        .Name("quantd_process_start_time_seconds")
                        .Help("Unix time at which the daemon started.")
                        .Register(*registry_)),
        jobs_(prometheus::BuildGauge()
                  .Name("quantd_jobs")
                  .Help("Jobs in each state.")
                  .Register(*registry_)),
        queue_depth_(prometheus::BuildGauge()
                         .Name("quantd_queue_depth")
                         .Help("PENDING jobs waiting for devices.")
                         .Register(*registry_)),
        tasks_(prometheus::BuildGauge()
                   .Name("quantd_tasks")
                   .Help("Tasks of unfinished jobs by stage and task state.")
                   .Register(*registry_)),
        attempts_(prometheus::BuildCounter()
                      .Name("quantd_task_attempts_total")
                      .Help("Task attempts by stage and outcome (done, failed, retried, "
                            "interrupted).")
                      .Register(*registry_)),
        read_bytes_(prometheus::BuildCounter()
                        .Name("quantd_read_bytes_total")
                        .Help("Source checkpoint bytes processed.")
                        .Register(*registry_)),
        written_bytes_(prometheus::BuildCounter()
                           .Name("quantd_written_bytes_total")
                           .Help("Output checkpoint bytes written.")
                           .Register(*registry_)),
        stage_duration_(prometheus::BuildHistogram()
                            .Name("quantd_stage_duration_seconds")
                            .Help("Duration of a stage's run, from its start to its success.")
                            .Register(*registry_)),
        device_busy_(prometheus::BuildCounter()
                         .Name("quantd_device_busy_seconds_total")
                         .Help("Time a device's worker spent running tasks.")
                         .Register(*registry_)),
        device_busy_ratio_(prometheus::BuildGauge()
                               .Name("quantd_device_busy_ratio")
                               .Help("Share of the last minute a device's worker was busy.")
                               .Register(*registry_)),
        device_memory_(prometheus::BuildGauge()
                           .Name("quantd_device_memory_used_bytes")
                           .Help("Memory in use on a device.")
                           .Register(*registry_)),
        retries_(prometheus::BuildCounter()
                     .Name("quantd_task_retries_total")
                     .Help("Task retries by the status code of the transient error.")
                     .Register(*registry_)),
        job_failures_(prometheus::BuildCounter()
                          .Name("quantd_job_failures_total")
                          .Help("Jobs that ended FAILED, by reason.")
                          .Register(*registry_)),
        calibrated_tokens_(prometheus::BuildCounter()
                               .Name("quantd_calibrated_tokens_total")
                               .Help("Token rows calibrate tasks moved through a decoder layer.")
                               .Register(*registry_)),
        calibration_layer_(prometheus::BuildHistogram()
                               .Name("quantd_calibration_layer_seconds")
                               .Help("Duration of one calibrate task: a decoder layer over one "
                                     "slice of the calibration samples.")
                               .Register(*registry_)),
        evaluated_tokens_(prometheus::BuildCounter()
                              .Name("quantd_evaluated_tokens_total")
                              .Help("Token rows evaluate tasks moved through a decoder layer or "
                                    "the head of both models.")
                              .Register(*registry_)),
        rpcs_(prometheus::BuildCounter()
                  .Name("quantd_rpc_requests_total")
                  .Help("RPCs handled by method and gRPC status code.")
                  .Register(*registry_)),
        heartbeat_(prometheus::BuildGauge()
                       .Name("quantd_scheduler_heartbeat_timestamp_seconds")
                       .Help("Unix time of the scheduler's last refresh of the job counts.")
                       .Register(*registry_)),
        disk_free_(prometheus::BuildGauge()
                       .Name("quantd_disk_free_bytes")
                       .Help("Bytes available on the file system under the state dir or the "
                             "unfinished jobs' outputs.")
                       .Register(*registry_)),
        disk_size_(prometheus::BuildGauge()
                       .Name("quantd_disk_size_bytes")
                       .Help("Size of the file system under the state dir or the unfinished "
                             "jobs' outputs.")
                       .Register(*registry_)),
        workers_connected_(prometheus::BuildGauge()
                               .Name("quantd_workers_connected")
                               .Help("Remote workers registered with this daemon.")
                               .Register(*registry_)),
        worker_tasks_leased_(prometheus::BuildCounter()
                                 .Name("quantd_worker_tasks_leased_total")
                                 .Help("Tasks leased to a remote worker, by its name (the "
                                       "first 64 names; later ones as \"other\").")
                                 .Register(*registry_)),
        lease_expiries_(prometheus::BuildCounter()
                            .Name("quantd_lease_expiries_total")
                            .Help("Task leases lost because the task reported nothing for a "
                                  "whole lease.")
                            .Register(*registry_)),
        stale_calls_(prometheus::BuildCounter()
                         .Name("quantd_worker_stale_calls_total")
                         .Help("Renewals, completions and failures of an attempt that had lost "
                               "its lease, refused.")
                         .Register(*registry_)),
        read_bytes_total_(read_bytes_.Add({})),
        written_bytes_total_(written_bytes_.Add({})),
        calibrated_tokens_total_(calibrated_tokens_.Add({})),
        calibration_layer_seconds_(calibration_layer_.Add({}, StageBuckets())),
        evaluated_tokens_total_(evaluated_tokens_.Add({})),
        queue_depth_value_(queue_depth_.Add({})),
        heartbeat_value_(heartbeat_.Add({})),
        workers_connected_value_(workers_connected_.Add({})),
        lease_expiries_total_(lease_expiries_.Add({})),
        heartbeat_time_(absl::Now()) {
    build_info_.Add({{"version", version}, {"cuda", cuda ? "true" : "false"}}).Set(1);
    start_time_.Add({}).Set(absl::ToDoubleSeconds(heartbeat_time_ - absl::UnixEpoch()));
    heartbeat_value_.Set(absl::ToDoubleSeconds(heartbeat_time_ - absl::UnixEpoch()));
    for (const char* state : kJobStates) job_series_[state] = &jobs_.Add({{"state", state}});
    for (const char* call : {"renew", "complete", "fail"}) stale_calls_.Add({{"call", call}});
  }

  // Starts the HTTP server (http_server.h) on `listen` and records the address it bound.
  absl::Status Listen(const std::string& listen) {
    if (absl::Status status = ValidateListen(listen); !status.ok()) return status;
    const size_t colon = listen.rfind(':');
    const std::string host = listen.substr(0, colon);
    int port = 0;
    if (!absl::SimpleAtoi(listen.substr(colon + 1), &port)) {
      return absl::InvalidArgumentError(absl::StrCat("metrics listen address \"", listen, "\""));
    }
    ASSIGN_OR_RETURN(server_,
                     MetricsHttpServer::Start(host, port, [this] { return Exposition(); }));
    listen_address_ = absl::StrCat(host, ":", server_->port());
    return absl::OkStatus();
  }

  void SetJobCounts(const std::map<std::string, int64_t>& by_state) override {
    absl::MutexLock lock(&mu_);
    for (const auto& [state, n] : by_state) {
      if (job_series_.count(state) == 0) job_series_[state] = &jobs_.Add({{"state", state}});
    }
    for (const auto& [state, gauge] : job_series_) {
      const auto it = by_state.find(state);
      gauge->Set(it == by_state.end() ? 0 : static_cast<double>(it->second));
    }
    heartbeat_time_ = absl::Now();
    heartbeat_value_.Set(absl::ToDoubleSeconds(heartbeat_time_ - absl::UnixEpoch()));
  }

  void DeclareStages(const std::vector<std::string>& kinds) override {
    absl::MutexLock lock(&mu_);
    for (const std::string& stage : kinds) {
      for (const char* state : kTaskStates) {
        if (task_series_.count({stage, state}) == 0) {
          task_series_[{stage, state}] = &tasks_.Add({{"stage", stage}, {"state", state}});
        }
      }
      for (const char* outcome : kOutcomes) attempts_.Add({{"stage", stage}, {"outcome", outcome}});
      stage_duration_.Add({{"stage", stage}}, StageBuckets());
    }
  }

  void SetQueueDepth(int64_t pending) override {
    queue_depth_value_.Set(static_cast<double>(pending));
  }

  void SetTaskCounts(const std::map<std::pair<std::string, std::string>, int64_t>& n) override {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, count] : n) {
      if (task_series_.count(key) == 0) {
        task_series_[key] = &tasks_.Add({{"stage", key.first}, {"state", key.second}});
      }
    }
    for (const auto& [key, gauge] : task_series_) {
      const auto it = n.find(key);
      gauge->Set(it == n.end() ? 0 : static_cast<double>(it->second));
    }
  }

  // Family::Add returns the existing series for known labels and is itself thread-safe.
  void TaskAttempt(const std::string& stage, const std::string& outcome) override {
    attempts_.Add({{"stage", stage}, {"outcome", outcome}}).Increment();
  }

  void AddBytesRead(uint64_t n) override { read_bytes_total_.Increment(static_cast<double>(n)); }

  void AddBytesWritten(uint64_t n) override {
    written_bytes_total_.Increment(static_cast<double>(n));
  }

  void ObserveStageDuration(const std::string& stage, double seconds) override {
    stage_duration_.Add({{"stage", stage}}, StageBuckets()).Observe(seconds);
  }

  void AddDeviceBusy(const std::string& device, double seconds) override {
    device_busy_.Add({{"device", device}}).Increment(seconds);
  }

  void SetDeviceBusyRatio(const std::string& device, double ratio) override {
    device_busy_ratio_.Add({{"device", device}}).Set(ratio);
  }

  void SetDeviceMemoryUsed(const std::string& device, int64_t bytes) override {
    device_memory_.Add({{"device", device}}).Set(static_cast<double>(bytes));
  }

  void TaskRetried(const std::string& reason) override {
    retries_.Add({{"reason", reason}}).Increment();
  }

  void JobFailed(const std::string& reason) override {
    job_failures_.Add({{"reason", reason}}).Increment();
  }

  void AddTaskFigure(const std::string& metric, double value) override {
    if (metric == "quantd_calibrated_tokens_total") calibrated_tokens_total_.Increment(value);
    if (metric == "quantd_calibration_layer_seconds") calibration_layer_seconds_.Observe(value);
    if (metric == "quantd_evaluated_tokens_total") evaluated_tokens_total_.Increment(value);
  }

  void RpcHandled(const std::string& method, const std::string& code) override {
    rpcs_.Add({{"method", method}, {"code", code}}).Increment();
  }

  void SetWorkersConnected(int64_t workers) override {
    workers_connected_value_.Set(static_cast<double>(workers));
  }

  void WorkerTaskLeased(const std::string& worker) override {
    absl::MutexLock lock(&mu_);
    prometheus::Counter* series = nullptr;
    if (const auto it = worker_series_.find(worker); it != worker_series_.end()) {
      series = it->second;
    } else if (worker_series_.size() < kMaxWorkerSeries) {
      series = worker_series_[worker] = &worker_tasks_leased_.Add({{"worker", worker}});
    } else {
      // Names are free-form and a worker token may register any number of them (a Slurm array
      // registers new ones with every submission): the names past the cap share one series.
      series = &worker_tasks_leased_.Add({{"worker", "other"}});
    }
    series->Increment();
  }

  void LeaseExpired() override { lease_expiries_total_.Increment(); }

  void StaleWorkerCall(const std::string& call) override {
    stale_calls_.Add({{"call", call}}).Increment();
  }

  void SetDiskSpace(const std::string& dir, int64_t free_bytes, int64_t size_bytes) override {
    absl::MutexLock lock(&mu_);
    disk_free_.Add({{"dir", dir}}).Set(static_cast<double>(free_bytes));
    disk_size_.Add({{"dir", dir}}).Set(static_cast<double>(size_bytes));
  }

  void ClearDiskSpace(const std::string& dir) override {
    absl::MutexLock lock(&mu_);
    // Family::Remove takes the series, so look it up by its labels first.
    if (disk_free_.Has({{"dir", dir}})) disk_free_.Remove(&disk_free_.Add({{"dir", dir}}));
    if (disk_size_.Has({{"dir", dir}})) disk_size_.Remove(&disk_size_.Add({{"dir", dir}}));
  }

  absl::Time scheduler_heartbeat() const override {
    absl::MutexLock lock(&mu_);
    return heartbeat_time_;
  }

  std::string Exposition() const override {
    return prometheus::TextSerializer().Serialize(registry_->Collect());
  }

  std::string listen_address() const override { return listen_address_; }

 private:
  const std::shared_ptr<prometheus::Registry> registry_;  // owns every family below
  // The families, one per metric of the header's list (in its order), plus the start time.
  prometheus::Family<prometheus::Gauge>& build_info_;
  prometheus::Family<prometheus::Gauge>& start_time_;
  prometheus::Family<prometheus::Gauge>& jobs_;
  prometheus::Family<prometheus::Gauge>& queue_depth_;
  prometheus::Family<prometheus::Gauge>& tasks_;
  prometheus::Family<prometheus::Counter>& attempts_;
  prometheus::Family<prometheus::Counter>& read_bytes_;
  prometheus::Family<prometheus::Counter>& written_bytes_;
  prometheus::Family<prometheus::Histogram>& stage_duration_;
  prometheus::Family<prometheus::Counter>& device_busy_;
  prometheus::Family<prometheus::Gauge>& device_busy_ratio_;
  prometheus::Family<prometheus::Gauge>& device_memory_;
  prometheus::Family<prometheus::Counter>& retries_;
  prometheus::Family<prometheus::Counter>& job_failures_;
  prometheus::Family<prometheus::Counter>& calibrated_tokens_;
  prometheus::Family<prometheus::Histogram>& calibration_layer_;
  prometheus::Family<prometheus::Counter>& evaluated_tokens_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Gauge>& heartbeat_;
  prometheus::Family<prometheus::Gauge>& disk_free_;
  prometheus::Family<prometheus::Gauge>& disk_size_;
  prometheus::Family<prometheus::Gauge>& workers_connected_;
  prometheus::Family<prometheus::Counter>& worker_tasks_leased_;
  prometheus::Family<prometheus::Counter>& lease_expiries_;
  prometheus::Family<prometheus::Counter>& stale_calls_;
  // The unlabelled series of the families above.
  prometheus::Counter& read_bytes_total_;
  prometheus::Counter& written_bytes_total_;
  prometheus::Counter& calibrated_tokens_total_;
  prometheus::Histogram& calibration_layer_seconds_;
  prometheus::Counter& evaluated_tokens_total_;
  prometheus::Gauge& queue_depth_value_;
  prometheus::Gauge& heartbeat_value_;
  prometheus::Gauge& workers_connected_value_;
  prometheus::Counter& lease_expiries_total_;

  // Guards job_series_, task_series_ and heartbeat_time_; makes each Set*/Clear* call atomic.
  mutable absl::Mutex mu_;
  absl::Time heartbeat_time_ ABSL_GUARDED_BY(mu_);  // the last SetJobCounts, else creation
  std::map<std::string, prometheus::Gauge*> job_series_;  // state -> its quantd_jobs series
  // (stage, task state) -> its quantd_tasks series.
  std::map<std::pair<std::string, std::string>, prometheus::Gauge*> task_series_;
  // Worker name -> its quantd_worker_tasks_leased_total series; at most kMaxWorkerSeries names.
  std::map<std::string, prometheus::Counter*> worker_series_ ABSL_GUARDED_BY(mu_);

  // Serves the registry over HTTP; null when not serving. Declared last, so it stops before
  // anything its answers read goes.
  std::string listen_address_;  // host:port server_ bound; "" when not serving
  std::unique_ptr<MetricsHttpServer> server_;
};

}  // namespace

std::unique_ptr<Metrics> Metrics::Create(const std::string& version, bool cuda) {
  return std::make_unique<PrometheusMetrics>(version, cuda);
}

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Serve(const std::string& listen,
                                                        const std::string& version, bool cuda) {
  auto metrics = std::make_unique<PrometheusMetrics>(version, cuda);
  if (absl::Status status = metrics->Listen(listen); !status.ok()) return status;
  return metrics;
}

}  // namespace quantd::metrics
