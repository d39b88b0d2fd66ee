// job_paths.h: path text limits, resolution, and overlap by components and by device/inode.
#include "server/job/job_paths.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/unit/test_dirs.h"

namespace quantd::job {
namespace {

namespace fs = std::filesystem;
using JobPathsTest = testing_util::TempDirTest;

TEST(CheckPathTextTest, AcceptsWellFormedUtf8AndRefusesTheRest) {
  EXPECT_TRUE(CheckPathText("output", "/models/Ünïcödé/日本/😀").ok());
  for (const char* bad : {
           "\xff",
           "\xc3",              // truncated
           "\xc0\xaf",          // overlong '/'
           "\xe0\x80\xaf",      // overlong '/', 3 bytes
           "\xed\xa0\x80",      // a surrogate
           "\xf4\x90\x80\x80",  // beyond U+10FFFF
           "a\x80" "b",         // a lone continuation byte
       }) {
    EXPECT_EQ(CheckPathText("output", bad).message(), "output: is not valid UTF-8") << bad;
  }
}

TEST(CheckPathTextTest, NamesTheFieldNeverTheText) {
  EXPECT_TRUE(CheckPathText("source", std::string(kMaxPathBytes, 'a')).ok());
  absl::Status s = CheckPathText("source", std::string(kMaxPathBytes + 1, 'a'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "source: 4096 bytes, longer than the limit of 4095 (PATH_MAX)");
  EXPECT_EQ(CheckPathText("output", "/a\xff").message(), "output: is not valid UTF-8");
  EXPECT_EQ(CheckPathText("output", std::string("/a\0b", 4)).message(),
            "output: contains a NUL byte");
}

JobSpec Spec(const std::string& source, const std::string& output) {
  JobSpec spec;
  spec.source = source;
  spec.output = output;
  return spec;
}

TEST_F(JobPathsTest, EverySpellingOfTheSourceIsRefusedAsOutput) {
  const std::string model = dir_ + "/model";
  fs::create_directories(model);
  fs::create_directory_symlink(model, dir_ + "/link");
  struct Case {
    std::string output;
    std::string how;
  };
  for (const Case& c : {Case{model, "is"}, Case{model + "/", "is"}, Case{model + "/./", "is"},
                        Case{model + "/../model", "is"}, Case{dir_ + "/link", "is"},
                        Case{dir_ + "/link/q", "lies inside"}, Case{model + "/a/b", "lies inside"},
                        Case{dir_, "contains"}}) {
    JobSpec spec = Spec(model + "/", c.output);
    absl::Status s = ResolveJobPaths(&spec, /*allow_relative=*/false);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.output;
    EXPECT_EQ(s.message(),
              "output: " + spec.output + " " + c.how + " the source directory " + model)
        << c.output;
  }
}

TEST_F(JobPathsTest, ResolvesToCanonicalAbsolutePaths) {
  fs::create_directories(dir_ + "/model");
  fs::create_directory_symlink(dir_ + "/model", dir_ + "/link");
  JobSpec spec = Spec(dir_ + "/link/", dir_ + "/x/../out/");
  spec.calibration.amax_file = dir_ + "/./amax.json";
  ASSERT_TRUE(ResolveJobPaths(&spec, false).ok());
  EXPECT_EQ(spec.source, dir_ + "/model");
  EXPECT_EQ(spec.output, dir_ + "/out");
  EXPECT_EQ(spec.calibration.amax_file, dir_ + "/amax.json");

  JobSpec relative = Spec("model", "out");
  EXPECT_EQ(ResolveJobPaths(&relative, false).message(),
            "source: must be an absolute path (the daemon does not know the caller's directory)");
  const fs::path cwd = fs::current_path();
  fs::current_path(dir_);
  absl::Status s = ResolveJobPaths(&relative, /*allow_relative=*/true);
  fs::current_path(cwd);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(relative.source, dir_ + "/model");
}

TEST_F(JobPathsTest, CalibrationPathsAreResolvedAndNamed) {
  fs::create_directories(dir_ + "/model");
  fs::create_directories(dir_ + "/cal");
  fs::create_directory_symlink(dir_ + "/cal", dir_ + "/cal-link");
  JobSpec spec = Spec(dir_ + "/model", dir_ + "/out");
  spec.calibration.datasets = {{dir_ + "/cal-link/news.jsonl", 8}, {dir_ + "/x/../chat.jsonl", 0}};
  spec.calibration.amax_out = dir_ + "/cal/./amax.json";
  ASSERT_TRUE(ResolveJobPaths(&spec, false).ok());
  EXPECT_EQ(spec.calibration.datasets[0].path, dir_ + "/cal/news.jsonl");
  EXPECT_EQ(spec.calibration.datasets[1].path, dir_ + "/chat.jsonl");
  EXPECT_EQ(spec.calibration.amax_out, dir_ + "/cal/amax.json");

  spec = Spec(dir_ + "/model", dir_ + "/out");
  spec.calibration.datasets = {{dir_ + "/a.jsonl", 0}, {"b.jsonl", 0}};
  EXPECT_EQ(ResolveJobPaths(&spec, false).message(),
            "calibration.datasets[1].path: must be an absolute path (the daemon does not know the "
            "caller's directory)");
  spec = Spec(dir_ + "/model", dir_ + "/out");
  spec.calibration.amax_out = "amax.json";
  EXPECT_EQ(ResolveJobPaths(&spec, false).message(),
            "calibration.amax_out: must be an absolute path (the daemon does not know the "
            "caller's directory)");
}

TEST_F(JobPathsTest, AmaxOutMustNotOverwriteTheSourceOrAnInput) {
  fs::create_directories(dir_ + "/model");
  fs::create_directory_symlink(dir_ + "/model", dir_ + "/link");
  struct Case {
    std::string amax_out;
    std::string error;
  };
  for (const Case& c :
       {Case{dir_ + "/link/amax.json",
             "calibration.amax_out: " + dir_ +
                 "/model/amax.json lies inside the source directory " + dir_ + "/model"},
        Case{dir_ + "/model/",
             "calibration.amax_out: " + dir_ + "/model is the source directory " + dir_ +
                 "/model"},
        Case{dir_ + "/in.json",
             "calibration.amax_out: " + dir_ + "/in.json is calibration.amax_file; the job "
             "would overwrite its input"},
        Case{dir_ + "/./b.jsonl",
             "calibration.amax_out: " + dir_ + "/b.jsonl is calibration.datasets[1].path; the "
             "job would overwrite its input"},
        Case{dir_ + "/out",
             "calibration.amax_out: " + dir_ + "/out is a directory; name the file to write"}}) {
    fs::create_directories(dir_ + "/out");
    JobSpec spec = Spec(dir_ + "/model", dir_ + "/output");
    spec.calibration.amax_file = dir_ + "/in.json";
    spec.calibration.datasets = {{dir_ + "/a.jsonl", 0}, {dir_ + "/b.jsonl", 0}};
    spec.calibration.amax_out = c.amax_out;
    absl::Status s = ResolveJobPaths(&spec, false);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.amax_out;
    EXPECT_EQ(s.message(), c.error) << c.amax_out;
  }
  // A hard link to an input is that input.
  std::ofstream(dir_ + "/a.jsonl") << "{}\n";
  fs::create_hard_link(dir_ + "/a.jsonl", dir_ + "/hard.jsonl");
  JobSpec spec = Spec(dir_ + "/model", dir_ + "/output");
  spec.calibration.dataset = dir_ + "/a.jsonl";
  spec.calibration.amax_out = dir_ + "/hard.jsonl";
  EXPECT_EQ(ResolveJobPaths(&spec, false).message(),
            "calibration.amax_out: " + dir_ + "/hard.jsonl is calibration.dataset; the job would "
            "overwrite its input");
  // Inside the job's own output is fine.
  spec.calibration.amax_out = dir_ + "/output/amax.json";
  EXPECT_TRUE(ResolveJobPaths(&spec, false).ok());
}

TEST_F(JobPathsTest, MaterializeBf16MustNotOverlapSourceOrOutput) {
  fs::create_directories(dir_ + "/model");
  JobSpec spec = Spec(dir_ + "/model", dir_ + "/out");
  spec.materialize_bf16 = dir_ + "/model/";
  EXPECT_EQ(ResolveJobPaths(&spec, false).message(),
            "materialize_bf16: " + dir_ + "/model is the source directory " + dir_ + "/model");
  spec = Spec(dir_ + "/model", dir_ + "/out");
  spec.materialize_bf16 = dir_ + "/out/bf16";
  EXPECT_EQ(ResolveJobPaths(&spec, false).message(),
            "materialize_bf16: " + dir_ + "/out/bf16 lies inside the output directory " + dir_ +
                "/out");
}

TEST_F(JobPathsTest, APathSwappedForASymlinkAfterSubmitIsRefusedAtStart) {
  fs::create_directories(dir_ + "/model");
  fs::create_directories(dir_ + "/allowed");
  fs::create_directories(dir_ + "/secret");
  JobSpec spec = Spec(dir_ + "/model", dir_ + "/allowed/out");
  spec.calibration.amax_file = dir_ + "/allowed/amax.json";
  ASSERT_TRUE(ResolveJobPaths(&spec, false).ok());
  EXPECT_TRUE(CheckJobPathsUnchanged(spec).ok());
  // After the submit, the output becomes a symlink out of the allowed root.
  fs::create_directory_symlink(dir_ + "/secret", dir_ + "/allowed/out");
  absl::Status s = CheckJobPathsUnchanged(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "output: " + dir_ + "/allowed/out now leads through the symbolic link " +
                             dir_ + "/allowed/out (to " + dir_ +
                             "/secret), which was not there when the job was submitted; quantd "
                             "does not follow it");
  fs::remove(dir_ + "/allowed/out");
  // Likewise a dangling link to a file, and a directory above a path.
  fs::create_symlink(dir_ + "/secret/key", dir_ + "/allowed/amax.json");
  EXPECT_EQ(CheckJobPathsUnchanged(spec).message(),
            "calibration.amax_file: " + dir_ + "/allowed/amax.json now leads through the "
            "symbolic link " + dir_ + "/allowed/amax.json (to " + dir_ +
                "/secret/key), which was not there when the job was submitted; quantd does not "
                "follow it");
  fs::remove(dir_ + "/allowed/amax.json");
  fs::rename(dir_ + "/allowed", dir_ + "/allowed.real");
  fs::create_directory_symlink(dir_ + "/secret", dir_ + "/allowed");
  EXPECT_EQ(CheckJobPathsUnchanged(spec).message(),
            "output: " + dir_ + "/allowed/out now leads through the symbolic link " + dir_ +
                "/allowed (to " + dir_ +
                "/secret), which was not there when the job was submitted; quantd does not "
                "follow it");
  // A spec an earlier release stored with relative paths is only checked for overlaps.
  JobSpec relative = Spec("model", "model/out");
  EXPECT_EQ(CheckJobPathsUnchanged(relative).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(CheckJobPathsUnchanged(Spec("model", "out")).ok());
}

TEST_F(JobPathsTest, OtherJobsOutputsAreRefused) {
  fs::create_directories(dir_ + "/model");
  std::vector<ClaimedDir> claimed = {{7, dir_ + "/out"}};
  JobSpec spec = Spec(dir_ + "/model", dir_ + "/out/sub");
  absl::Status s = CheckDirsUnclaimed(spec, claimed);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "output: " + dir_ + "/out/sub lies inside " + dir_ +
                             "/out, an output of job 7 (delete that job first to reuse its "
                             "directory)");
  spec = Spec(dir_ + "/model", dir_ + "/other");
  EXPECT_TRUE(CheckDirsUnclaimed(spec, claimed).ok());
  spec.materialize_bf16 = dir_;
  EXPECT_EQ(CheckDirsUnclaimed(spec, claimed).message(),
            "materialize_bf16: " + dir_ + " contains " + dir_ + "/out, an output of job 7 "
            "(delete that job first to reuse its directory)");
  spec.materialize_bf16.clear();
  spec.calibration.amax_out = dir_ + "/out/amax.json";
  s = CheckDirsUnclaimed(spec, claimed);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "calibration.amax_out: " + dir_ + "/out/amax.json lies inside " + dir_ +
                             "/out, an output of job 7 (delete that job first to reuse its "
                             "directory)");
}

}  // namespace
}  // namespace quantd::job
