#include "server/scheduler/job_board.h"

#include <utility>

namespace quantd::scheduler {

void JobBoard::Put(const v1::Job& job) {
  {
    absl::WriterMutexLock lock(&jobs_mu_);
    jobs_[job.id()] = job;
  }
  Notify(job.id());
}

void JobBoard::Remove(int64_t job_id) {
  {
    absl::WriterMutexLock lock(&jobs_mu_);
    jobs_.erase(job_id);
  }
  Notify(job_id);
}

std::optional<v1::Job> JobBoard::Get(int64_t job_id) const {
  absl::ReaderMutexLock lock(&jobs_mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return std::nullopt;
  return it->second;
}

std::vector<v1::Job> JobBoard::List(v1::JobState state, int64_t after_id, int limit,
                                    bool* more) const {
  std::vector<v1::Job> out;
  *more = false;
  absl::ReaderMutexLock lock(&jobs_mu_);
  for (auto it = jobs_.upper_bound(after_id); it != jobs_.end(); ++it) {
    if (state != v1::JOB_STATE_UNSPECIFIED && it->second.state() != state) continue;
    if (static_cast<int>(out.size()) == limit) {
      *more = true;
      break;
    }
    out.push_back(it->second);
  }
  return out;
}

std::map<std::string, int64_t> JobBoard::CountByState() const {
  std::map<std::string, int64_t> counts;
  absl::ReaderMutexLock lock(&jobs_mu_);
  for (const auto& [id, job] : jobs_) ++counts[v1::JobState_Name(job.state())];
  return counts;
}

int64_t JobBoard::Subscribe(int64_t job_id, Listener listener) {
  absl::MutexLock lock(&listeners_mu_);
  const int64_t token = next_token_++;
  listeners_[token] = Subscription{job_id, std::move(listener)};
  return token;
}

void JobBoard::Unsubscribe(int64_t token) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.erase(token);
}

int64_t JobBoard::subscribers() const {
  absl::MutexLock lock(&listeners_mu_);
  return static_cast<int64_t>(listeners_.size());
}

void JobBoard::Notify(int64_t job_id) {
  // Listeners are few per job and only set a flag, so running them under the lock is cheap, and
  // it is what lets Unsubscribe promise that no call is in progress once it returns.
  absl::MutexLock lock(&listeners_mu_);
  for (auto& [token, sub] : listeners_) {
    if (sub.job_id == job_id) sub.listener();
  }
}

}  // namespace quantd::scheduler
