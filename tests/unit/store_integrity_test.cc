// JobStore::Open's checks of its own file: missing or empty databases, damaged pages, backups.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "server/store/job_store.h"
#include "tests/unit/test_dirs.h"

namespace quantd::store {
namespace {

namespace fs = std::filesystem;
using StoreIntegrityTest = testing_util::TempDirTest;

TEST_F(StoreIntegrityTest, MissingOrEmptyDatabaseIsRefusedWhenItMustExist) {
  const std::string db = dir_ + "/quantd.db";
  StoreOpenOptions options;
  options.must_exist = true;
  absl::Status s = JobStore::Open(db, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "state database " + db + " is missing but its state dir holds other "
                         "files: move it away and start with --init to begin an empty history");
  std::ofstream(db).close();
  s = JobStore::Open(db, options).status();
  EXPECT_EQ(s.message(), "state database " + db + " is empty (0 bytes) but its state dir holds "
                         "other files: move it away and start with --init to begin an empty "
                         "history");
  EXPECT_TRUE(JobStore::Open(db).ok());  // the default (quantd run, --init) creates it
}

TEST_F(StoreIntegrityTest, DamagedPagesAreDataLossNamingTheBackup) {
  const std::string db = dir_ + "/quantd.db", backup = dir_ + "/quantd.db.bak";
  StoreOpenOptions options;
  options.check_integrity = true;
  options.backup_path = backup;
  {
    auto store = JobStore::Open(db, options);
    ASSERT_TRUE(store.ok()) << store.status();
    for (int i = 0; i < 50; ++i) {
      ASSERT_TRUE((*store)->CreateJob("", std::string(2000, 'x'), i).ok());
    }
  }
  ASSERT_TRUE(JobStore::Open(db, options).ok());  // writes the backup of the 50 jobs
  ASSERT_TRUE(fs::is_regular_file(backup));
  const auto size = fs::file_size(db);
  {
    std::fstream f(db, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096);
    f << std::string(size - 4096, '\xa5');
  }
  absl::Status s = JobStore::Open(db, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  const std::string message(s.message());
  EXPECT_NE(message.find(db), std::string::npos) << message;
  EXPECT_NE(message.find("; quantd will not run on a damaged database: restore the backup " +
                         backup + " (written at the last start that passed this check)"),
            std::string::npos)
      << message;
  fs::copy_file(backup, db, fs::copy_options::overwrite_existing);
  auto restored = JobStore::Open(db, options);
  ASSERT_TRUE(restored.ok()) << restored.status();
  auto jobs = (*restored)->ListJobs(std::nullopt, 0, 100);
  ASSERT_TRUE(jobs.ok());
  EXPECT_EQ(jobs->size(), 50u);
}

}  // namespace
}  // namespace quantd::store
