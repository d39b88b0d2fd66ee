// Streaming safetensors writer.
//
// The header must precede the data, so every tensor (name, dtype, shape) is declared up front;
// then the tensors' bytes are appended in declaration order, in as many chunks as the caller
// likes, without the shard ever being held in memory. The header is padded with spaces to a
// multiple of 8 bytes. Everything is written to `<path>.tmp`; Finish() checks that every
// declared byte arrived, fsyncs, renames to `<path>` and fsyncs the directory. A writer destroyed
// without Finish() removes its .tmp file.
//
// The file's SHA-256 is computed as it is written: a gathered buffer (the writer's own memory)
// is hashed on a thread of its own while the caller's thread writes it and goes on producing the
// next bytes; a large chunk written straight from the caller's memory (perhaps a mapped source
// shard, whose faults must happen in a read on the caller's thread) is hashed before it is
// written. One chunk is in flight at a time, so the digest is of the bytes in file order.
#ifndef QUANTD_SERVER_CHECKPOINT_SAFETENSORS_WRITER_H_
#define QUANTD_SERVER_CHECKPOINT_SAFETENSORS_WRITER_H_

#include <stdint.h>

#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/checkpoint/dir_handle.h"
#include "server/checkpoint/dtype.h"
#include "server/checkpoint/sha256.h"

namespace quantd::checkpoint {

struct TensorSpec {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;

  uint64_t bytes() const;
};

class SafetensorsWriter {
 public:
  // Fails on an empty or duplicate name, "__metadata__" as a name, a negative or overflowing
  // shape, a name or metadata string that is not UTF-8, an unwritable path, or too little disk
  // space for the whole file (reserved up front where the file system supports it).
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      std::string path, std::vector<TensorSpec> tensors,
      std::map<std::string, std::string> metadata = {});
  // The same for the file `name` beneath `dir` (dir_handle.h): the .tmp file is created, renamed
  // and removed relative to the handle, never through its path; `dir` must outlive the writer.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const DirHandle& dir, std::string name, std::vector<TensorSpec> tensors,
      std::map<std::string, std::string> metadata = {});
  ~SafetensorsWriter();

  // Appends bytes of the current tensor; a chunk may not run past the current tensor's end
  // (such a chunk is refused whole and the writer stays usable). An I/O error is final: the
  // .tmp file is removed and every later call fails.
  absl::Status Append(const void* data, uint64_t size);
  // Convenience: the whole tensor `name`, which must be the next one due (a zero-byte tensor
  // is accepted at any time: it adds no bytes).
  absl::Status WriteTensor(const std::string& name, const void* data, uint64_t size);
  // The tensor whose bytes are due next ("" when all are complete).
  std::string NextTensor() const;
  // Bytes of the final file (header included).
  uint64_t total_bytes() const;
  // Fails, removing the .tmp file, when a declared byte is missing.
  absl::Status Finish();
  // SHA-256 (hex) of the file's bytes, computed while they were written; "" until Finish() succeeds.
  const std::string& sha256() const { return sha256_; }

 private:
  SafetensorsWriter() = default;
  // Both Creates: `name` is a path when `dir` is null, else a name beneath `dir`.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> CreateIn(
      const DirHandle* dir, std::string name, std::vector<TensorSpec> tensors,
      std::map<std::string, std::string> metadata);
  // Moves past tensors whose bytes are complete (zero-byte tensors are complete at once).
  void SkipCompleteTensors();
  // Writes out buffer_; its hash goes on after the return (WaitForHash).
  absl::Status Flush();
  // Hashes, then writes out, `size` bytes at `data` (the caller's memory).
  absl::Status WriteHashed(const void* data, uint64_t size);
  // Waits until the chunk being hashed, if any, is in hash_.
  void WaitForHash();
  // Closes and removes the tmp file after an I/O error or a failed Finish(); returns `status`.
  absl::Status Abandon(absl::Status status);
  // The error for a call after Finish() or after a failure.
  absl::Status Closed() const;
  // Creates, removes and renames the .tmp file (beneath dir_ when it is set).
  absl::Status CreateTmp();
  void RemoveTmp();
  absl::Status CommitTmp();

  std::string path_;                // final path
  const DirHandle* dir_ = nullptr;  // the directory the file is written beneath; null: path_
  std::string name_;                // the file's name beneath dir_
  std::string tmp_path_;            // path + ".tmp", where bytes go until Finish()
  int fd_ = -1;                     // open descriptor of tmp_path_; -1 once finished or abandoned
  std::vector<TensorSpec> tensors_; // declaration (= file) order
  size_t current_ = 0;              // index of the tensor being appended
  uint64_t written_in_current_ = 0; // bytes of tensors_[current_] already written
  uint64_t header_bytes_ = 0;       // 8-byte length prefix + padded JSON
  uint64_t data_bytes_ = 0;         // sum of tensor sizes
  std::vector<uint8_t> buffer_;     // small appends gathered into large write() calls
  std::vector<uint8_t> flushed_;    // the last buffer written out, hashed by hashing_
  std::future<void> hashing_;       // adds the chunk in flight to hash_; invalid when none
  Sha256 hash_;                     // every byte written so far, in file order (hashing_'s)
  std::string sha256_;              // hash_'s digest once Finish() succeeded
  bool finished_ = false;           // Finish() succeeded
};

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_SAFETENSORS_WRITER_H_
