// History retention: which finished jobs a policy prunes (api/history_pruner.h).
#include "server/api/history_pruner.h"

#include <gtest/gtest.h>

#include <google/protobuf/util/time_util.h>

namespace quantd::api {
namespace {

constexpr int64_t kDayMs = 24 * 3600 * 1000;
constexpr int64_t kNow = 100 * kDayMs;

v1::Job Job(int64_t id, v1::JobState state, int64_t ended_days_ago = -1) {
  v1::Job job;
  job.set_id(id);
  job.set_state(state);
  if (ended_days_ago >= 0) {
    *job.mutable_end_time() =
        google::protobuf::util::TimeUtil::MillisecondsToTimestamp(kNow - ended_days_ago * kDayMs);
  }
  return job;
}

TEST(JobsToPruneTest, KeepsTheNewestFinishedJobsAndEveryUnfinishedOne) {
  const std::vector<v1::Job> jobs = {
      Job(1, v1::SUCCEEDED, 9), Job(2, v1::FAILED, 8), Job(3, v1::PAUSED),
      Job(4, v1::CANCELLED, 7), Job(5, v1::RUNNING), Job(6, v1::PENDING), Job(7, v1::SUCCEEDED, 1)};
  EXPECT_EQ(JobsToPrune(jobs, {2, 0}, kNow), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(JobsToPrune(jobs, {0, 7.5}, kNow), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(JobsToPrune(jobs, {1, 0}, kNow), (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(JobsToPrune(jobs, {10, 30}, kNow), (std::vector<int64_t>{}));
  EXPECT_EQ(JobsToPrune(jobs, {0, 0.5}, kNow), (std::vector<int64_t>{1, 2, 4, 7}));
}

}  // namespace
}  // namespace quantd::api
