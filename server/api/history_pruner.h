// History retention (`quantd serve --retain-jobs N --retain-days D`): finished jobs (SUCCEEDED,
// FAILED, CANCELLED) beyond the newest N, or finished more than D days ago, are deleted through
// the scheduler (as DeleteJob would), so the database and ListJobs stay bounded. PENDING, RUNNING
// and PAUSED jobs are never pruned: the jobs are selected from a snapshot, and each is deleted only
// if it is still finished in the transaction that deletes it (store::DeletePrecondition), so a job
// resumed in between is kept. Output files stay on disk.
#ifndef QUANTD_SERVER_API_HISTORY_PRUNER_H_
#define QUANTD_SERVER_API_HISTORY_PRUNER_H_

#include <stdint.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "quantd/v1/quantd.pb.h"
#include "server/scheduler/scheduler.h"

namespace quantd::api {

struct RetentionPolicy {
  int64_t keep_jobs = 0;  // finished jobs kept at most; 0 = no count limit
  double keep_days = 0;   // finished jobs older than this are pruned; 0 = no age limit

  bool enabled() const { return keep_jobs > 0 || keep_days > 0; }
};

// The ids of the finished jobs among `jobs` that `policy` prunes at `now_ms` (Unix ms).
std::vector<int64_t> JobsToPrune(const std::vector<v1::Job>& jobs, const RetentionPolicy& policy,
                                 int64_t now_ms);

// One pass at `now_ms` (Unix ms): selects from the scheduler's board the jobs `policy` prunes, then
// deletes each that is still finished. Returns how many it deleted. `selected` (a seam for tests)
// runs between the selection and the first delete.
int PruneHistory(scheduler::Scheduler& scheduler, const RetentionPolicy& policy, int64_t now_ms,
                 const std::function<void()>& selected = nullptr);

// Prunes once at Start and then every `period`, until destroyed.
class HistoryPruner {
 public:
  // `log` receives one line per pass that pruned something.
  static std::unique_ptr<HistoryPruner> Start(scheduler::Scheduler* scheduler,
                                              const RetentionPolicy& policy,
                                              std::chrono::milliseconds period,
                                              std::function<void(const std::string&)> log);
  ~HistoryPruner();
  HistoryPruner(const HistoryPruner&) = delete;
  HistoryPruner& operator=(const HistoryPruner&) = delete;

 private:
  HistoryPruner() = default;
  void Loop();
  void PruneOnce();

  scheduler::Scheduler* scheduler_ = nullptr;       // not owned
  RetentionPolicy policy_;                          // what to keep
  std::chrono::milliseconds period_{0};             // between passes
  std::function<void(const std::string&)> log_;     // pass summaries
  absl::Mutex mu_;                                  // guards stop_
  bool stop_ ABSL_GUARDED_BY(mu_) = false;          // the destructor runs
  std::thread thread_;                              // runs Loop
};

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_HISTORY_PRUNER_H_
