// Whole-file writes that are atomic on POSIX file systems: write `<path>.tmp`, fsync, rename
// over `<path>`, fsync the directory. A crash leaves either the old file or the new one, plus at
// most a stale .tmp that the next write replaces.
#ifndef QUANTD_SERVER_CHECKPOINT_ATOMIC_FILE_H_
#define QUANTD_SERVER_CHECKPOINT_ATOMIC_FILE_H_

#include <stdint.h>
#include <sys/stat.h>

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/checkpoint/source_roots.h"

namespace quantd::checkpoint {

absl::Status WriteFileAtomically(const std::string& path, std::string_view contents);
// Renames tmp_path over path and fsyncs path's directory (the tmp file must already be synced).
absl::Status CommitTmpFile(const std::string& tmp_path, const std::string& path);

// Building blocks for writers that stream into a tmp file themselves:
// Creates (or truncates) `path` for writing, mode 0644; returns the descriptor. A symlink at `path`
// is refused (O_NOFOLLOW), so a planted link cannot redirect the write, and so is anything but a
// regular file (InvalidArgument naming the path and what it is), a FIFO without blocking.
absl::StatusOr<int> CreateForWrite(const std::string& path);
// Writes all `size` bytes to `fd` (retrying short writes and EINTR); errors name `path`.
absl::Status WriteFully(int fd, const void* data, uint64_t size, const std::string& path);
// fsyncs and closes `fd` (closed even when fsync fails); errors name `path`.
absl::Status SyncAndClose(int fd, const std::string& path);

// Opens `path` read-only for a read that must not block or wander: O_NONBLOCK (a FIFO does not
// wait for a writer), O_NOFOLLOW unless `follow_symlink`, then fstat: anything but a regular file
// (FIFO, device, directory, socket) is InvalidArgument naming the path and the rule. With
// `roots`, the file opened must lie inside them (CheckOpenedInsideRoots; `field`, the spec field
// the path came from, names it). Returns the descriptor (the caller closes it) and fills *st.
absl::StatusOr<int> OpenRegularFile(const std::string& path, bool follow_symlink,
                                    struct stat* st, const SourceRoots& roots = std::nullopt,
                                    absl::string_view field = "source");

// Reads a whole (small) regular file of at most `max_bytes` (OpenRegularFile, symlinks followed);
// a larger one is InvalidArgument naming the path and the cap. Errors never quote the content.
// With `roots`, the opened file must lie inside them (OpenRegularFile, naming `field`).
absl::StatusOr<std::string> ReadFile(const std::string& path, uint64_t max_bytes,
                                     const SourceRoots& roots = std::nullopt,
                                     absl::string_view field = "source");
// ReadFile's read of the regular file already open as `fd` (of `st`; closed here), e.g. one
// opened beneath a DirHandle; `path` names it in errors.
absl::StatusOr<std::string> ReadOpenedFile(const std::string& path, int fd,
                                           const struct stat& st, uint64_t max_bytes);

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_ATOMIC_FILE_H_
