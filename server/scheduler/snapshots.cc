// Snapshots: the job as a quantd.v1.Job from the store plus what runs now (bytes reported by running
// tasks, rates), published to the JobBoard after every change and at most every 100 ms for
// progress; and the metrics gauges. Everything here runs on the strand; the board is only written.
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/job/job_spec.h"
#include "server/scheduler/job_proto.h"
#include "server/scheduler/scheduler_impl.h"

namespace quantd::scheduler {
namespace {

constexpr size_t kBusyWindow = 60;  // busy-ratio window, in metric refreshes
constexpr double kMetricsIntervalSeconds = 1.0;

// StageProgress.workers: who ran the stage's done tasks, when a remote worker ran one of them.
void AddStageWorkers(int64_t stage_id, const std::vector<store::StageRunner>& runners,
                     v1::StageProgress* out) {
  std::map<std::string, int64_t> tasks;  // by worker name, "" for this quantd
  bool remote = false;
  for (const store::StageRunner& r : runners) {
    if (r.stage_id != stage_id) continue;
    const std::string worker = WorkerOfLeaseOwner(r.ran_by);
    remote |= !worker.empty();
    tasks[worker] += r.tasks;  // this quantd's runs under several pids are one entry
  }
  if (!remote) return;
  for (const auto& [worker, count] : tasks) {
    v1::StageWorker* w = out->add_workers();
    w->set_worker(worker);
    w->set_tasks(count);
  }
}

}  // namespace

absl::StatusOr<v1::Job> Scheduler::Impl::Snapshot(int64_t job_id) {
  ASSIGN_OR_RETURN(store::JobRow row, store_->GetJob(job_id));
  ASSIGN_OR_RETURN(std::vector<store::StageProgress> stages, store_->Progress(job_id));
  ASSIGN_OR_RETURN(int64_t retries, store_->CountEvents(job_id, "task_retry"));
  ASSIGN_OR_RETURN(std::vector<store::StageRunner> runners, store_->ListStageRunners(job_id));
  v1::Job job;
  job.set_id(row.id);
  job.set_request_id(row.request_id);
  const auto active = active_.find(job_id);
  if (active != active_.end()) {
    *job.mutable_spec() = active->second->spec;  // read once, when the job started
  } else if (absl::StatusOr<job::JobSpec> spec =
                 job::ParseStoredJobSpec(row.spec_json, "stored spec");
             spec.ok()) {
    *job.mutable_spec() = job::JobSpecToProto(*spec);
  }
  job.set_state(JobStateToProto(row.state));
  job.set_reason(row.reason);
  job.set_last_error(row.error);
  *job.mutable_create_time() = TimestampFromMs(row.created_ms);
  *job.mutable_update_time() = TimestampFromMs(row.updated_ms);
  if (row.started_ms.has_value()) *job.mutable_start_time() = TimestampFromMs(*row.started_ms);
  if (row.finished_ms.has_value()) *job.mutable_end_time() = TimestampFromMs(*row.finished_ms);
  job.set_task_retries(retries);
  const int64_t now = clock_.NowMs();
  int64_t attempts = 0;
  for (const store::StageProgress& p : stages) {
    v1::StageProgress* out = job.add_stages();
    // What the stage's progress counts, and where it is: the stage says (a kind this quantd does
    // not know counts bytes and says nothing).
    const pipeline::Stage* stage = planner_->stages().Find(p.kind);
    out->set_kind(p.kind);
    out->set_unit(std::string(stage != nullptr ? stage->progress_unit() : "bytes"));
    out->set_state(StageStateToProto(p.state));
    out->set_tasks_done(p.tasks_done);
    out->set_tasks_total(p.tasks_total);
    out->set_bytes_total(p.bytes_total);
    out->set_task_attempts(p.task_attempts);
    AddStageWorkers(p.stage_id, runners, out);
    attempts += p.task_attempts;
    if (p.started_ms.has_value()) *out->mutable_start_time() = TimestampFromMs(*p.started_ms);
    if (p.finished_ms.has_value()) *out->mutable_end_time() = TimestampFromMs(*p.finished_ms);
    int64_t done = p.bytes_done;
    if (active != active_.end()) {
      std::vector<const store::TaskRow*> running;
      for (const auto& [task_id, f] : active->second->in_flight) {
        if (f.work.task.stage_id == p.stage_id && !f.returned) {
          done += f.work.run->bytes.load(std::memory_order_relaxed);
          running.push_back(&f.work.task);
        }
      }
      done = std::min(done, p.bytes_total);
      if (stage != nullptr) out->set_step(stage->ProgressStep(running));
      const auto clock = active->second->stage_clock.find(p.stage_id);
      if (p.state != store::StageState::kSucceeded && clock != active->second->stage_clock.end()) {
        const double elapsed = (now - clock->second.first) / 1000.0;
        const int64_t processed = done - clock->second.second;
        if (processed > 0 && elapsed > 0) {
          const double rate = processed / elapsed;
          out->set_bytes_per_second(rate);
          out->set_eta_seconds((p.bytes_total - done) / rate);
        }
      }
    }
    out->set_bytes_done(done);
    if (job.current_stage().empty() && p.state != store::StageState::kSucceeded) {
      job.set_current_stage(p.kind);
    }
  }
  job.set_task_attempts(attempts);
  return job;
}

absl::Status Scheduler::Impl::Publish(int64_t job_id) {
  ASSIGN_OR_RETURN(v1::Job job, Snapshot(job_id));
  const auto active = active_.find(job_id);
  if (active != active_.end()) {
    uint64_t running = 0;
    for (const auto& [id, f] : active->second->in_flight) running += f.work.run->bytes.load();
    active->second->published_bytes = running;
  }
  board_.Put(job);
  return absl::OkStatus();
}

void Scheduler::Impl::PublishProgress() {
  for (auto& [id, job] : active_) {
    uint64_t running = 0;
    for (const auto& [task_id, f] : job->in_flight) running += f.work.run->bytes.load();
    if (running == job->published_bytes) continue;
    if (absl::Status s = Publish(id); !s.ok()) Log(id, "error", std::string(s.message()));
  }
}

void Scheduler::Impl::RefreshMetrics() {
  metrics::Metrics* metrics = options_.metrics;
  if (metrics == nullptr) return;
  std::map<std::string, int64_t> jobs;
  for (const auto& [id, state] : states_) ++jobs[store::JobStateName(state)];
  metrics->SetJobCounts(jobs);
  const auto pending = jobs.find("PENDING");
  metrics->SetQueueDepth(pending == jobs.end() ? 0 : pending->second);
  std::map<std::pair<std::string, std::string>, int64_t> tasks;
  for (const auto& [id, job] : active_) {
    absl::StatusOr<std::vector<store::TaskRow>> rows = store_->ListTasks(id);
    if (!rows.ok()) continue;
    for (const store::TaskRow& t : *rows) ++tasks[{t.stage_kind, store::TaskStateName(t.state)}];
  }
  metrics->SetTaskCounts(tasks);
  // Busy share per device name over the last kBusyWindow refreshes.
  const int64_t now = clock_.NowMs();
  std::map<std::string, std::pair<double, int>> busy;  // device -> (busy seconds, workers)
  std::map<std::string, const compute::Device*> devices;  // device -> one of its workers' devices
  for (size_t i = 0; i < workers_.size(); ++i) {
    WorkerSlot& slot = slots_[i];
    const std::string& name = workers_[i]->device->name();
    double total = slot.busy_seconds;
    if (slot.busy) total += (now - slot.busy_since_ms) / 1000.0;
    busy[name].first += total - slot.busy_sampled;
    busy[name].second += 1;
    slot.busy_sampled = total;
    devices.emplace(name, workers_[i]->device.get());
  }
  for (const auto& [name, b] : busy) {
    std::deque<double>& window = busy_window_[name];
    window.push_back(std::min(1.0, b.first / (kMetricsIntervalSeconds * b.second)));
    if (window.size() > kBusyWindow) window.pop_front();
    double sum = 0;
    for (double v : window) sum += v;
    metrics->SetDeviceBusyRatio(name, sum / window.size());
    // CPU: this process's resident memory; CUDA: what cudaMemGetInfo says is in use.
    const compute::Device& device = *devices[name];
    if (absl::StatusOr<int64_t> free = device.free_memory_bytes(); free.ok()) {
      metrics->SetDeviceMemoryUsed(name, device.total_memory_bytes() - *free);
    }
  }
}

}  // namespace quantd::scheduler
