#include "server/store/file_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "server/store/private_files.h"

namespace quantd::store {

absl::StatusOr<std::unique_ptr<FileLock>> FileLock::Acquire(const std::string& path,
                                                            bool* held_elsewhere) {
  *held_elsewhere = false;
  // Private (private_files.h): created 0600, an existing lock file made so.
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, kPrivateFileMode);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot open ", path, ": ", strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 ||
      ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0 && fchmod(fd, st.st_mode & 07700) != 0)) {
    const int err = errno;
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot make ", path, " private: ", strerror(err)));
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
