#include "server/store/private_files.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace quantd::store {
namespace {

absl::Status Errno(int err, const std::string& what, const std::string& path) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, " ", path));
}

}  // namespace

absl::Status CreatePrivateFile(const std::string& path) {
  const int fd =
      open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, kPrivateFileMode);
  if (fd < 0) return Errno(errno, "cannot create", path);
  // The umask may have taken bits away, never added any: 0600 exactly.
  const int err = fchmod(fd, kPrivateFileMode) == 0 ? 0 : errno;
  close(fd);
  if (err != 0) return Errno(err, "cannot set the mode of", path);
  return absl::OkStatus();
}

absl::StatusOr<bool> MakePrivate(const std::string& path) {
  // O_NOFOLLOW: a symbolic link is left alone (ELOOP); O_NONBLOCK: a FIFO does not wait.
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT || errno == ELOOP) return false;
    return Errno(errno, "cannot open", path);
  }
  struct stat st;
  absl::StatusOr<bool> changed = false;
  if (fstat(fd, &st) != 0) {
    changed = Errno(errno, "cannot stat", path);
  } else if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    if (fchmod(fd, st.st_mode & 07700) == 0) {
      changed = true;
    } else {
      changed = Errno(errno, "cannot make private", path);
    }
  }
  close(fd);
  return changed;
}

absl::StatusOr<bool> CreatePrivateDir(const std::string& path) {
  if (mkdir(path.c_str(), kPrivateDirMode) == 0) {
    // The umask may have taken bits away, never added any: 0700 exactly.
    if (chmod(path.c_str(), kPrivateDirMode) != 0) {
      return Errno(errno, "cannot set the mode of", path);
    }
    return false;
  }
  if (errno != EEXIST) return Errno(errno, "cannot create the directory", path);
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return Errno(errno, "cannot stat", path);
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a directory"));
  }
  return MakePrivate(path);
}

}  // namespace quantd::store
