// The daemon under read load (issue 4 §6), as a gRPC client of a running `quantd serve`
// (tests/bench/run_daemon_bench.sh starts one). Per round: one job with no other client (the
// baseline, followed by one WatchJob stream); then, for each poll interval, `--pollers` threads
// calling GetJob in a loop (interval 0 = back to back) first on the idle daemon for as long as
// the baseline ran (the RPC path's own latency), then while the same job runs again, until it
// ends. Prints one row per run: GetJob calls, their rate and latency percentiles, and the job's
// run time (start_time to end_time as the daemon recorded them); then per interval the fastest
// loaded job's latency and slowdown against the fastest baseline, with the targets (p99 < 5 ms,
// slowdown < 5%), printed, not asserted.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "quantd/v1/quantd.grpc.pb.h"

namespace {

using quantd::v1::Job;
using quantd::v1::QuantService;
using Clock = std::chrono::steady_clock;

constexpr double kTargetP99Ms = 5;
constexpr double kTargetSlowdown = 0.05;

struct Args {
  std::string server;           // the daemon's address
  std::string source;           // the source checkpoint
  std::string recipe = "full";  // the jobs' recipe (full: a longer job than experts)
  std::string output_dir;       // outputs: <output_dir>/out-N, removed once a job succeeded
  int pollers = 200;            // GetJob threads per loaded job
  std::vector<int> interval_ms = {0, 100};  // pause between one poller's calls, per loaded job
  int rounds = 2;                           // each round: a baseline, then one job per interval
};

// One job's figures.
struct Row {
  std::string kind;             // "baseline" or "poll Nms"
  int64_t calls = 0;            // GetJob calls
  int64_t failed = 0;           // GetJob calls that did not return OK
  double poll_seconds = 0;      // wall time of the polling
  std::vector<double> latency;  // GetJob latencies in ms, sorted
  double job_seconds = 0;       // the job's start_time to end_time
};

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t i = static_cast<size_t>(p * static_cast<double>(sorted.size() - 1) + 0.5);
  return sorted[std::min(i, sorted.size() - 1)];
}

double Seconds(const google::protobuf::Timestamp& t) { return t.seconds() + t.nanos() * 1e-9; }

