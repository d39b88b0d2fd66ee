// Private state files (store/private_files.h): created 0600 / 0700 whatever the umask, existing
// ones made private without following a symbolic link, and the state database, its -wal and
// -shm, its backup and lock files private through JobStore::Open and FileLock.
#include "server/store/private_files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "server/store/file_lock.h"
#include "server/store/job_store.h"
#include "tests/unit/test_dirs.h"

namespace quantd::store {
namespace {

mode_t ModeOf(const std::string& path) {
  struct stat st;
  EXPECT_EQ(lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

void Touch(const std::string& path, mode_t mode) {
  std::ofstream(path) << "x";
  ASSERT_EQ(chmod(path.c_str(), mode), 0) << path;
}

// Runs the test body under a permissive umask, as a daemon started from a careless shell would.
class PrivateFilesTest : public testing_util::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    old_umask_ = umask(0);
  }
  void TearDown() override {
    umask(old_umask_);
    TempDirTest::TearDown();
  }

  mode_t old_umask_ = 0;
};

TEST_F(PrivateFilesTest, CreatesFilesAndDirectoriesPrivate) {
  const std::string file = dir_ + "/f";
  ASSERT_TRUE(CreatePrivateFile(file).ok());
  EXPECT_EQ(ModeOf(file), 0600u);
  EXPECT_TRUE(absl::IsAlreadyExists(CreatePrivateFile(file)));
  const std::string sub = dir_ + "/d";
  EXPECT_EQ(CreatePrivateDir(sub).value(), false);
  EXPECT_EQ(ModeOf(sub), 0700u);
  ASSERT_EQ(chmod(sub.c_str(), 0755), 0);
  EXPECT_EQ(CreatePrivateDir(sub).value(), true);  // an existing one made private
  EXPECT_EQ(ModeOf(sub), 0700u);
  EXPECT_EQ(CreatePrivateDir(file).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(PrivateFilesTest, MakePrivateClearsGroupAndOtherBitsAndLeavesLinksAlone) {
  const std::string file = dir_ + "/f";
  Touch(file, 0664);
  EXPECT_EQ(MakePrivate(file).value(), true);
  EXPECT_EQ(ModeOf(file), 0600u);
  EXPECT_EQ(MakePrivate(file).value(), false);
  const std::string target = dir_ + "/target";
  Touch(target, 0644);
  const std::string link = dir_ + "/link";
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  EXPECT_EQ(MakePrivate(link).value(), false);
  EXPECT_EQ(ModeOf(target), 0644u);
  EXPECT_EQ(MakePrivate(dir_ + "/missing").value(), false);
}

TEST_F(PrivateFilesTest, TheStoreAndItsLockArePrivate) {
  const std::string db = dir_ + "/state.db";
  {
    auto store = JobStore::Open(db, {.backup_path = dir_ + "/state.db.bak"});
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->CreateJob("", "{}", 1).ok());  // the -wal and -shm exist now
    for (const char* suffix : {"", "-wal", "-shm", ".bak"}) {
      EXPECT_EQ(ModeOf(db + suffix), 0600u) << suffix;
    }
  }
  // As an older release left them: readable by everyone, an empty -wal and -shm beside (what a
  // crash may leave).
  ASSERT_EQ(chmod(db.c_str(), 0644), 0);
  for (const char* suffix : {"-wal", "-shm"}) {
    std::ofstream(db + suffix).flush();
    ASSERT_EQ(chmod((db + suffix).c_str(), 0644), 0);
  }
  auto store = JobStore::Open(db);
  ASSERT_TRUE(store.ok()) << store.status();
  for (const char* suffix : {"", "-wal", "-shm"}) EXPECT_EQ(ModeOf(db + suffix), 0600u) << suffix;
  EXPECT_EQ((*store)->GetJob(1)->spec_json, "{}");
  const std::string lock = dir_ + "/state.db.lock";
  Touch(lock, 0644);
  bool held = false;
  auto locked = FileLock::Acquire(lock, &held);
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_EQ(ModeOf(lock), 0600u);
}

}  // namespace
}  // namespace quantd::store
