#include "server/store/file_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace quantd::store {

absl::StatusOr<std::unique_ptr<FileLock>> FileLock::Acquire(const std::string& path,
                                                            bool* held_elsewhere) {
  *held_elsewhere = false;
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot open ", path, ": ", strerror(errno)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    close(fd);
    *held_elsewhere = err == EWOULDBLOCK;
    return absl::FailedPreconditionError(absl::StrCat("cannot lock ", path, ": ", strerror(err)));
  }
  return std::unique_ptr<FileLock>(new FileLock(fd));
}

FileLock::~FileLock() { close(fd_); }

}  // namespace quantd::store
