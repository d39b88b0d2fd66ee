// OutputMarker: which directories a job may claim, the lock, and the foreign files it records.
#include "server/pipeline/output_marker.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/unit/test_dirs.h"

namespace quantd::pipeline {
namespace {

namespace fs = std::filesystem;
using OutputMarkerTest = testing_util::TempDirTest;

void Touch(const std::string& path) { std::ofstream(path) << "user data"; }

// While it lives, this process may write no byte to a file (RLIMIT_FSIZE 0, SIGXFSZ ignored): a
// write fails with EFBIG.
class NoFileWrites {
 public:
  NoFileWrites() {
    getrlimit(RLIMIT_FSIZE, &saved_);
    rlimit none = saved_;
    none.rlim_cur = 0;
    setrlimit(RLIMIT_FSIZE, &none);
    saved_handler_ = signal(SIGXFSZ, SIG_IGN);
  }
  ~NoFileWrites() {
    setrlimit(RLIMIT_FSIZE, &saved_);
    signal(SIGXFSZ, saved_handler_);
  }

 private:
  rlimit saved_;
  sighandler_t saved_handler_;
};

TEST_F(OutputMarkerTest, AbsentOrEmptyDirectoryIsClaimedAndResumable) {
  const std::string out = dir_ + "/out";
  {
    auto marker = OutputMarker::Claim("output", out, {3, 1000, "/state/quantd.db"}, false);
    ASSERT_TRUE(marker.ok()) << marker.status();
    EXPECT_TRUE(fs::is_regular_file(out + "/.quantd-job"));
    Touch(out + "/model-00001.safetensors");  // the job's own output
  }
  // The same job of the same store resumes there; nothing is foreign.
  auto again = OutputMarker::Claim("output", out, {3, 1000, "/state/quantd.db"}, false);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE((*again)->IsForeign("model-00001.safetensors"));
}

// A parent of the output swapped for a symbolic link (into another tenant's directory): the
// claim creates nothing behind it and names the field; the claimed directory is the handle the
// job writes beneath.
TEST_F(OutputMarkerTest, ParentSwappedForALinkIsRefusedAndNothingIsCreatedBehindIt) {
  const std::string victim = dir_ + "/victim";
  fs::create_directories(victim);
  fs::create_symlink(victim, dir_ + "/parent");
  auto marker =
      OutputMarker::Claim("output", dir_ + "/parent/out", {3, 1000, "/state/quantd.db"}, false);
  ASSERT_FALSE(marker.ok());
  EXPECT_EQ(marker.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(marker.status().message().rfind("output: " + dir_ + "/parent", 0), 0u)
      << marker.status();
  EXPECT_NE(marker.status().message().find("symbolic link"), std::string::npos);
  EXPECT_TRUE(fs::is_empty(victim));

  marker = OutputMarker::Claim("output", dir_ + "/a/b", {3, 1000, "/state/quantd.db"}, false);
  ASSERT_TRUE(marker.ok()) << marker.status();
  EXPECT_EQ((*marker)->dir().path(), dir_ + "/a/b");
  EXPECT_EQ((*marker)->dir().field(), "output");
  EXPECT_TRUE((*marker)->dir().CheckUnchanged().ok());
}

TEST_F(OutputMarkerTest, WithdrawUndoesOnlyWhatTheClaimCreated) {
  const JobIdentity job{3, 1000, "/state/quantd.db"};
  // A directory the claim created goes with its marker.
  const std::string created = dir_ + "/created";
  auto marker = OutputMarker::Claim("output", created, job, false);
  ASSERT_TRUE(marker.ok()) << marker.status();
  (*marker)->Withdraw();
  marker->reset();
  EXPECT_FALSE(fs::exists(created));

  // An existing directory stays, and so do the files that were there (overwrite).
  const std::string existing = dir_ + "/existing";
  fs::create_directories(existing);
  Touch(existing + "/notes.txt");
  marker = OutputMarker::Claim("output", existing, job, /*overwrite=*/true);
  ASSERT_TRUE(marker.ok()) << marker.status();
  (*marker)->Withdraw();
  marker->reset();
  EXPECT_FALSE(fs::exists(existing + "/.quantd-job"));
  EXPECT_TRUE(fs::is_regular_file(existing + "/notes.txt"));

  // The job's own marker from an earlier start is not this claim's: it stays.
  const std::string resumed = dir_ + "/resumed";
  marker = OutputMarker::Claim("output", resumed, job, false);
  ASSERT_TRUE(marker.ok()) << marker.status();
  marker->reset();
  marker = OutputMarker::Claim("output", resumed, job, false);
  ASSERT_TRUE(marker.ok()) << marker.status();
  (*marker)->Withdraw();
  marker->reset();
  EXPECT_TRUE(fs::is_regular_file(resumed + "/.quantd-job"));
}

TEST_F(OutputMarkerTest, ARefusedClaimRemovesOnlyTheDirectoryItCreated) {
  const JobIdentity job{3, 1000, "/state/quantd.db"};
  const std::string created = dir_ + "/created";
  const std::string existing = dir_ + "/existing";
  fs::create_directories(existing);
  {
    NoFileWrites no_writes;  // the marker cannot be written: Claim refuses after creating both
    auto marker = OutputMarker::Claim("output", created, job, false);
    EXPECT_EQ(marker.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(marker.status().message(),
              "output: " + created + "/.quantd-job: write failed: File too large");
    marker = OutputMarker::Claim("output", existing, job, false);
    EXPECT_EQ(marker.status().message(),
              "output: " + existing + "/.quantd-job: write failed: File too large");
  }
  EXPECT_FALSE(fs::exists(created));
  EXPECT_TRUE(fs::is_directory(existing));
  EXPECT_TRUE(fs::is_empty(existing));
}

TEST_F(OutputMarkerTest, OneWriterAtATime) {
  auto first = OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, false);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, false);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(second.status().message(),
            "output: " + dir_ + " is being written by another quantd process (" + dir_ +
                "/.quantd-job is locked)");
}

TEST_F(OutputMarkerTest, ForeignFilesNeedOverwriteAndAreNeverReplaced) {
  Touch(dir_ + "/notes.txt");
  Touch(dir_ + "/config.json");
  auto refused = OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, false);
  EXPECT_EQ(refused.status().message(),
            "output: " + dir_ + " is not empty (2 entries) and holds no quantd marker; use an "
            "empty directory, or set overwrite to write next to the files there (quantd never "
            "replaces or deletes them)");
  EXPECT_FALSE(fs::exists(dir_ + "/.quantd-job"));  // a refusal leaves nothing behind

