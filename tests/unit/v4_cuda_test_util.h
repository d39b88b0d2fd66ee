// Helpers of the tests that check CUDA blocks of the DeepSeek-V4 forward against their CPU
// blocks: a fixture on device 0, device copies of host vectors, random inputs and bit-for-bit
// comparison. Only for builds with the CUDA headers (QUANTD_HAVE_CUDA_HEADERS).
#ifndef QUANTD_TESTS_UNIT_V4_CUDA_TEST_UTIL_H_
#define QUANTD_TESTS_UNIT_V4_CUDA_TEST_UTIL_H_

#include <cuda_runtime_api.h>
#include <stdint.h>
#include <string.h>

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/launch.h"

namespace quantd::testing_util {

// CUDA devices present (0 when the runtime finds none or no driver).
inline int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// A test on CUDA device 0 (skipped where there is none), with the DeviceResults that launchers
// reporting a first bad element write to.
class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&results_), sizeof(*results_)), cudaSuccess);
  }
  void TearDown() override {
    if (results_ != nullptr) cudaFree(results_);
  }
  void Sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }
  // The first_bad the last launch given results_ reported.
  unsigned long long FirstBad() {
    kernels::cuda::DeviceResults r{};
    EXPECT_EQ(cudaMemcpy(&r, results_, sizeof(r), cudaMemcpyDeviceToHost), cudaSuccess);
    return r.first_bad;
  }

  kernels::cuda::DeviceResults* results_ = nullptr;  // device memory
};

// A device copy of a host vector, freed with it.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& host) : size_(host.size()) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&data_), bytes()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data_, host.data(), bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceVector() { cudaFree(data_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  T* get() const { return data_; }
  std::vector<T> ToHost() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  size_t bytes() const { return size_ * sizeof(T); }
  size_t size_;
  T* data_ = nullptr;
};

// n normal values with standard deviation `scale`, the same for the same seed.
inline std::vector<float> RandomFloats(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Bit-for-bit equality, naming the first differing index.
inline void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (memcmp(&got[i], &want[i], 4) != 0) {
      ADD_FAILURE() << "index " << i << ": got " << got[i] << ", want " << want[i];
      return;
    }
  }
}

}  // namespace quantd::testing_util

#endif  // QUANTD_TESTS_UNIT_V4_CUDA_TEST_UTIL_H_
