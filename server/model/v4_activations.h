// The state of a batch between DeepSeek-V4 decoder layers: hc_mult residual streams of
// hidden_size values per token, plus the token ids (hash-routed layers and the MTP block need
// them). Kept in host memory, or spilled to a safetensors file and read back bit-identically.
#ifndef QUANTD_SERVER_MODEL_V4_ACTIVATIONS_H_
#define QUANTD_SERVER_MODEL_V4_ACTIVATIONS_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace quantd::model {

struct V4Activations {
  int64_t sequences = 0;  // samples in the batch, all of length seq_len
  int64_t seq_len = 0;
  int64_t hc_mult = 0;
  int64_t hidden_size = 0;
  std::vector<int32_t> token_ids;  // [sequences, seq_len]
  std::vector<float> streams;      // [sequences, seq_len, hc_mult, hidden_size]

  int64_t tokens() const { return sequences * seq_len; }
};

// Writes `acts` to `path` (atomically: tmp + fsync + rename) as safetensors with tensors
// "token_ids" I32 [sequences, seq_len] and "streams" F32 [sequences, seq_len, hc, hidden].
absl::Status SpillActivations(const V4Activations& acts, const std::string& path);

// Reads a file written by SpillActivations. InvalidArgument (naming the file and tensor) when a
// tensor is missing, has another dtype, or the shapes disagree.
absl::StatusOr<V4Activations> ReadActivations(const std::string& path);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_ACTIVATIONS_H_