  auto marker = OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, /*overwrite=*/true);
  ASSERT_TRUE(marker.ok()) << marker.status();
  EXPECT_TRUE((*marker)->IsForeign("notes.txt"));
  EXPECT_TRUE((*marker)->RefuseForeign({"model-00001.safetensors"}).ok());
  absl::Status s = (*marker)->RefuseForeign({"model-00001.safetensors", "config.json"});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "output: " + dir_ + "/config.json was there before quantd claimed the "
                         "directory and this job would replace it; quantd never replaces files "
                         "it did not write: move it away or use another directory");
  marker->reset();
  // The record survives a restart of the job.
  auto resumed = OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, true);
  ASSERT_TRUE(resumed.ok());
  EXPECT_TRUE((*resumed)->IsForeign("config.json"));
  EXPECT_FALSE((*resumed)->IsForeign(".quantd-job"));
}

TEST_F(OutputMarkerTest, AnUnmarkedDirectoryOfTheJobsOwnOutputsIsAdopted) {
  // What an earlier release left: two finished shards, an interrupted one's temporary file, and
  // a user's *.tmp file.
  Touch(dir_ + "/a.safetensors");
  Touch(dir_ + "/b.safetensors");
  Touch(dir_ + "/c.safetensors.tmp");
  Touch(dir_ + "/draft.tmp");
  OwnFiles own;
  own.outputs = {"a.safetensors", "b.safetensors"};
  own.written = {"a.safetensors", "b.safetensors", "c.safetensors", "config.json"};
  auto marker = OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, false, own);
  ASSERT_TRUE(marker.ok()) << marker.status();
  EXPECT_TRUE((*marker)->adopted());
  EXPECT_FALSE((*marker)->IsForeign("a.safetensors"));
  EXPECT_FALSE((*marker)->IsForeign("c.safetensors.tmp"));  // the job's own: swept, rewritten
  EXPECT_TRUE((*marker)->IsForeign("draft.tmp"));           // never deleted
  marker->reset();
  // Once marked, the directory is claimed as the job's, not adopted again.
  auto again = OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, false);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE((*again)->adopted());
  EXPECT_TRUE((*again)->IsForeign("draft.tmp"));
}

TEST_F(OutputMarkerTest, AnyOtherFileStopsTheAdoptionAndIsNamed) {
  Touch(dir_ + "/a.safetensors");
  Touch(dir_ + "/config.json");  // the job writes one, but has not finished it
  OwnFiles own;
  own.outputs = {"a.safetensors"};
  own.written = {"a.safetensors", "config.json"};
  auto refused = OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, false, own);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.status().message(),
            "output: " + dir_ + " is not empty (2 entries) and holds no quantd marker; " + dir_ +
                "/config.json is not an output this job finished (with its recorded size and "
                "SHA-256), so quantd does not adopt the directory; use an empty directory, or set "
                "overwrite to write next to the files there (quantd never replaces or deletes "
                "them)");
  EXPECT_FALSE(fs::exists(dir_ + "/.quantd-job"));
  // Without a finished output there, there is nothing to adopt.
  fs::remove(dir_ + "/config.json");
  own.outputs.clear();
  EXPECT_EQ(OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, false, own).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(OutputMarkerTest, AnotherJobsDirectoryIsRefused) {
  ASSERT_TRUE(OutputMarker::Claim("output", dir_, {1, 1000, "/a/quantd.db"}, false).ok());
  Touch(dir_ + "/model.safetensors");
  // Another id, another store, or the same id given again after the job was deleted.
  for (const JobIdentity& other_job : {JobIdentity{2, 1000, "/a/quantd.db"},
                                       JobIdentity{1, 1000, "/b/quantd.db"},
                                       JobIdentity{1, 2000, "/a/quantd.db"}}) {
    auto other = OutputMarker::Claim("materialize_bf16", dir_, other_job, false);
    EXPECT_EQ(other.status().message(),
              "materialize_bf16: " + dir_ + " holds the output of job 1 of /a/quantd.db; use an "
              "empty directory, or set overwrite to write next to the files there (quantd never "
              "replaces or deletes them)");
  }
}

TEST_F(OutputMarkerTest, APlantedSymlinkMarkerIsRefused) {
  Touch(dir_ + "/victim");
  fs::create_symlink(dir_ + "/victim", dir_ + "/.quantd-job");
  auto marker = OutputMarker::Claim("output", dir_, {1, 1000, "/s"}, true);
  EXPECT_EQ(marker.status().code(), absl::StatusCode::kFailedPrecondition);
  std::ifstream in(dir_ + "/victim");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "user data");
}

}  // namespace
}  // namespace quantd::pipeline
