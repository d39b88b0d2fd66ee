// DirHandle: a directory a job reads or writes, opened once (O_PATH | O_DIRECTORY) right after its
// path was checked, and every later open, create, rename, list and delete done relative to that
// descriptor, never through the path again. A directory renamed away and replaced by a symbolic
// link (into another tenant's model) after the check then changes nothing the job does: it keeps
// writing into the directory it checked, and CheckUnchanged tells that the path names another
// directory now, so that the job fails naming the field.
//
// Names beneath the handle are relative paths of plain components ("a", "sub/b"; no "", ".",
// ".." or leading "/"), resolved with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS): a symbolic
// link anywhere on the way, or as the last component, is refused (FailedPrecondition naming the
// field, the directory and the name). On kernels without openat2 (Linux < 5.6, or a seccomp
// filter that answers ENOSYS/EPERM) the same rule holds by a walk that opens one component at a
// time with O_NOFOLLOW; SetResolveModeForTesting selects it in tests.
#ifndef QUANTD_SERVER_CHECKPOINT_DIR_HANDLE_H_
#define QUANTD_SERVER_CHECKPOINT_DIR_HANDLE_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <functional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace quantd::checkpoint {

// How names are resolved: openat2 when the kernel has it (kAuto probes once), or the
// component-by-component O_NOFOLLOW walk.
enum class ResolveMode { kAuto, kOpenat2, kWalk };

// Test seams. The mode every DirHandle uses from now on (kAuto: the default).
void SetResolveModeForTesting(ResolveMode mode);
// The mode in use (kOpenat2 or kWalk; probes the kernel when it was kAuto).
ResolveMode ActiveResolveMode();
// Called before each system call of the layer that resolves or changes a name (one step of a
// walk, an openat2, a mkdirat, a renameat, an unlinkat, the open of a listing), with a count
// from 0 that SetStepHookForTesting resets: a test swaps a directory for a symbolic link at any
// step. Not thread-safe; an empty function removes the hook.
void SetStepHookForTesting(std::function<void(int step)> hook);

// One entry of a listing: its name and its type as lstat tells it (S_IFREG, S_IFDIR, S_IFLNK...).
struct DirEntry {
  std::string name;
  mode_t type = 0;
};

class DirHandle {
 public:
  // Opens the directory at `path` for the job's `field` ("output", "source", ...). An absolute
  // path is resolved from "/" without following any symbolic link (the job's paths were made
  // canonical at submit, so a link there was swapped in since: FailedPrecondition naming the
  // field). A relative path (specs stored by an earlier release) is opened from the current
  // directory under the same rule.
  static absl::StatusOr<DirHandle> Open(std::string field, std::string path);

  DirHandle() = default;
  DirHandle(DirHandle&& other) noexcept;
  DirHandle& operator=(DirHandle&& other) noexcept;
  DirHandle(const DirHandle&) = delete;
  DirHandle& operator=(const DirHandle&) = delete;
  ~DirHandle();

  bool is_open() const { return fd_ >= 0; }
  const std::string& field() const { return field_; }
  const std::string& path() const { return path_; }
  // The O_PATH descriptor (owned by the handle).
  int fd() const { return fd_; }
  // "<path>/<rel>" (the path at open time), for messages and recorded outputs.
  std::string PathOf(absl::string_view rel) const;

  // Opens `rel` beneath the directory with open(2) `flags` (O_CLOEXEC and O_NOFOLLOW added) and
  // `mode`; returns the descriptor, which the caller closes.
  absl::StatusOr<int> OpenAt(absl::string_view rel, int flags, mode_t mode = 0) const;
  // Creates (or truncates) the regular file `rel` for writing, mode 0644; anything but a regular
  // file there (a FIFO without blocking) is InvalidArgument.
  absl::StatusOr<int> CreateForWrite(absl::string_view rel) const;
  // Opens the regular file `rel` read-only (O_NONBLOCK) and fills *st; anything else is
  // InvalidArgument.
  absl::StatusOr<int> OpenRegularFile(absl::string_view rel, struct stat* st) const;
  // lstat of `rel` (its parents resolved beneath); NotFound when absent.
  absl::StatusOr<struct stat> Stat(absl::string_view rel) const;
  // Creates the directory `rel` and its missing parents (mode 0755); existing directories are
  // kept, anything else in the way is refused.
  absl::Status MakeDirs(absl::string_view rel) const;
  // Opens the subdirectory `rel` as a handle of its own (same field).
  absl::StatusOr<DirHandle> OpenSubdir(absl::string_view rel) const;
  // renameat(2) of `from` over `to`, both beneath, then fsync of `to`'s directory. With
  // `replace` false an existing `to` is kept and the answer is AlreadyExists (RENAME_NOREPLACE:
  // of two writers racing for one name, exactly one wins).
  absl::Status Rename(absl::string_view from, absl::string_view to, bool replace = true) const;
  // unlinkat(2) of the file (or, with `directory`, the empty directory) `rel`; NotFound when
  // absent.
  absl::Status Remove(absl::string_view rel, bool directory = false) const;
  // The entries of the directory `rel` ("" for the directory itself), without "." and "..", in
  // name order.
  absl::StatusOr<std::vector<DirEntry>> List(absl::string_view rel = "") const;
  // fsync of the directory.
  absl::Status Sync() const;
  // Whether the path still names the directory this handle holds (same device and inode, no
  // symbolic link on the way): FailedPrecondition naming the field and the path when it was
  // removed, renamed or replaced since Open.
  absl::Status CheckUnchanged() const;

 private:
  DirHandle(std::string field, std::string path, int fd, dev_t dev, ino_t ino)
      : field_(std::move(field)), path_(std::move(path)), fd_(fd), dev_(dev), ino_(ino) {}
  // An error about `rel` naming the field and the path; errno `err` chooses the code.
  absl::Status Error(int err, absl::string_view what, absl::string_view rel) const;
  // Opens the directory holding `rel`'s last component (O_PATH) and returns it with that
  // component's name.
  absl::StatusOr<std::pair<int, std::string>> OpenParent(absl::string_view rel) const;

  std::string field_;
  std::string path_;
  int fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

// Writes `contents` to `rel` beneath `dir` atomically: "<rel>.tmp", fsync, rename, fsync of the
// directory (atomic_file.h's WriteFileAtomically, handle-relative). With `replace` false an
// existing `rel` is kept: AlreadyExists, and the temporary file is removed.
absl::Status WriteFileAtomicallyAt(const DirHandle& dir, absl::string_view rel,
                                   absl::string_view contents, bool replace = true);

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_DIR_HANDLE_H_
