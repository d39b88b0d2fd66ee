#include "server/checkpoint/source_roots.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>

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

}  // namespace

absl::Status CheckInsideRoots(absl::string_view field, const std::string& path,
                              const SourceRoots& roots) {
  if (!roots.has_value()) return absl::OkStatus();
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(field, ": ", path, ": cannot resolve"));
  }
  for (const std::string& root : *roots) {
    if (IsInside(resolved, root)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat(field, ": ", path,
                   " leads outside the allowed roots of the caller that submitted the job (a "
                   "symbolic link in a source is followed only within them)"));
}

}  // namespace quantd::checkpoint
