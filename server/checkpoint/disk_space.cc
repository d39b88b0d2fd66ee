#include "server/checkpoint/disk_space.h"

#include <errno.h>
#include <string.h>
#include <sys/statvfs.h>

#include <filesystem>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace quantd::checkpoint {

absl::StatusOr<DiskSpace> DiskSpaceUnder(const std::string& path) {
  std::filesystem::path p(path);
  if (!p.is_absolute()) {
    return absl::InvalidArgumentError(absl::StrCat("disk space: ", path, " is not absolute"));
  }
  p = p.lexically_normal();
  int error = 0;
  while (true) {
    struct statvfs fs {};
    if (statvfs(p.c_str(), &fs) == 0) {
      return DiskSpace{.free_bytes = static_cast<int64_t>(fs.f_bavail * fs.f_frsize),
                       .size_bytes = static_cast<int64_t>(fs.f_blocks * fs.f_frsize)};
    }
    error = errno;
    // Only a missing component sends us one level up; the root always exists.
    if ((error != ENOENT && error != ENOTDIR) || p == p.root_path()) break;
    p = p.parent_path();
  }
  return absl::NotFoundError(
      absl::StrCat("disk space: cannot examine ", path, " or a parent: ", strerror(error)));
}

}  // namespace quantd::checkpoint
