#include "kernels/backend.h"

#include <utility>

namespace quantd::kernels {

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    if (deleter_ != nullptr && data_ != nullptr) deleter_(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    deleter_ = std::exchange(other.deleter_, nullptr);
  }
  return *this;
}

Buffer::~Buffer() {
  if (deleter_ != nullptr && data_ != nullptr) deleter_(data_);
}

}  // namespace quantd::kernels
