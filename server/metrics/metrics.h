// Metrics: the daemon's Prometheus metrics (prometheus-cpp), named and labelled by Prometheus
// conventions: `quantd_` prefix, `_total` counters, `_seconds` and `_bytes` units, and label values
// from small fixed sets (states, stage kinds, device names, status-code names), never job ids.
// Stage kinds come from the stage registry (pipeline/stage_registry.h) through DeclareStages.
//
//   quantd_build_info{version,cuda}                         gauge, always 1
//   quantd_process_start_time_seconds                       gauge: Unix time the daemon started
//   quantd_jobs{state}                                      gauge: jobs in each state
//   quantd_queue_depth                                      gauge: PENDING jobs waiting for devices
//   quantd_tasks{stage,state}                               gauge: tasks of unfinished jobs
//   quantd_task_attempts_total{stage,outcome}               counter: done | failed | retried | interrupted
//   quantd_read_bytes_total                                 counter: source bytes processed
//   quantd_written_bytes_total                              counter: output bytes written
//   quantd_stage_duration_seconds{stage}                    histogram: a stage's run, start to success
//   quantd_device_busy_seconds_total{device}                counter: time a device's worker ran tasks
//   quantd_device_busy_ratio{device}                        gauge: busy share over the last minute
//   quantd_device_memory_used_bytes{device}                 gauge
//   quantd_task_retries_total{reason}                       counter: reason = status code name
//   quantd_job_failures_total{reason}                       counter: reason = the job's reason
//   quantd_calibrated_tokens_total                          counter: token rows calibrate tasks
//                                                           moved through a decoder layer
//   quantd_calibration_layer_seconds                        histogram: one calibrate task, a
//                                                           decoder layer over one slice of the
//                                                           samples (not a whole layer)
//   quantd_evaluated_tokens_total                           counter: token rows evaluate tasks
//                                                           moved through a decoder layer or the
//                                                           head (both models)
//   quantd_rpc_requests_total{method,code}                  counter: method = RPC name, code = gRPC code name
//   quantd_scheduler_heartbeat_timestamp_seconds            gauge: Unix time of the scheduler's
//                                                           last SetJobCounts (start until then)
//   quantd_disk_free_bytes{dir}                             gauge: dir = state or output
//   quantd_disk_size_bytes{dir}                             gauge: the same file systems' sizes
//   quantd_workers_connected                                gauge: registered remote workers
//   quantd_worker_tasks_leased_total{worker}                counter: tasks leased to a remote
//                                                           worker (worker = its name; the first
//                                                           64 names a daemon sees, the later
//                                                           ones all "other")
//   quantd_lease_expiries_total                             counter: task leases lost to silence
//   quantd_worker_stale_calls_total{call}                   counter: renew | complete | fail calls
//                                                           of an attempt that lost its lease,
//                                                           refused
//
// Thread-safe: every method may be called from any thread.
#ifndef QUANTD_SERVER_METRICS_METRICS_H_
#define QUANTD_SERVER_METRICS_METRICS_H_

#include <stdint.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace quantd::metrics {

class Metrics {
 public:
  // A registry with every metric registered and nothing served (tests, `quantd run`).
  static std::unique_ptr<Metrics> Create(const std::string& version, bool cuda);
  // The same, served over HTTP at http://<listen>/metrics ("127.0.0.1:9464"). InvalidArgument for
  // a malformed address, Unavailable when it cannot be bound (the message names the address).
  static absl::StatusOr<std::unique_ptr<Metrics>> Serve(const std::string& listen,
                                                        const std::string& version, bool cuda);
  virtual ~Metrics() = default;

  // Creates the series of each stage kind at 0 (tasks by state, attempts by outcome, durations),
  // so that they exist before the stage's first task.
  virtual void DeclareStages(const std::vector<std::string>& kinds) = 0;
  // Replaces the per-state job counts (states missing from `by_state` read 0). The scheduler calls
  // it from its loop every second, so the time of the last call is the scheduler's heartbeat.
  virtual void SetJobCounts(const std::map<std::string, int64_t>& by_state) = 0;
  virtual void SetQueueDepth(int64_t pending) = 0;
  // Replaces the task counts: (stage kind, task state) -> count. Pairs missing read 0.
  virtual void SetTaskCounts(const std::map<std::pair<std::string, std::string>, int64_t>& n) = 0;
  virtual void TaskAttempt(const std::string& stage, const std::string& outcome) = 0;
  virtual void AddBytesRead(uint64_t n) = 0;
  virtual void AddBytesWritten(uint64_t n) = 0;
  virtual void ObserveStageDuration(const std::string& stage, double seconds) = 0;
  // A device's worker was busy for `seconds` more (called when each task ends).
  virtual void AddDeviceBusy(const std::string& device, double seconds) = 0;
  virtual void SetDeviceBusyRatio(const std::string& device, double ratio) = 0;
  virtual void SetDeviceMemoryUsed(const std::string& device, int64_t bytes) = 0;
  virtual void TaskRetried(const std::string& reason) = 0;
  virtual void JobFailed(const std::string& reason) = 0;
  // A figure a finished task reports for a task metric (pipeline::TaskFigure, named by the stage
  // that measured it): an increment of quantd_calibrated_tokens_total or
  // quantd_evaluated_tokens_total, an observation of quantd_calibration_layer_seconds. A name
  // that is none of these is ignored.
  virtual void AddTaskFigure(const std::string& metric, double value) = 0;
  virtual void RpcHandled(const std::string& method, const std::string& code) = 0;
  // The free and total bytes of the file system under a directory kind: "state" (the daemon's
  // state dir) or "output" (the fullest file system among the unfinished jobs' outputs).
  virtual void SetDiskSpace(const std::string& dir, int64_t free_bytes, int64_t size_bytes) = 0;
  // Drops the series of `dir` (no unfinished job has an output to watch).
  virtual void ClearDiskSpace(const std::string& dir) = 0;

  virtual void SetWorkersConnected(int64_t workers) = 0;
  virtual void WorkerTaskLeased(const std::string& worker) = 0;
  virtual void LeaseExpired() = 0;
  // `call`: "renew", "complete" or "fail".
  virtual void StaleWorkerCall(const std::string& call) = 0;

  // When SetJobCounts last ran (the scheduler's heartbeat); the creation time until then.
  virtual absl::Time scheduler_heartbeat() const = 0;

  // The current metrics in the Prometheus text exposition format (what a scrape returns).
  virtual std::string Exposition() const = 0;
  // The address the HTTP server listens on ("127.0.0.1:9464"); "" when not serving. With port 0
  // in Serve's address, this carries the port the system picked.
  virtual std::string listen_address() const = 0;
};

}  // namespace quantd::metrics

#endif  // QUANTD_SERVER_METRICS_METRICS_H_
