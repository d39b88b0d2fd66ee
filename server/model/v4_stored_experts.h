// A layer's routed experts copied once, in their stored form (MXFP4 / FP8 / NVFP4 codes and
// scales, or BF16 / F32 values), into one buffer of a backend's memory, and each expert decoded
// from there when the forward needs it (into the buffers of the expert before it). The CUDA ops
// keep one per layer on the device: one upload per layer instead of one per expert and batch,
// and only one expert decoded at a time. On a host backend the same steps run in host memory
// (what the CPU tests check the decode against RoutedExperts::Decode with).
#ifndef QUANTD_SERVER_MODEL_V4_STORED_EXPERTS_H_
#define QUANTD_SERVER_MODEL_V4_STORED_EXPERTS_H_

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/model/v4_moe.h"
#include "server/model/v4_weights.h"

namespace quantd::model {

class StoredExperts {
 public:
  // Every tensor starts at a multiple of this in the buffer (the dequant kernels' loads).
  static constexpr size_t kAlignment = 256;

  // Finds the stored tensors of every routed expert's w1, w2, w3 (checked as LoadLinear checks
  // them), copies them into one buffer of `backend` (each at a kAlignment offset) and releases
  // the source pages behind them. Errors name the tensor; ResourceExhausted names the bytes.
  static absl::StatusOr<StoredExperts> Upload(const RoutedExperts& experts,
                                              kernels::Backend& backend);

  // Whether this holds the experts `experts` names (the same checkpoint, prefix and count).
  bool Holds(const RoutedExperts& experts) const;
  // Bytes of the buffer: the stored tensors and their alignment.
  size_t bytes() const { return buffer_.size(); }
  int64_t size() const { return count_; }

  // Expert `e` decoded from the buffer into `previous`'s buffers where they are large enough:
  // the values RoutedExperts::Decode(e, previous) gives (BF16 / F32 experts are read in place).
  absl::StatusOr<ExpertWeights> Decode(int64_t e, ExpertWeights previous = {}) const;

 private:
  struct Linear {
    StoredLinear stored;
    size_t weight_offset = 0;  // in buffer_
    size_t scale_offset = 0;   // in buffer_; unused without scales
  };

  kernels::Backend* backend_ = nullptr;
  const V4Checkpoint* ckpt_ = nullptr;
  std::string prefix_;
  int64_t count_ = 0;
  std::vector<Linear> linears_;  // w1, w2, w3 of expert 0, then of expert 1, ...
  kernels::Buffer buffer_;
};

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_STORED_EXPERTS_H_
