// Read-only, memory-mapped safetensors file with zero-copy tensor views. The file is opened with
// O_NONBLOCK and must be a regular file (a FIFO or device is refused before any read); the
// mapping is guarded against the file shrinking under the process (CheckIntact).
//
// Open() validates the whole header before anything is exposed: header length within the file
// and below a size limit, JSON nesting depth bounded (checked before parsing), every entry an
// object with a known dtype, a shape of non-negative integers and [begin, end) offsets, offsets
// in order, contiguous, non-overlapping and inside the data section, shape * dtype size equal to
// the byte range, no duplicate names. Every error names the file and, where there is one, the
// tensor.
#ifndef QUANTD_SERVER_CHECKPOINT_SAFETENSORS_READER_H_
#define QUANTD_SERVER_CHECKPOINT_SAFETENSORS_READER_H_

#include <stdint.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/checkpoint/dir_handle.h"
#include "server/checkpoint/dtype.h"
#include "server/checkpoint/source_roots.h"

namespace quantd::checkpoint {

// One tensor of an open file. `data` points into the mapping and lives as long as the file.
struct TensorView {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  uint64_t size = 0;    // bytes
  uint64_t offset = 0;  // byte offset of data within the file

  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Header limit: 100 MB, as the reference implementation uses.
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;
  // JSON nesting deeper than this is rejected before parsing.
  static constexpr int kMaxJsonDepth = 16;

  // With `roots`, the file opened must lie inside them (OpenRegularFile).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path, const SourceRoots& roots = std::nullopt);
  // The file `rel` beneath `dir` (DirHandle::OpenRegularFile: no symbolic link followed, nothing
  // outside the directory the handle holds), e.g. a shard of the job's own output read back.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const DirHandle& dir,
                                                               absl::string_view rel);
  // Validates an in-memory file image (header + data); `name` is used in errors. Does not copy:
  // `bytes` must outlive the result. Used by the fuzz target and tests.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(std::string name,
                                                                    const uint8_t* bytes,
                                                                    uint64_t size);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors in file order (ascending offset).
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorView* Find(std::string_view name) const;
  // The "__metadata__" string map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t file_size() const { return size_; }
  // DataLoss naming the file once a read of its mapping hit the end of a file that shrank under
  // the process (mapped_region_guard.h: the read saw zeros instead of crashing the process).
  // Callers check it after reading tensor data and before they trust or publish what they read.
  absl::Status CheckIntact() const;
  // Drops the mapped pages that lie wholly inside `view` from this process's memory (they are
  // read again from the file if touched later), so streaming through a large shard keeps the
  // resident set small. A no-op for FromBytes() images and views of other files.
  void ReleasePages(const TensorView& view) const;
  // SHA-256 of the whole file (header and data) as this object reads it: through its mapping,
  // with no copy, in chunks whose pages are dropped once hashed. `on_chunk` as Sha256File's
  // (sha256.h). CheckIntact's DataLoss when the file shrank under the read.
  absl::StatusOr<std::string> Sha256(
      const std::function<absl::Status(uint64_t)>& on_chunk = {}) const;

 private:
  SafetensorsFile() = default;
  // Maps the regular file open as `fd` (of `st`), closes it, and validates it; `path` names it.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromDescriptor(std::string path,
                                                                         int fd,
                                                                         const struct stat& st);
  // Validates the image at base_/size_ and fills tensors_, by_name_ and metadata_.
  absl::Status Parse();
  // ReleasePages for [data, data + size), a range of the mapping.
  void ReleaseRange(const uint8_t* data, uint64_t size) const;

  std::string path_;                              // file path, for error messages
  const uint8_t* base_ = nullptr;                 // start of the mapping (or caller's bytes)
  uint64_t size_ = 0;                             // file size in bytes
  bool mapped_ = false;                           // base_ is an mmap this object must unmap
  int guard_slot_ = -1;                           // mapped_region_guard slot; -1 = none
  std::vector<TensorView> tensors_;               // sorted by offset
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index into tensors_
  std::map<std::string, std::string> metadata_;   // "__metadata__"
};

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_SAFETENSORS_READER_H_
