// The tiny DeepSeek-V4 fixture checkpoint (mkfixture preset tiny, seed 7: hash, CSA and HCA
// layers) written to each test's directory and opened, with a one-thread CPU device: the setup
// of the tests that run the V4 forward.
#ifndef QUANTD_TESTS_UNIT_V4_TINY_CHECKPOINT_H_
#define QUANTD_TESTS_UNIT_V4_TINY_CHECKPOINT_H_

#include <memory>

#include "gtest/gtest.h"
#include "server/compute/device.h"
#include "server/fixture/fixture.h"
#include "server/model/v4_weights.h"
#include "tests/unit/test_dirs.h"

namespace quantd::testing_util {

class V4TinyCheckpointTest : public TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    const fixture::FixtureConfig fc =
        fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny);
    ASSERT_TRUE(fixture::WriteFixture(fc, 7, dir_ + "/ckpt", {}).ok());
    auto ckpt = model::OpenV4Checkpoint(dir_ + "/ckpt");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ckpt_ = std::move(*ckpt);
    auto device = compute::OpenDevice("cpu", {.cpu_threads = 1});
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = std::move(*device);
  }

  std::unique_ptr<model::V4Checkpoint> ckpt_;  // dir_/ckpt, opened
  std::unique_ptr<compute::Device> device_;    // "cpu", one thread
};

}  // namespace quantd::testing_util

#endif  // QUANTD_TESTS_UNIT_V4_TINY_CHECKPOINT_H_
