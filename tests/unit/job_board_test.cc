// JobBoard: snapshots replaced by Put, listing with state filter and paging, per-state counts,
// listeners called for their job only and never after Unsubscribe returned.
#include "server/scheduler/job_board.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace quantd::scheduler {
namespace {

v1::Job MakeJob(int64_t id, v1::JobState state) {
  v1::Job job;
  job.set_id(id);
  job.set_state(state);
  return job;
}

std::vector<int64_t> Ids(const std::vector<v1::Job>& jobs) {
  std::vector<int64_t> ids;
  for (const v1::Job& j : jobs) ids.push_back(j.id());
  return ids;
}

TEST(JobBoardTest, PutReplacesAndListFiltersAndPages) {
  JobBoard board;
  board.Put(MakeJob(1, v1::SUCCEEDED));
  board.Put(MakeJob(2, v1::PENDING));
  board.Put(MakeJob(3, v1::PENDING));
  board.Put(MakeJob(4, v1::RUNNING));
  board.Put(MakeJob(2, v1::RUNNING));
  EXPECT_EQ(board.Get(2)->state(), v1::RUNNING);
  EXPECT_FALSE(board.Get(5).has_value());
  bool more = false;
  EXPECT_EQ(Ids(board.List(v1::JOB_STATE_UNSPECIFIED, 0, 2, &more)), (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(more);
  EXPECT_EQ(Ids(board.List(v1::JOB_STATE_UNSPECIFIED, 2, 2, &more)), (std::vector<int64_t>{3, 4}));
  EXPECT_FALSE(more);
  EXPECT_EQ(Ids(board.List(v1::RUNNING, 0, 10, &more)), (std::vector<int64_t>{2, 4}));
  EXPECT_FALSE(more);
  EXPECT_EQ(board.CountByState(), (std::map<std::string, int64_t>{
                                      {"PENDING", 1}, {"RUNNING", 2}, {"SUCCEEDED", 1}}));
  board.Remove(3);
  EXPECT_EQ(Ids(board.List(v1::JOB_STATE_UNSPECIFIED, 0, 10, &more)),
            (std::vector<int64_t>{1, 2, 4}));
}

TEST(JobBoardTest, ListenersHearTheirJobUntilUnsubscribed) {
  JobBoard board;
  int heard_1 = 0, heard_2 = 0;
  const int64_t t1 = board.Subscribe(1, [&] { ++heard_1; });
  const int64_t t2 = board.Subscribe(2, [&] { ++heard_2; });
  EXPECT_EQ(board.subscribers(), 2);
  board.Put(MakeJob(1, v1::PENDING));
  board.Put(MakeJob(1, v1::RUNNING));
  board.Remove(1);
  EXPECT_EQ(heard_1, 3);
  EXPECT_EQ(heard_2, 0);
  board.Unsubscribe(t1);
  board.Put(MakeJob(1, v1::PENDING));
  EXPECT_EQ(heard_1, 3);
  board.Unsubscribe(t2);
  EXPECT_EQ(board.subscribers(), 0);
}

TEST(JobBoardTest, UnsubscribeWaitsForARunningListener) {
  JobBoard board;
  std::atomic<bool> in_listener{false}, release{false}, returned{false};
  const int64_t token = board.Subscribe(7, [&] {
    in_listener = true;
    while (!release) std::this_thread::yield();
  });
  std::thread publisher([&] { board.Put(MakeJob(7, v1::RUNNING)); });
  while (!in_listener) std::this_thread::yield();
  std::thread unsubscriber([&] {
    board.Unsubscribe(token);
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(returned);  // the listener still runs
  release = true;
  unsubscriber.join();
  publisher.join();
  EXPECT_TRUE(returned);
}

}  // namespace
}  // namespace quantd::scheduler
