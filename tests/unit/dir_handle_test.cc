// checkpoint::DirHandle, with openat2 and with the O_NOFOLLOW walk that stands in for it on
// kernels without it: names resolve beneath the handle only, a symbolic link is never followed,
// and a directory swapped for a symbolic link (into another tenant's model) between any two
// system calls of the layer never lets a write, rename or delete reach the other side.
#include "server/checkpoint/dir_handle.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "server/checkpoint/atomic_file.h"
#include "tests/unit/test_dirs.h"

namespace quantd::checkpoint {
namespace {

namespace fs = std::filesystem;

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class DirHandleTest : public testing_util::TempDirTest,
                      public testing::WithParamInterface<ResolveMode> {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    SetResolveModeForTesting(GetParam());
    out_ = dir_ + "/out";
    victim_ = dir_ + "/victim";
    fs::create_directories(out_ + "/sub");
    fs::create_directories(victim_);
    WriteText(victim_ + "/model.safetensors", "victim's shard");
  }
  void TearDown() override {
    SetStepHookForTesting({});
    SetResolveModeForTesting(ResolveMode::kAuto);
    TempDirTest::TearDown();
  }

  // The victim's directory exactly as SetUp left it.
  void ExpectVictimUntouched() {
    EXPECT_EQ(Names(victim_), std::vector<std::string>{"model.safetensors"});
    EXPECT_EQ(ReadText(victim_ + "/model.safetensors"), "victim's shard");
  }

  std::string out_;     // the job's output directory
  std::string victim_;  // another tenant's model
};

TEST_P(DirHandleTest, ModeIsTheOneSelected) { EXPECT_EQ(ActiveResolveMode(), GetParam()); }

TEST_P(DirHandleTest, WritesRenamesListsAndRemovesBeneath) {
  absl::StatusOr<DirHandle> out = DirHandle::Open("output", out_);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->field(), "output");
  EXPECT_EQ(out->PathOf("sub/a"), out_ + "/sub/a");
  ASSERT_TRUE(out->MakeDirs("x/y").ok());
  ASSERT_TRUE(WriteFileAtomicallyAt(*out, "x/y/config.json", "{}\n").ok());
  EXPECT_EQ(ReadText(out_ + "/x/y/config.json"), "{}\n");
  EXPECT_FALSE(fs::exists(out_ + "/x/y/config.json.tmp"));

  absl::StatusOr<int> fd = out->CreateForWrite("sub/a.tmp");
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_TRUE(WriteFully(*fd, "abc", 3, "a.tmp").ok());
  ASSERT_TRUE(SyncAndClose(*fd, "a.tmp").ok());
  ASSERT_TRUE(out->Rename("sub/a.tmp", "sub/a").ok());
  EXPECT_EQ(ReadText(out_ + "/sub/a"), "abc");

  absl::StatusOr<std::vector<DirEntry>> list = out->List("sub");
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "a");
  EXPECT_EQ((*list)[0].type, static_cast<mode_t>(S_IFREG));
  list = out->List();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].name, "sub");
  EXPECT_EQ((*list)[0].type, static_cast<mode_t>(S_IFDIR));
  EXPECT_EQ((*list)[1].name, "x");

  struct stat st;
  fd = out->OpenRegularFile("sub/a", &st);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(st.st_size, 3);
  close(*fd);
  absl::StatusOr<DirHandle> sub = out->OpenSubdir("sub");
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ(sub->path(), out_ + "/sub");
  ASSERT_TRUE(sub->Remove("a").ok());
  EXPECT_EQ(out->Remove("sub/a").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(out->Remove("sub", /*directory=*/true).ok());
  EXPECT_FALSE(fs::exists(out_ + "/sub"));
  EXPECT_TRUE(out->Sync().ok());
  EXPECT_TRUE(out->CheckUnchanged().ok());
}

// Two writers of one file (two daemons' jobs naming one calibration.amax_out): without `replace`
// the first file stays, the second writer is told AlreadyExists and leaves no temporary file.
TEST_P(DirHandleTest, AWriteThatMayNotReplaceKeepsTheFileThere) {
  absl::StatusOr<DirHandle> out = DirHandle::Open("calibration.amax_out", out_);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE(WriteFileAtomicallyAt(*out, "amax.json", "first\n", /*replace=*/false).ok());
  const absl::Status second = WriteFileAtomicallyAt(*out, "amax.json", "second\n", false);
  EXPECT_EQ(second.code(), absl::StatusCode::kAlreadyExists) << second;
  EXPECT_TRUE(absl::StartsWith(second.message(), "calibration.amax_out: " + out_ + "/amax.json"))
      << second;
  EXPECT_EQ(ReadText(out_ + "/amax.json"), "first\n");
  EXPECT_FALSE(fs::exists(out_ + "/amax.json.tmp"));
  ASSERT_TRUE(WriteFileAtomicallyAt(*out, "amax.json", "third\n").ok());  // replace: the default
  EXPECT_EQ(ReadText(out_ + "/amax.json"), "third\n");
}

