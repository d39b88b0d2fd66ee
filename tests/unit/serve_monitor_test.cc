// ServeMonitor and DiskSpaceUnder: the disk samples of the state dir and of the unfinished jobs'
// outputs (the file system with the fewest free bytes, dropped while no job is unfinished), and
// watchdog pings only while the scheduler's heartbeat is fresh.
#include "server/ops/serve_monitor.h"

#include <gtest/gtest.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server/checkpoint/disk_space.h"
#include "tests/unit/test_dirs.h"

namespace quantd::ops {
namespace {

using std::chrono::milliseconds;

// The exposition's sample lines that start with `prefix`.
std::vector<std::string> Samples(const metrics::Metrics& m, const std::string& prefix) {
  std::vector<std::string> lines = absl::StrSplit(m.Exposition(), '\n', absl::SkipEmpty());
  std::erase_if(lines, [&prefix](const std::string& line) { return line.rfind(prefix, 0) != 0; });
  return lines;
}

// The value of the one sample `series` ("name{labels}"); -1 when absent.
double Value(const metrics::Metrics& m, const std::string& series) {
  const std::vector<std::string> lines = Samples(m, series + " ");
  if (lines.size() != 1) return -1;
  return std::stod(lines[0].substr(series.size() + 1));
}

struct Statvfs {
  double free_bytes;
  double size_bytes;
};

Statvfs Stat(const std::string& path) {
  struct statvfs fs {};
  EXPECT_EQ(statvfs(path.c_str(), &fs), 0) << path;
  return {static_cast<double>(fs.f_bavail) * fs.f_frsize,
          static_cast<double>(fs.f_blocks) * fs.f_frsize};
}

// `value` is a free-bytes sample of `path` taken between `before` and `after`.
void ExpectFreeBetween(double value, const Statvfs& before, const Statvfs& after) {
  EXPECT_GE(value, std::min(before.free_bytes, after.free_bytes));
  EXPECT_LE(value, std::max(before.free_bytes, after.free_bytes));
}

v1::Job JobWithOutput(int64_t id, v1::JobState state, const std::string& output) {
  v1::Job job;
  job.set_id(id);
  job.set_state(state);
  job.mutable_spec()->set_output(output);
  return job;
}

class ServeMonitorTest : public testing_util::TempDirTest {
 protected:
  ServeMonitorOptions Options() {
    ServeMonitorOptions options;
    options.state_dir = dir_;
    options.board = &board_;
    options.metrics = metrics_.get();
    return options;
  }

