// FileLock: one holder at a time, the second told that the lock is held elsewhere, released with
// the FileLock; a path that cannot be opened is named.
#include "server/store/file_lock.h"

#include <gtest/gtest.h>

#include "tests/unit/test_dirs.h"

namespace quantd::store {
namespace {

class FileLockTest : public testing_util::TempDirTest {};

TEST_F(FileLockTest, OneHolderAtATimeUntilReleased) {
  const std::string path = dir_ + "/state.lock";
  bool held = true;
  auto first = FileLock::Acquire(path, &held);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(held);
  // flock locks belong to the open file description: a second Acquire conflicts like a second
  // process would.
  auto second = FileLock::Acquire(path, &held);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(held);
  EXPECT_EQ(second.status().message(),
            "cannot lock " + path + ": Resource temporarily unavailable");
  first->reset();
  auto third = FileLock::Acquire(path, &held);
  EXPECT_TRUE(third.ok()) << third.status();
  EXPECT_FALSE(held);
}

TEST_F(FileLockTest, UnopenablePathIsNamed) {
  bool held = true;
  const std::string path = dir_ + "/missing/dir/state.lock";
  auto lock = FileLock::Acquire(path, &held);
  EXPECT_EQ(lock.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(held);
  EXPECT_EQ(lock.status().message(), "cannot open " + path + ": No such file or directory");
}

}  // namespace
}  // namespace quantd::store
