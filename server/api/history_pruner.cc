#include "server/api/history_pruner.h"

#include <google/protobuf/util/time_util.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace quantd::api {
namespace {

bool Finished(v1::JobState state) {
  return state == v1::SUCCEEDED || state == v1::FAILED || state == v1::CANCELLED;
}

constexpr double kMsPerDay = 24.0 * 3600 * 1000;

}  // namespace

std::vector<int64_t> JobsToPrune(const std::vector<v1::Job>& jobs, const RetentionPolicy& policy,
                                 int64_t now_ms) {
  std::vector<const v1::Job*> finished;
  for (const v1::Job& job : jobs) {
    if (Finished(job.state())) finished.push_back(&job);
  }
  // Newest first (ids grow with submission).
  std::sort(finished.begin(), finished.end(),
            [](const v1::Job* a, const v1::Job* b) { return a->id() > b->id(); });
  std::vector<int64_t> prune;
  for (size_t i = 0; i < finished.size(); ++i) {
    const v1::Job& job = *finished[i];
    const bool over_count = policy.keep_jobs > 0 && static_cast<int64_t>(i) >= policy.keep_jobs;
    const int64_t end_ms =
        google::protobuf::util::TimeUtil::TimestampToMilliseconds(job.end_time());
    const bool too_old = policy.keep_days > 0 && job.has_end_time() &&
                         static_cast<double>(now_ms - end_ms) > policy.keep_days * kMsPerDay;
    if (over_count || too_old) prune.push_back(job.id());
  }
  std::sort(prune.begin(), prune.end());
  return prune;
}

std::unique_ptr<HistoryPruner> HistoryPruner::Start(scheduler::Scheduler* scheduler,
                                                    const RetentionPolicy& policy,
                                                    std::chrono::milliseconds period,
                                                    std::function<void(const std::string&)> log) {
  std::unique_ptr<HistoryPruner> pruner(new HistoryPruner());
  pruner->scheduler_ = scheduler;
  pruner->policy_ = policy;
  pruner->period_ = period;
  pruner->log_ = std::move(log);
  pruner->thread_ = std::thread([p = pruner.get()] { p->Loop(); });
  return pruner;
}

HistoryPruner::~HistoryPruner() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void HistoryPruner::Loop() {
  const absl::Condition stopping(&stop_);
  while (true) {
    PruneOnce();
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(stopping, absl::FromChrono(period_))) return;  // stop_ was set
  }
}

int PruneHistory(scheduler::Scheduler& scheduler, const RetentionPolicy& policy, int64_t now_ms,
                 const std::function<void()>& selected) {
  std::vector<v1::Job> jobs;
  bool more = true;
  for (int64_t after_id = 0; more;) {
    std::vector<v1::Job> page =
        scheduler.board().List(v1::JOB_STATE_UNSPECIFIED, after_id, 1000, &more);
    if (page.empty()) break;
    after_id = page.back().id();
    for (v1::Job& job : page) jobs.push_back(std::move(job));
  }
  const std::vector<int64_t> prune = JobsToPrune(jobs, policy, now_ms);
  if (selected) selected();
  int pruned = 0;
  for (int64_t id : prune) {
    // A job resumed (or deleted) since the listing is refused and kept.
    if (scheduler.Delete(id, store::DeletePrecondition::kFinished).ok()) ++pruned;
  }
  return pruned;
}

void HistoryPruner::PruneOnce() {
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  const int pruned = PruneHistory(*scheduler_, policy_, now_ms);
  if (pruned > 0 && log_) {
    log_(absl::StrCat("history retention: deleted ", pruned, " finished job(s)"));
  }
}

}  // namespace quantd::api
