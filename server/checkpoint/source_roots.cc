#include "server/checkpoint/source_roots.h"

#include <errno.h>
#include <limits.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace quantd::checkpoint {
namespace {

// `path` is `root` or lies beneath it (both resolved, absolute).
bool IsInside(absl::string_view path, absl::string_view root) {
  while (root.size() > 1 && root.back() == '/') root.remove_suffix(1);
  if (root == "/") return true;
  return path == root ||
         (absl::StartsWith(path, root) && path.size() > root.size() && path[root.size()] == '/');
}

absl::Status Outside(absl::string_view field, const std::string& path) {
  return absl::PermissionDeniedError(
      absl::StrCat(field, ": ", path,
                   " leads outside the allowed roots of the caller that submitted the job (a "
                   "symbolic link is followed only within them)"));
}

bool InsideAny(absl::string_view resolved, const std::vector<std::string>& roots) {
  for (const std::string& root : roots) {
    if (IsInside(resolved, root)) return true;
  }
  return false;
}

}  // namespace

absl::Status CheckOpenedInsideRoots(absl::string_view field, const std::string& path, int fd,
                                    const SourceRoots& roots) {
  if (!roots.has_value()) return absl::OkStatus();
  const std::string link = absl::StrCat("/proc/self/fd/", fd);
  char resolved[PATH_MAX];
  const ssize_t n = readlink(link.c_str(), resolved, sizeof(resolved) - 1);
  if (n < 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(field, ": ", path, ": cannot resolve"));
  }
  resolved[n] = '\0';
  return InsideAny(resolved, *roots) ? absl::OkStatus() : Outside(field, path);
}

}  // namespace quantd::checkpoint
