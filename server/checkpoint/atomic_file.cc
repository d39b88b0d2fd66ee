#include "server/checkpoint/atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace quantd::checkpoint {
namespace {

absl::Status ErrnoError(int err, const std::string& what, const std::string& path) {
  return absl::ErrnoToStatus(err, absl::StrCat(path, ": ", what));
}

// The directory holding `path` ("." for a bare file name).
std::string DirOf(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// What a non-regular file is, for errors.
const char* FileKind(mode_t mode) {
  return S_ISFIFO(mode)                     ? "a FIFO"
         : S_ISDIR(mode)                    ? "a directory"
         : S_ISCHR(mode) || S_ISBLK(mode)   ? "a device"
         : S_ISSOCK(mode)                   ? "a socket"
                                            : "a special file";
}

}  // namespace

absl::StatusOr<int> CreateForWrite(const std::string& path) {
  const auto not_regular = [&](mode_t mode) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": is ", FileKind(mode), "; only regular files are written"));
  };
  // O_NONBLOCK: a FIFO planted at `path` fails the open (ENXIO without a reader) instead of
  // blocking it; on a regular file the flag changes nothing.
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK,
                0644);
  struct stat st;
  if (fd < 0) {
    const int err = errno;
    if (err == ENXIO && lstat(path.c_str(), &st) == 0) return not_regular(st.st_mode);
    return ErrnoError(err, "cannot create", path);
  }
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoError(err, "cannot stat", path);
  }
  if (!S_ISREG(st.st_mode)) {  // a FIFO with a reader, a device
    close(fd);
    return not_regular(st.st_mode);
  }
  return fd;
}

absl::Status WriteFully(int fd, const void* data, uint64_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "write failed", path);
    }
    p += n;
    size -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SyncAndClose(int fd, const std::string& path) {
  int sync_err = fsync(fd) == 0 ? 0 : errno;
  int close_err = close(fd) == 0 ? 0 : errno;
  if (sync_err != 0) return ErrnoError(sync_err, "fsync failed", path);
  if (close_err != 0) return ErrnoError(close_err, "close failed", path);
  return absl::OkStatus();
}

absl::Status CommitTmpFile(const std::string& tmp_path, const std::string& path) {
  if (rename(tmp_path.c_str(), path.c_str()) != 0) {
    return ErrnoError(errno, absl::StrCat("cannot rename ", tmp_path, " to"), path);
  }
  // The rename is durable only once the directory entry is on disk.
  std::string dir = DirOf(path);
  int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return ErrnoError(errno, "cannot open directory", dir);
  return SyncAndClose(dir_fd, dir);
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  std::string tmp_path = absl::StrCat(path, ".tmp");
  absl::StatusOr<int> fd = CreateForWrite(tmp_path);
  if (!fd.ok()) return fd.status();
  absl::Status status = WriteFully(*fd, contents.data(), contents.size(), tmp_path);
  if (status.ok()) {
    status = SyncAndClose(*fd, tmp_path);
  } else {
    close(*fd);
  }
  if (status.ok()) status = CommitTmpFile(tmp_path, path);
  if (!status.ok()) unlink(tmp_path.c_str());
  return status;
}

absl::StatusOr<int> OpenRegularFile(const std::string& path, bool follow_symlink,
                                    struct stat* st, const SourceRoots& roots,
                                    absl::string_view field) {
  const int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | (follow_symlink ? 0 : O_NOFOLLOW);
  const int fd = open(path.c_str(), flags);
  if (fd < 0) {
    if (errno == ELOOP && !follow_symlink) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": is a symbolic link, which quantd does not follow here"));
    }
    return ErrnoError(errno, "cannot open", path);
  }
  if (fstat(fd, st) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoError(err, "cannot stat", path);
  }
  if (!S_ISREG(st->st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": is ", FileKind(st->st_mode), "; only regular files are read"));
  }
  if (absl::Status inside = CheckOpenedInsideRoots(field, path, fd, roots); !inside.ok()) {
    close(fd);
    return inside;
  }
  return fd;
}

absl::StatusOr<std::string> ReadFile(const std::string& path, uint64_t max_bytes,
                                     const SourceRoots& roots, absl::string_view field) {
  struct stat st;
  absl::StatusOr<int> fd = OpenRegularFile(path, /*follow_symlink=*/true, &st, roots, field);
  if (!fd.ok()) return fd.status();
  return ReadOpenedFile(path, *fd, st, max_bytes);
}

absl::StatusOr<std::string> ReadOpenedFile(const std::string& path, int fd,
                                           const struct stat& st, uint64_t max_bytes) {
  const auto too_large = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": larger than the limit of ", max_bytes, " bytes for this file"));
  };
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    close(fd);
    return too_large();
  }
  // The size may change after fstat: read at most one byte past the cap to notice.
  std::string contents;
  char buffer[1 << 16];
  while (contents.size() <= max_bytes) {
    ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      close(fd);
      return ErrnoError(err, "read failed", path);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  if (contents.size() > max_bytes) return too_large();
  return contents;
}

}  // namespace quantd::checkpoint
