// FileLock: an exclusive flock on a file, so that one process at a time owns a state file
// (`quantd run`) or a state directory (`quantd serve`). The lock goes away with the FileLock or
// with the process, however it ends.
#ifndef QUANTD_SERVER_STORE_FILE_LOCK_H_
#define QUANTD_SERVER_STORE_FILE_LOCK_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace quantd::store {

class FileLock {
 public:
  // Locks `path`, creating it private (0600) when absent and making an existing one so (a
  // symbolic link is refused). FailedPrecondition naming the path when it cannot be opened or
  // locked; *held_elsewhere tells whether another holder of the lock was the reason,
  // so that callers can say who that is.
  static absl::StatusOr<std::unique_ptr<FileLock>> Acquire(const std::string& path,
                                                           bool* held_elsewhere);
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  explicit FileLock(int fd) : fd_(fd) {}

  int fd_;  // the open, locked file
};

}  // namespace quantd::store

#endif  // QUANTD_SERVER_STORE_FILE_LOCK_H_
