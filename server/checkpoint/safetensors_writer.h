// Streaming safetensors writer.
//
// The header must precede the data, so every tensor (name, dtype, shape) is declared up front;
// then the tensors' bytes are appended in declaration order, in as many chunks as the caller
// likes, without the shard ever being held in memory. The header is padded with spaces to a
// multiple of 8 bytes. Everything is written to `<path>.tmp`; Finish() checks that every
// declared byte arrived, fsyncs, renames to `<path>` and fsyncs the directory. A writer destroyed
// without Finish() removes its .tmp file.
#ifndef QUANTD_SERVER_CHECKPOINT_SAFETENSORS_WRITER_H_
#define QUANTD_SERVER_CHECKPOINT_SAFETENSORS_WRITER_H_

#include <stdint.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/checkpoint/dtype.h"

namespace quantd::checkpoint {

struct TensorSpec {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;

  uint64_t bytes() const;
};

class SafetensorsWriter {
 public:
  // Fails on duplicate names, "__metadata__" as a name, or an unwritable path.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      std::string path, std::vector<TensorSpec> tensors,
      std::map<std::string, std::string> metadata = {});
  ~SafetensorsWriter();

  // Appends bytes of the current tensor; a chunk may not run past the current tensor's end.
  absl::Status Append(const void* data, uint64_t size);
  // Convenience: the whole tensor `name`, which must be the next one due.
  absl::Status WriteTensor(const std::string& name, const void* data, uint64_t size);
  // The tensor whose bytes are due next ("" when all are complete).
  std::string NextTensor() const;
  // Bytes of the final file (header included).
  uint64_t total_bytes() const;
  absl::Status Finish();

 private:
  SafetensorsWriter() = default;

  std::string path_;                // final path
  std::string tmp_path_;            // path + ".tmp", where bytes go until Finish()
  int fd_ = -1;                     // open descriptor of tmp_path_
  std::vector<TensorSpec> tensors_; // declaration (= file) order
  size_t current_ = 0;              // index of the tensor being appended
  uint64_t written_in_current_ = 0; // bytes of tensors_[current_] already written
  uint64_t header_bytes_ = 0;       // 8-byte length prefix + padded JSON
  uint64_t data_bytes_ = 0;         // sum of tensor sizes
  bool finished_ = false;           // Finish() succeeded
};

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_SAFETENSORS_WRITER_H_
