// Scratch directories for tests: unique per test, tag and process, never shared between tests.
#ifndef QUANTD_TESTS_UNIT_TEST_DIRS_H_
#define QUANTD_TESTS_UNIT_TEST_DIRS_H_

#include <gtest/gtest.h>

#include <string>

namespace quantd::testing_util {

// A path for the running test (and `tag`) that does not exist yet; whatever is created there is
// removed when the test binary's last test has run.
std::string TestDir(const std::string& tag = "");

// A fixture whose tests each get an existing, empty directory `dir_`, removed after the test.
class TempDirTest : public testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  std::string dir_;  // this test's directory
};

}  // namespace quantd::testing_util

#endif  // QUANTD_TESTS_UNIT_TEST_DIRS_H_
