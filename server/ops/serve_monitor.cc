#include "server/ops/serve_monitor.h"

#include <stdint.h>

#include <filesystem>
#include <optional>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/checkpoint/disk_space.h"

namespace quantd::ops {
namespace {

// Jobs read from the board per List call.
constexpr int kPage = 1000;

// The outputs of the board's jobs in `state`, made absolute against the daemon's working dir.
void AppendOutputs(const scheduler::JobBoard& board, v1::JobState state,
                   std::vector<std::string>* out) {
  int64_t after_id = 0;
  bool more = true;
  while (more) {
    const std::vector<v1::Job> jobs = board.List(state, after_id, kPage, &more);
    for (const v1::Job& job : jobs) {
      if (job.spec().output().empty()) continue;
      std::error_code ec;
      const std::filesystem::path output = std::filesystem::absolute(job.spec().output(), ec);
      if (!ec) out->push_back(output.string());
    }
    if (jobs.empty()) break;
    after_id = jobs.back().id();
  }
}

}  // namespace

ServeMonitor::ServeMonitor(ServeMonitorOptions options) : options_(std::move(options)) {}

std::unique_ptr<ServeMonitor> ServeMonitor::Start(ServeMonitorOptions options) {
  std::unique_ptr<ServeMonitor> monitor(new ServeMonitor(std::move(options)));
  monitor->RunOnce();
  monitor->thread_ = std::thread([m = monitor.get()] { m->Loop(); });
  return monitor;
}

ServeMonitor::~ServeMonitor() { Stop(); }

void ServeMonitor::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void ServeMonitor::Loop() {
  const absl::Duration period = absl::FromChrono(options_.period);
  const absl::Condition stopped(&stop_);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(stopped, period)) return;  // true once Stop was called
    }
    RunOnce();
  }
}

void ServeMonitor::RunOnce() {
  SampleDisks();
  if (!options_.watchdog) return;
  const absl::Duration age = absl::Now() - options_.metrics->scheduler_heartbeat();
  if (age <= absl::FromChrono(options_.max_heartbeat_age)) options_.watchdog();
}

void ServeMonitor::SampleDisks() {
  metrics::Metrics& metrics = *options_.metrics;
  if (absl::StatusOr<checkpoint::DiskSpace> state = checkpoint::DiskSpaceUnder(options_.state_dir);
      state.ok()) {
    metrics.SetDiskSpace("state", state->free_bytes, state->size_bytes);
  }
  std::vector<std::string> outputs;
  for (v1::JobState s : {v1::PENDING, v1::RUNNING, v1::PAUSED}) {
    AppendOutputs(*options_.board, s, &outputs);
  }
  std::optional<checkpoint::DiskSpace> least_free;
  for (const std::string& output : outputs) {
    absl::StatusOr<checkpoint::DiskSpace> space = checkpoint::DiskSpaceUnder(output);
    if (!space.ok()) continue;
    if (!least_free || space->free_bytes < least_free->free_bytes) least_free = *space;
  }
  if (least_free) {
    metrics.SetDiskSpace("output", least_free->free_bytes, least_free->size_bytes);
  } else {
    metrics.ClearDiskSpace("output");
  }
}

}  // namespace quantd::ops