// `n` threads calling GetJob(id) in a loop, each pausing `interval_ms` after a call (their starts
// spread over one interval), from construction until Stop.
class Pollers {
 public:
  Pollers(QuantService::Stub* stub, int64_t id, int n, int interval_ms)
      : latency_(n), start_(Clock::now()) {
    for (int t = 0; t < n; ++t) {
      threads_.emplace_back([this, stub, id, n, interval_ms, t] {
        quantd::v1::GetJobRequest request;
        request.set_id(id);
        Job seen;
        // Spread the threads evenly over one interval, so that their calls do not come in bursts.
        std::this_thread::sleep_for(std::chrono::microseconds(int64_t{1000} * interval_ms * t / n));
        while (!stop_.load()) {
          grpc::ClientContext context;
          const Clock::time_point t0 = Clock::now();
          const grpc::Status s = stub->GetJob(&context, request, &seen);
          latency_[t].push_back(
              std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
          if (!s.ok()) ++failed_;
          if (interval_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
        }
      });
    }
  }

  // Joins the threads and fills the row's call figures.
  void Stop(Row* row) {
    stop_.store(true);
    for (std::thread& t : threads_) t.join();
    row->poll_seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    row->failed = failed_.load();
    for (const std::vector<double>& l : latency_) {
      row->latency.insert(row->latency.end(), l.begin(), l.end());
    }
    std::sort(row->latency.begin(), row->latency.end());
    row->calls = static_cast<int64_t>(row->latency.size());
  }

 private:
  std::vector<std::vector<double>> latency_;  // per thread: its calls' latencies in ms
  std::atomic<int64_t> failed_{0};            // calls that did not return OK
  std::atomic<bool> stop_{false};             // set by Stop
  const Clock::time_point start_;             // when the threads started
  std::vector<std::thread> threads_;
};

class Bench {
 public:
  explicit Bench(const Args& args)
      : args_(args),
        stub_(QuantService::NewStub(
            grpc::CreateChannel(args.server, grpc::InsecureChannelCredentials()))) {}

  // Runs one job, polled by `pollers` threads `interval_ms` apart until it ends, and followed by
  // one WatchJob stream; false (with a message) when a call or the job failed. *id = the job.
  bool RunJob(int pollers, int interval_ms, Row* row, int64_t* id) {
    quantd::v1::SubmitJobRequest submit;
    quantd::v1::JobSpec* spec = submit.mutable_spec();
    spec->set_source(args_.source);
    const std::string out = absl::StrCat(args_.output_dir, "/out-", next_output_++);
    spec->set_output(out);
    spec->set_weight_format("w4a16_nvfp4");
    spec->set_recipe(args_.recipe);
    Job job;
    {
      grpc::ClientContext context;
      const grpc::Status s = stub_->SubmitJob(&context, submit, &job);
      if (!s.ok()) return Fail("SubmitJob", s);
    }
    *id = job.id();
    Pollers load(stub_.get(), *id, pollers, interval_ms);
    grpc::ClientContext context;
    quantd::v1::WatchJobRequest watch;
    watch.set_id(*id);
    std::unique_ptr<grpc::ClientReader<Job>> reader = stub_->WatchJob(&context, watch);
    while (reader->Read(&job)) {
    }
    const grpc::Status watched = reader->Finish();
    load.Stop(row);
    if (!watched.ok()) return Fail("WatchJob", watched);
    if (job.state() != quantd::v1::SUCCEEDED) {
      std::cerr << "daemon_bench: job " << *id << " ended "
                << quantd::v1::JobState_Name(job.state()) << ": " << job.last_error() << "\n";
      return false;
    }
    std::filesystem::remove_all(out);
    row->job_seconds = Seconds(job.end_time()) - Seconds(job.start_time());
    return true;
  }

  // GetJob on the finished job `id` by `pollers` threads for `seconds`, nothing else running.
  void PollIdle(int64_t id, int pollers, int interval_ms, double seconds, Row* row) {
    Pollers load(stub_.get(), id, pollers, interval_ms);
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    load.Stop(row);
  }

 private:
  static bool Fail(const char* call, const grpc::Status& s) {
    std::cerr << "daemon_bench: " << call << ": " << s.error_code() << " " << s.error_message()
              << "\n";
    return false;
  }

  const Args& args_;                          // the settings
  std::unique_ptr<QuantService::Stub> stub_;  // one channel for every thread
  int next_output_ = 0;                       // numbers the output directories
};

void PrintRow(const Row& r) {
  const std::string job = r.job_seconds > 0 ? absl::StrFormat("%.2f", r.job_seconds) : "-";
  if (r.calls == 0) {
    std::cout << absl::StrFormat("%-12s %8s %9s %7s %7s %7s %7s %8s\n", r.kind, "-", "-", "-", "-",
                                 "-", "-", job);
    return;
  }
  std::cout << absl::StrFormat("%-12s %8d %9.0f %7.3f %7.3f %7.3f %7d %8s\n", r.kind, r.calls,
                               r.calls / r.poll_seconds, Percentile(r.latency, 0.5),
                               Percentile(r.latency, 0.99), r.latency.back(), r.failed, job);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{
      "GetJob latency under concurrent pollers and the job's slowdown, against quantd serve"};
  app.add_option("--server", args.server, "the daemon's address")->required();
  app.add_option("--source", args.source, "source checkpoint directory")->required();
  app.add_option("--recipe", args.recipe, "the jobs' recipe (W4A16)")->capture_default_str();
  app.add_option("--output-dir", args.output_dir,
                 "where job outputs go (removed once a job succeeded)")
      ->required();
  app.add_option("--pollers", args.pollers, "GetJob threads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--interval-ms", args.interval_ms, "pause between a poller's calls; one job each")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--rounds", args.rounds, "rounds of baseline + loaded jobs")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  Bench bench(args);
  std::vector<Row> rows;
  std::cout << absl::StrFormat("%-12s %8s %9s %7s %7s %7s %7s %8s\n", "run", "calls", "calls/s",
                               "p50_ms", "p99_ms", "max_ms", "failed", "job_s");
  for (int round = 0; round < args.rounds; ++round) {
    Row baseline;
    baseline.kind = "baseline";
    int64_t id = 0;
    if (!bench.RunJob(0, 0, &baseline, &id)) return 1;
    PrintRow(baseline);
    rows.push_back(baseline);
    for (const int interval : args.interval_ms) {
      // The same load on the idle daemon first: the RPC path's own latency.
      Row idle;
      idle.kind = absl::StrCat("idle ", interval, "ms");
      bench.PollIdle(id, args.pollers, interval, baseline.job_seconds, &idle);
      PrintRow(idle);
      rows.push_back(std::move(idle));
      Row loaded;
      loaded.kind = absl::StrCat("poll ", interval, "ms");
      if (!bench.RunJob(args.pollers, interval, &loaded, &id)) return 1;
      PrintRow(loaded);
      rows.push_back(std::move(loaded));
    }
  }

  // The fastest job of each kind (other load on the machine only ever slows one down), and the
  // idle daemon's best run as the reference for the latency.
  double base = 0;
  for (const Row& r : rows) {
    if (r.kind == "baseline" && (base == 0 || r.job_seconds < base)) base = r.job_seconds;
  }
  std::cout << absl::StrFormat("\n%d pollers, fastest of %d rounds, %d CPUs:\n", args.pollers,
                               args.rounds, std::thread::hardware_concurrency());
  for (const int interval : args.interval_ms) {
    const Row* loaded = nullptr;
    const Row* idle = nullptr;
    for (const Row& r : rows) {
      if (r.kind == absl::StrCat("poll ", interval, "ms") &&
          (loaded == nullptr || r.job_seconds < loaded->job_seconds)) {
        loaded = &r;
      }
      if (r.kind == absl::StrCat("idle ", interval, "ms") &&
          (idle == nullptr || Percentile(r.latency, 0.99) < Percentile(idle->latency, 0.99))) {
        idle = &r;
      }
    }
    const double p99 = Percentile(loaded->latency, 0.99);
    const double slowdown = loaded->job_seconds / base - 1;
    std::cout << absl::StrFormat(
        "interval %dms: GetJob p50 %.3f ms, p99 %.3f ms while the job runs (idle daemon: p50 "
        "%.3f, p99 %.3f; target p99 < %.0f ms: %s); job %.2f s vs %.2f s alone: slowdown %.1f%% "
        "(target < %.0f%%: %s)\n",
        interval, Percentile(loaded->latency, 0.5), p99, Percentile(idle->latency, 0.5),
        Percentile(idle->latency, 0.99), kTargetP99Ms, p99 < kTargetP99Ms ? "met" : "missed",
        loaded->job_seconds, base, 100 * slowdown, 100 * kTargetSlowdown,
        slowdown < kTargetSlowdown ? "met" : "missed");
  }
  return 0;
}
