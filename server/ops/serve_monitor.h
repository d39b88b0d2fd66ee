// ServeMonitor: the housekeeping thread of `quantd serve`. Every `period` it
//   - samples the file systems under the state dir and under the outputs of unfinished (PENDING,
//     RUNNING, PAUSED) jobs into quantd_disk_free_bytes / quantd_disk_size_bytes{dir="state" |
//     "output"}; "output" is the file system with the fewest free bytes among those outputs, and
//     its series is dropped while no job is unfinished;
//   - sends "WATCHDOG=1" (systemd WatchdogSec=) when a watchdog is configured and the scheduler's
//     heartbeat (Metrics::scheduler_heartbeat: its loop refreshes the job counts every second) is
//     at most `max_heartbeat_age` old. A wedged scheduler thus stops the pings and the service
//     manager restarts the daemon, while a live one keeps it up however long its jobs run.
#ifndef QUANTD_SERVER_OPS_SERVE_MONITOR_H_
#define QUANTD_SERVER_OPS_SERVE_MONITOR_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/metrics/metrics.h"
#include "server/scheduler/job_board.h"

namespace quantd::ops {

struct ServeMonitorOptions {
  std::string state_dir;                       // absolute
  const scheduler::JobBoard* board = nullptr;  // the jobs whose outputs are watched; not owned
  metrics::Metrics* metrics = nullptr;         // receives the samples, has the heartbeat; not owned
  std::chrono::milliseconds period{5000};      // between two rounds
  std::chrono::milliseconds max_heartbeat_age{5000};  // older: the scheduler counts as wedged
  // Sends one watchdog ping (ops::SystemdNotify("WATCHDOG=1")); nullptr = no watchdog.
  std::function<void()> watchdog;
};

class ServeMonitor {
 public:
  // Runs one round at once, then one every `period` on its own thread until Stop.
  static std::unique_ptr<ServeMonitor> Start(ServeMonitorOptions options);
  // Stop().
  ~ServeMonitor();
  ServeMonitor(const ServeMonitor&) = delete;
  ServeMonitor& operator=(const ServeMonitor&) = delete;

  // Ends the thread; returns once it has. Later calls do nothing.
  void Stop();

  // One round on the caller's thread: the disk samples, then the watchdog check.
  void RunOnce();

 private:
  explicit ServeMonitor(ServeMonitorOptions options);
  void SampleDisks();
  void Loop();

  const ServeMonitorOptions options_;
  absl::Mutex mu_;                          // guards stop_
  bool stop_ ABSL_GUARDED_BY(mu_) = false;  // Stop was called
  std::thread thread_;                     // runs Loop
};

}  // namespace quantd::ops

#endif  // QUANTD_SERVER_OPS_SERVE_MONITOR_H_
