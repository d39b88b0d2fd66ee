// Whole-file writes that are atomic on POSIX file systems: write `<path>.tmp`, fsync, rename
// over `<path>`, fsync the directory. A crash leaves either the old file or the new one, plus at
// most a stale .tmp that the next write replaces.
#ifndef QUANTD_SERVER_CHECKPOINT_ATOMIC_FILE_H_
#define QUANTD_SERVER_CHECKPOINT_ATOMIC_FILE_H_

#include <stdint.h>

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace quantd::checkpoint {

absl::Status WriteFileAtomically(const std::string& path, std::string_view contents);
// Renames tmp_path over path and fsyncs path's directory (the tmp file must already be synced).
absl::Status CommitTmpFile(const std::string& tmp_path, const std::string& path);

// Building blocks for writers that stream into a tmp file themselves:
// Creates (or truncates) `path` for writing, mode 0644; returns the descriptor.
absl::StatusOr<int> CreateForWrite(const std::string& path);
// Writes all `size` bytes to `fd` (retrying short writes and EINTR); errors name `path`.
absl::Status WriteFully(int fd, const void* data, uint64_t size, const std::string& path);
// fsyncs and closes `fd` (closed even when fsync fails); errors name `path`.
absl::Status SyncAndClose(int fd, const std::string& path);

// Reads a whole (small) file; errors name the path.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_ATOMIC_FILE_H_