TEST_P(DirHandleTest, RefusesNamesThatAreNotPlainRelativePaths) {
  absl::StatusOr<DirHandle> out = DirHandle::Open("output", out_);
  ASSERT_TRUE(out.ok());
  for (const char* rel : {"", "/etc/passwd", "../victim/model.safetensors", "sub/../../victim",
                          "./a", "sub//a", "sub/"}) {
    absl::StatusOr<int> fd = out->CreateForWrite(rel);
    ASSERT_FALSE(fd.ok()) << rel;
    EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument) << rel;
    EXPECT_NE(fd.status().message().find("output: "), std::string::npos) << fd.status();
  }
  ExpectVictimUntouched();
}

TEST_P(DirHandleTest, RefusesSymbolicLinksBeneath) {
  fs::create_symlink(victim_, out_ + "/linked_dir");
  fs::create_symlink(victim_ + "/model.safetensors", out_ + "/model.safetensors");
  absl::StatusOr<DirHandle> out = DirHandle::Open("output", out_);
  ASSERT_TRUE(out.ok());
  const std::string expected_start = "output: " + out_ + "/";
  for (const char* rel : {"model.safetensors", "linked_dir/model.safetensors", "linked_dir/new"}) {
    absl::StatusOr<int> fd = out->CreateForWrite(rel);
    ASSERT_FALSE(fd.ok()) << rel;
    EXPECT_EQ(fd.status().code(), absl::StatusCode::kFailedPrecondition) << fd.status();
    EXPECT_EQ(fd.status().message().rfind(expected_start + rel, 0), 0u) << fd.status();
    EXPECT_NE(fd.status().message().find("symbolic link"), std::string::npos) << fd.status();
  }
  struct stat st;
  EXPECT_EQ(out->OpenRegularFile("model.safetensors", &st).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(out->MakeDirs("linked_dir/x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(out->List("linked_dir").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(out->OpenSubdir("linked_dir").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(out->Remove("linked_dir/model.safetensors").code(),
            absl::StatusCode::kFailedPrecondition);
  WriteText(out_ + "/mine", "x");
  EXPECT_EQ(out->Rename("mine", "linked_dir/mine").code(), absl::StatusCode::kFailedPrecondition);
  // A rename over a link replaces the link, never its target.
  ASSERT_TRUE(out->Rename("mine", "model.safetensors").ok());
  EXPECT_EQ(ReadText(out_ + "/model.safetensors"), "x");
  ExpectVictimUntouched();
}

TEST_P(DirHandleTest, OpenRefusesALinkInThePath) {
  fs::create_symlink(out_, dir_ + "/out_link");
  absl::StatusOr<DirHandle> out = DirHandle::Open("output", dir_ + "/out_link");
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(out.status().message().rfind("output: " + dir_ + "/out_link: cannot open", 0), 0u)
      << out.status();
  out = DirHandle::Open("output", dir_ + "/out_link/sub");
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DirHandle::Open("output", dir_ + "/missing").status().code(),
            absl::StatusCode::kNotFound);
}

// The job's directory renamed away and a link to the victim put in its place: the job keeps
// writing into its own directory, and CheckUnchanged says the path changed, naming the field.
TEST_P(DirHandleTest, SwappedDirectoryIsNoticedAndNeverWrittenThrough) {
  absl::StatusOr<DirHandle> out = DirHandle::Open("output", out_);
  ASSERT_TRUE(out.ok());
  fs::rename(out_, out_ + ".old");
  fs::create_symlink(victim_, out_);
  ASSERT_TRUE(WriteFileAtomicallyAt(*out, "model.safetensors", "alice's shard").ok());
  EXPECT_EQ(ReadText(out_ + ".old/model.safetensors"), "alice's shard");
  ExpectVictimUntouched();
  absl::Status changed = out->CheckUnchanged();
  EXPECT_EQ(changed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(changed.message().rfind("output: " + out_ + " no longer names the directory", 0), 0u)
      << changed;
  // Replaced by another real directory: named too.
  fs::remove(out_);
  fs::create_directory(out_);
  changed = out->CheckUnchanged();
  EXPECT_EQ(changed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(changed.message().rfind("output: " + out_ + " names another directory", 0), 0u)
      << changed;
}

// What a shard writer does: a tmp file in a subdirectory, written, renamed over the shard.
absl::Status WriteShard(const DirHandle& out) {
  return WriteFileAtomicallyAt(out, "sub/model.safetensors", "alice's shard");
}

// Swaps `dir` for a symbolic link to `target` (the directory stays, renamed to dir + ".old").
void SwapForLink(const std::string& dir, const std::string& target) {
  fs::rename(dir, dir + ".old");
  fs::create_symlink(target, dir);
}

// The number of steps `op` takes (no swap).
int CountSteps(const std::function<absl::Status()>& op) {
  int steps = 0;
  SetStepHookForTesting([&](int) { ++steps; });
  EXPECT_TRUE(op().ok());
  SetStepHookForTesting({});
  return steps;
}

// A subdirectory of the output swapped for a link to the victim before each step in turn: the
// operation fails naming the field and the link, or completes in the job's own directory.
TEST_P(DirHandleTest, SubdirectorySwappedBetweenAnyTwoCallsIsRefused) {
  const int steps = CountSteps([&] {
    absl::StatusOr<DirHandle> out = DirHandle::Open("output", out_);
    return out.ok() ? WriteShard(*out) : out.status();
  });
  ASSERT_GE(steps, 4);
  for (int k = 0; k < steps; ++k) {
    SCOPED_TRACE("swap before step " + std::to_string(k));
    fs::remove_all(out_);
    fs::create_directories(out_ + "/sub");
    bool swapped = false;
    SetStepHookForTesting([&](int step) {
      if (step == k && !swapped) {
        SwapForLink(out_ + "/sub", victim_);
        swapped = true;
      }
    });
    absl::StatusOr<DirHandle> out = DirHandle::Open("output", out_);
    const absl::Status written = out.ok() ? WriteShard(*out) : out.status();
    SetStepHookForTesting({});
    EXPECT_TRUE(swapped);
    ExpectVictimUntouched();
    if (written.ok()) {
      EXPECT_EQ(ReadText(out_ + "/sub.old/model.safetensors"), "alice's shard");
    } else {
      EXPECT_EQ(written.code(), absl::StatusCode::kFailedPrecondition) << written;
      EXPECT_EQ(written.message().rfind("output: " + out_ + "/sub", 0), 0u) << written;
      EXPECT_NE(written.message().find("symbolic link"), std::string::npos) << written;
    }
  }
}

// The output directory itself swapped before each step in turn: every write lands in the job's
// own directory, and CheckUnchanged names the field afterwards.
TEST_P(DirHandleTest, OutputSwappedBetweenAnyTwoCallsNeverReachesTheVictim) {
  const int steps = CountSteps([&] {
    absl::StatusOr<DirHandle> out = DirHandle::Open("output", out_);
    return out.ok() ? WriteShard(*out) : out.status();
  });
  for (int k = 0; k < steps; ++k) {
    SCOPED_TRACE("swap before step " + std::to_string(k));
    fs::remove_all(out_);  // the link, or the directory
    fs::remove_all(out_ + ".old");
    fs::create_directories(out_ + "/sub");
    bool swapped = false;
    SetStepHookForTesting([&](int step) {
      if (step == k && !swapped) {
        SwapForLink(out_, victim_);
        swapped = true;
      }
    });
    absl::StatusOr<DirHandle> out = DirHandle::Open("output", out_);
    absl::Status status = out.ok() ? WriteShard(*out) : out.status();
    SetStepHookForTesting({});
    ExpectVictimUntouched();
    if (!status.ok()) {
      // Swapped while the handle was being opened: the link is refused.
      EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
      EXPECT_EQ(status.message().rfind("output: " + out_, 0), 0u) << status;
      continue;
    }
    EXPECT_EQ(ReadText(out_ + ".old/sub/model.safetensors"), "alice's shard");
    status = out->CheckUnchanged();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_EQ(status.message().rfind("output: " + out_, 0), 0u) << status;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, DirHandleTest,
                         testing::Values(ResolveMode::kOpenat2, ResolveMode::kWalk),
                         [](const testing::TestParamInfo<ResolveMode>& info) {
                           return info.param == ResolveMode::kOpenat2 ? std::string("Openat2")
                                                                      : std::string("Walk");
                         });

}  // namespace
}  // namespace quantd::checkpoint
