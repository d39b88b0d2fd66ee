#include "tests/unit/test_dirs.h"

#include <unistd.h>

#include <filesystem>
#include <vector>

namespace quantd::testing_util {
namespace {

namespace fs = std::filesystem;

std::vector<std::string>& CreatedDirs() {
  static std::vector<std::string> dirs;
  return dirs;
}

// Removes every TestDir() after the last test of the binary.
class RemoveDirs : public testing::Environment {
 public:
  void TearDown() override {
    for (const std::string& d : CreatedDirs()) fs::remove_all(d);
  }
};
testing::Environment* const kRemoveDirs = testing::AddGlobalTestEnvironment(new RemoveDirs);

std::string UniqueName(const std::string& tag) {
  const testing::TestInfo* info = testing::UnitTest::GetInstance()->current_test_info();
  std::string name = "quantd_";
  if (info != nullptr) name += std::string(info->test_suite_name()) + "_" + info->name();
  if (!tag.empty()) name += "_" + tag;
  name += "_" + std::to_string(getpid());
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  return (fs::path(testing::TempDir()) / name).string();
}

}  // namespace

std::string TestDir(const std::string& tag) {
  const std::string dir = UniqueName(tag);
  fs::remove_all(dir);
  CreatedDirs().push_back(dir);
  return dir;
}

void TempDirTest::SetUp() {
  dir_ = UniqueName("");
  fs::remove_all(dir_);
  fs::create_directories(dir_);
}

void TempDirTest::TearDown() { fs::remove_all(dir_); }

}  // namespace quantd::testing_util