  scheduler::JobBoard board_;
  std::unique_ptr<metrics::Metrics> metrics_ = metrics::Metrics::Create("1", false);
};

TEST_F(ServeMonitorTest, SamplesStateDirAndDropsOutputWithoutUnfinishedJobs) {
  const Statvfs before = Stat(dir_);
  std::unique_ptr<ServeMonitor> monitor = ServeMonitor::Start(Options());  // one round at once
  const Statvfs after = Stat(dir_);
  EXPECT_EQ(Value(*metrics_, "quantd_disk_size_bytes{dir=\"state\"}"), before.size_bytes);
  ExpectFreeBetween(Value(*metrics_, "quantd_disk_free_bytes{dir=\"state\"}"), before, after);
  // Finished jobs' outputs are not watched.
  board_.Put(JobWithOutput(1, v1::SUCCEEDED, dir_ + "/done"));
  board_.Put(JobWithOutput(2, v1::CANCELLED, dir_ + "/cancelled"));
  monitor->RunOnce();
  EXPECT_TRUE(Samples(*metrics_, "quantd_disk_free_bytes{dir=\"output\"}").empty());
  EXPECT_TRUE(Samples(*metrics_, "quantd_disk_size_bytes{dir=\"output\"}").empty());
}

TEST_F(ServeMonitorTest, OutputIsTheFileSystemWithFewestFreeBytesAmongUnfinishedJobs) {
  // Two file systems when /dev/shm is a tmpfs of its own (else both outputs share one).
  const std::string shm = "/dev/shm";
  const std::string other = std::filesystem::is_directory(shm) ? shm : dir_;
  board_.Put(JobWithOutput(1, v1::PENDING, dir_ + "/not/yet/created"));
  board_.Put(JobWithOutput(2, v1::PAUSED, other + "/quantd-serve-monitor-test-absent"));
  board_.Put(JobWithOutput(3, v1::SUCCEEDED, "/"));
  const Statvfs before_a = Stat(dir_), before_b = Stat(other);
  std::unique_ptr<ServeMonitor> monitor = ServeMonitor::Start(Options());
  const Statvfs after_a = Stat(dir_), after_b = Stat(other);
  const bool a_fewer = before_a.free_bytes <= before_b.free_bytes;
  ASSERT_EQ(a_fewer, after_a.free_bytes <= after_b.free_bytes) << "free space moved too much";
  EXPECT_EQ(Value(*metrics_, "quantd_disk_size_bytes{dir=\"output\"}"),
            a_fewer ? before_a.size_bytes : before_b.size_bytes);
  ExpectFreeBetween(Value(*metrics_, "quantd_disk_free_bytes{dir=\"output\"}"),
                    a_fewer ? before_a : before_b, a_fewer ? after_a : after_b);
  // Once those jobs finish, the output series goes.
  board_.Put(JobWithOutput(1, v1::SUCCEEDED, dir_ + "/not/yet/created"));
  board_.Put(JobWithOutput(2, v1::FAILED, other + "/quantd-serve-monitor-test-absent"));
  monitor->RunOnce();
  EXPECT_TRUE(Samples(*metrics_, "quantd_disk_free_bytes{dir=\"output\"}").empty());
}

TEST_F(ServeMonitorTest, PingsWatchdogOnlyWhileHeartbeatIsFresh) {
  int pings = 0;
  ServeMonitorOptions options = Options();
  options.period = milliseconds(3'600'000);  // only the explicit rounds below
  options.max_heartbeat_age = milliseconds(200);
  options.watchdog = [&pings] { ++pings; };
  metrics_->SetJobCounts({});  // a heartbeat now
  std::unique_ptr<ServeMonitor> monitor = ServeMonitor::Start(std::move(options));
  EXPECT_EQ(pings, 1);
  std::this_thread::sleep_for(milliseconds(300));  // older than max_heartbeat_age
  monitor->RunOnce();
  EXPECT_EQ(pings, 1);
  metrics_->SetJobCounts({});
  monitor->RunOnce();
  EXPECT_EQ(pings, 2);
}

TEST_F(ServeMonitorTest, ThreadRunsRoundsUntilStop) {
  std::atomic<int> pings = 0;
  ServeMonitorOptions options = Options();
  options.period = milliseconds(10);
  options.max_heartbeat_age = milliseconds(3'600'000);
  options.watchdog = [&pings] { ++pings; };
  std::unique_ptr<ServeMonitor> monitor = ServeMonitor::Start(std::move(options));
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (pings.load() < 5 && absl::Now() < deadline) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_GE(pings.load(), 5);
  monitor->Stop();
  const int stopped_at = pings.load();
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(pings.load(), stopped_at);
  monitor->Stop();  // a second Stop does nothing
}

TEST_F(ServeMonitorTest, DiskSpaceUnderWalksUpToAnExistingParent) {
  const Statvfs fs = Stat(dir_);
  absl::StatusOr<checkpoint::DiskSpace> space = checkpoint::DiskSpaceUnder(dir_ + "/a/b/../c/");
  ASSERT_TRUE(space.ok()) << space.status();
  EXPECT_EQ(space->size_bytes, fs.size_bytes);
  // A regular file where a directory should be (ENOTDIR) also leads to the parent.
  std::ofstream(dir_ + "/file") << "x";
  space = checkpoint::DiskSpaceUnder(dir_ + "/file/sub");
  ASSERT_TRUE(space.ok()) << space.status();
  EXPECT_EQ(space->size_bytes, fs.size_bytes);
  const absl::StatusOr<checkpoint::DiskSpace> relative =
      checkpoint::DiskSpaceUnder("relative/dir");
  EXPECT_EQ(relative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(relative.status().message().find("relative/dir"), std::string::npos);
}

}  // namespace
}  // namespace quantd::ops
