#include "server/compute/device.h"

#include "gtest/gtest.h"
#include "kernels/backends.h"
#include "kernels/gemm.h"
#include "server/compute/requirement.h"

namespace quantd::compute {
namespace {

TEST(DeviceTest, CpuDeviceReportsItsBudgetAndIsHostVisible) {
  auto device = OpenDevice("cpu", {.cpu_threads = 1, .host_memory_bytes = int64_t{8} << 30});
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ((*device)->kind(), DeviceKind::kCpu);
  EXPECT_EQ((*device)->name(), "cpu");
  EXPECT_STREQ(DeviceKindName((*device)->kind()), "cpu");
  EXPECT_TRUE((*device)->host_visible());
  EXPECT_EQ((*device)->total_memory_bytes(), int64_t{8} << 30);
  auto free = (*device)->free_memory_bytes();
  ASSERT_TRUE(free.ok());
  EXPECT_GT(*free, 0);
  EXPECT_LT(*free, int64_t{8} << 30);  // this process holds some of it
  ASSERT_NE((*device)->gemm(), nullptr);
  EXPECT_EQ((*device)->gemm()->name(), "openblas");
}

TEST(DeviceTest, RefusesUnknownNamesAndMissingCudaDevices) {
  auto bad = OpenDevice("gpu0", {});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("gpu0"), std::string::npos);
  if (kernels::CudaDeviceCount() == 0) {
    EXPECT_EQ(OpenDevice("cuda:0", {}).status().code(), absl::StatusCode::kUnavailable);
  }
}

TEST(DeviceTest, FitsChecksKindAndMemoryAlreadyReserved) {
  auto cpu = OpenDevice("cpu", {.cpu_threads = 1, .host_memory_bytes = 1000});
  ASSERT_TRUE(cpu.ok());
  EXPECT_TRUE(Fits(**cpu, {}, 0));
  EXPECT_FALSE(Fits(**cpu, {.gpu = true}, 0));
  EXPECT_TRUE(Fits(**cpu, {.memory_bytes = 600}, 400));
  EXPECT_FALSE(Fits(**cpu, {.memory_bytes = 601}, 400));
}

}  // namespace
}  // namespace quantd::compute
