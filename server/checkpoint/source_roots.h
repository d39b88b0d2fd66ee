// SourceRoots: where the files of a job's source may lead. A source directory is checked against
// the submitter's allowed roots at submit, but the files inside it may be symbolic links (a
// Hugging Face cache snapshot links each file to ../../blobs/<hash>); a link is followed only
// while its target, fully resolved, stays inside one of those roots, so that a directory of links
// to another tenant's 0600 shards is refused instead of read with the daemon's rights.
#ifndef QUANTD_SERVER_CHECKPOINT_SOURCE_ROOTS_H_
#define QUANTD_SERVER_CHECKPOINT_SOURCE_ROOTS_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace quantd::checkpoint {

// The absolute, resolved directories a job's source files may resolve into; nullopt: anywhere
// (a caller that may name any path).
using SourceRoots = std::optional<std::vector<std::string>>;

// Whether the file open as `fd` (opened from `path`, a file of the job's `field`, "source") lies
// inside one of `roots`, judged by where the opened file is (/proc/self/fd), so a link swapped
// after any earlier check cannot lead the read elsewhere: OK when it does or when `roots` is
// nullopt; PermissionDenied naming the field and `path` (never the target) when it lies outside;
// the error of readlink naming `path` when it cannot be resolved. OpenRegularFile checks
// every file it opens with roots (ReadFile, SafetensorsFile::Open pass theirs on).
absl::Status CheckOpenedInsideRoots(absl::string_view field, const std::string& path, int fd,
                                    const SourceRoots& roots);

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_SOURCE_ROOTS_H_
