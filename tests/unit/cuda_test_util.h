// Helpers of the CUDA unit tests (builds with CUDA headers only): whether a device is present
// and device copies of host vectors.
#ifndef QUANTD_TESTS_UNIT_CUDA_TEST_UTIL_H_
#define QUANTD_TESTS_UNIT_CUDA_TEST_UTIL_H_

#include <cuda_runtime_api.h>
#include <stddef.h>

#include <vector>

#include <gtest/gtest.h>

namespace quantd::testing_util {

// CUDA devices present (0 when the runtime or driver is missing).
inline int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

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

}  // namespace quantd::testing_util

#endif  // QUANTD_TESTS_UNIT_CUDA_TEST_UTIL_H_
