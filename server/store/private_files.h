// Private state files: quantd's state (the database with its -wal, -shm and backup, lock files,
// serve.json, the jobs' work directories with their calibration tokens and activations) is
// readable by quantd's own user only, whatever the umask it was started with (DESIGN.md
// "Safety"). New files are created 0600 and directories 0700; existing ones lose their group and
// other permissions when quantd starts on them.
#ifndef QUANTD_SERVER_STORE_PRIVATE_FILES_H_
#define QUANTD_SERVER_STORE_PRIVATE_FILES_H_

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace quantd::store {

inline constexpr mode_t kPrivateFileMode = 0600;
inline constexpr mode_t kPrivateDirMode = 0700;

// Creates `path` as an empty file with mode 0600 (O_EXCL: nothing is replaced, no symbolic link
// followed). AlreadyExists when something is there.
absl::Status CreatePrivateFile(const std::string& path);

// Clears the group and other permissions of the file or directory `path`; a symbolic link is
// neither followed nor changed. Returns whether a mode changed; false when `path` does not exist
// or is a symbolic link. Errors name the path.
absl::StatusOr<bool> MakePrivate(const std::string& path);

// Creates the directory `path` with mode 0700 (its parent must exist), or makes an existing one
// private (MakePrivate). Returns whether a mode changed.
absl::StatusOr<bool> CreatePrivateDir(const std::string& path);

}  // namespace quantd::store

#endif  // QUANTD_SERVER_STORE_PRIVATE_FILES_H_
