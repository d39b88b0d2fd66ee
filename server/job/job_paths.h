// The paths of a job spec: their text checked, made absolute and canonical, and compared by what
// they name, so that no spelling (model/, model/./, a symlink, a bind mount) lets a job write into
// its own source or into another job's output.
//
// Two directories overlap when one is the other or lies inside it. That is decided twice: by the
// path components after std::filesystem::weakly_canonical (symlinks in the existing part
// resolved, "." and ".." removed), and by device and inode: the outer directory's (st_dev,
// st_ino) against the inner path's and each of its existing ancestors' (a bind mount or a second
// mount of one file system names one directory by two canonical paths).
#ifndef QUANTD_SERVER_JOB_JOB_PATHS_H_
#define QUANTD_SERVER_JOB_JOB_PATHS_H_

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/job/job_spec.h"

namespace quantd::job {

// The longest path a spec may hold: one byte less than PATH_MAX, which counts the NUL.
inline constexpr size_t kMaxPathBytes = PATH_MAX - 1;

// The text of a path field: at most kMaxPathBytes, valid UTF-8 (base::FirstInvalidUtf8: no
// overlong forms, surrogates or code points above U+10FFFF), no NUL byte. InvalidArgument
// naming `field` (and the length, never the text).
absl::Status CheckPathText(absl::string_view field, const std::string& path);

// Makes every path of the spec absolute and canonical: source, output, materialize_bf16 and the
// calibration's amax_file, dataset, datasets[*].path and amax_out. A relative path is refused
// unless `allow_relative` (quantd run resolves against its current directory; the daemon cannot
// know the caller's). Then refuses, with InvalidArgument naming the field: output overlapping
// source; materialize_bf16 overlapping source or output; amax_out (a file the job writes) equal
// to, inside or around the source, equal to a calibration input (amax_file, a dataset), or an
// existing directory.
absl::Status ResolveJobPaths(JobSpec* spec, bool allow_relative);

// At each start of a job, whose paths were made canonical when it was submitted:
// FailedPrecondition naming the field and the link when a component of an absolute path of `spec`
// is now a symbolic link (swapped in since the submit, it could lead out of the caller's allowed
// roots), or when the paths overlap now (ResolveJobPaths). Relative paths, which only specs
// stored by an earlier release hold, are checked for overlaps only.
absl::Status CheckJobPathsUnchanged(const JobSpec& spec);

// A path that a job other than the one being submitted writes, and so owns: its output or
// materialize_bf16 directory, or its calibration.amax_out file.
struct ClaimedDir {
  int64_t job_id = 0;
  std::string dir;  // canonical, as ResolveJobPaths left it
  bool amax_out = false;  // `dir` is that job's calibration.amax_out
};

// Refuses (FailedPrecondition naming the field and the job) spec.output, spec.materialize_bf16
// or spec.calibration.amax_out overlapping one of `claimed`: being it, inside it or containing it.
absl::Status CheckDirsUnclaimed(const JobSpec& spec, const std::vector<ClaimedDir>& claimed);

}  // namespace quantd::job

#endif  // QUANTD_SERVER_JOB_JOB_PATHS_H_
