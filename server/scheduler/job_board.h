// JobBoard: the latest snapshot (a quantd.v1.Job) of every job the daemon knows, for readers that
// must not wait on SQLite: GetJob, ListJobs and WatchJob read here, never the store. Fed only by
// the scheduler's strand (a new snapshot after every state change and, at most every ~100 ms,
// progress), read by the API and quantd run; the engine never reads it back.
//
// WatchJob streams subscribe to one job: the listener runs on the publishing thread right after
// each Put/Remove of that job, must not block and must not call back into the board (it should
// only note that a newer snapshot exists and wake its stream). Unsubscribe returns only when the
// listener is not running and will not run again.
#ifndef QUANTD_SERVER_SCHEDULER_JOB_BOARD_H_
#define QUANTD_SERVER_SCHEDULER_JOB_BOARD_H_

#include <stdint.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "quantd/v1/quantd.pb.h"

namespace quantd::scheduler {

class JobBoard {
 public:
  using Listener = std::function<void()>;

  // Publishes `job` as the job's latest snapshot and notifies its listeners.
  void Put(const v1::Job& job);
  // The job was deleted: drops its snapshot and notifies its listeners (they find it gone).
  void Remove(int64_t job_id);

  // The latest snapshot, nullopt for an unknown job.
  std::optional<v1::Job> Get(int64_t job_id) const;
  // Jobs with id > after_id, ascending id, only `state` unless JOB_STATE_UNSPECIFIED, at most
  // `limit`. *more is set when further jobs match.
  std::vector<v1::Job> List(v1::JobState state, int64_t after_id, int limit, bool* more) const;
  // Jobs per state name ("PENDING", ...), for metrics.
  std::map<std::string, int64_t> CountByState() const;

  // Calls `listener` after every change of the job. Returns a token for Unsubscribe.
  int64_t Subscribe(int64_t job_id, Listener listener);
  void Unsubscribe(int64_t token);
  // Open subscriptions (tests, metrics).
  int64_t subscribers() const;

 private:
  void Notify(int64_t job_id) ABSL_LOCKS_EXCLUDED(listeners_mu_);

  mutable absl::Mutex jobs_mu_;                                // guards jobs_ (readers share it)
  std::map<int64_t, v1::Job> jobs_ ABSL_GUARDED_BY(jobs_mu_);  // job id -> latest snapshot

  mutable absl::Mutex listeners_mu_;  // guards the members below; held while listeners run
  struct Subscription {
    int64_t job_id;
    Listener listener;
  };
  std::map<int64_t, Subscription> listeners_ ABSL_GUARDED_BY(listeners_mu_);  // token -> it
  int64_t next_token_ ABSL_GUARDED_BY(listeners_mu_) = 1;  // the next Subscribe's token
};

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_JOB_BOARD_H_
