#include "server/checkpoint/dir_handle.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/checkpoint/atomic_file.h"

#ifndef SYS_openat2
#define SYS_openat2 437  // the same number on every architecture
#endif

namespace quantd::checkpoint {
namespace {

std::atomic<ResolveMode> g_mode{ResolveMode::kAuto};
std::function<void(int)>* g_hook = nullptr;  // test seam; owned
int g_step = 0;

// Before each system call that resolves or changes a name: the test seam's hook.
void Step() {
  if (g_hook != nullptr) (*g_hook)(g_step++);
}

// An owned descriptor, closed when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  int fd_;
};

ResolveMode ProbeKernel() {
  struct open_how how = {};
  how.flags = O_PATH | O_DIRECTORY | O_CLOEXEC;
  how.resolve = RESOLVE_NO_SYMLINKS;
  const long fd = syscall(SYS_openat2, AT_FDCWD, "/", &how, sizeof(how));
  if (fd >= 0) {
    close(static_cast<int>(fd));
    return ResolveMode::kOpenat2;
  }
  // ENOSYS: Linux < 5.6; EPERM: a seccomp filter that does not know the call.
  return ResolveMode::kWalk;
}

// The components of `rel`, or empty when it is not a relative path of plain components.
std::vector<absl::string_view> Components(absl::string_view rel) {
  std::vector<absl::string_view> parts;
  if (rel.empty() || rel.size() >= PATH_MAX || rel.front() == '/') return {};
  for (absl::string_view part : absl::StrSplit(rel, '/')) {
    if (part.empty() || part == "." || part == ".." ||
        part.find('\0') != absl::string_view::npos) {
      return {};
    }
    parts.push_back(part);
  }
  return parts;
}

// Whether the entry `name` of `dirfd` is a symbolic link.
bool IsSymlinkAt(int dirfd, const std::string& name) {
  struct stat st;
  return fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode);
}

// openat(dirfd, name, flags | O_NOFOLLOW): one step, with ELOOP for a symbolic link also where
// O_PATH or O_DIRECTORY would have made it ENOTDIR or a descriptor of the link itself.
int OpenOneNoFollow(int dirfd, const std::string& name, int flags, mode_t mode) {
  Step();
  const int fd = openat(dirfd, name.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) {
    if (errno == ENOTDIR && IsSymlinkAt(dirfd, name)) errno = ELOOP;
    return -1;
  }
  if ((flags & O_PATH) != 0) {
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISLNK(st.st_mode)) {
      close(fd);
      errno = ELOOP;
      return -1;
    }
  }
  return fd;
}

// Opens `parts` beneath `dirfd` (AT_FDCWD allowed) with no symbolic link followed; -1 and errno
// on failure.
int ResolveBeneath(int dirfd, const std::vector<absl::string_view>& parts, int flags,
                   mode_t mode) {
  if (ActiveResolveMode() == ResolveMode::kOpenat2) {
    std::string rel;
    for (absl::string_view part : parts) {
      if (!rel.empty()) rel.push_back('/');
      rel.append(part.data(), part.size());
    }
    struct open_how how = {};
    how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
    how.mode = (flags & O_CREAT) != 0 ? mode : 0;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    for (int attempt = 0;; ++attempt) {
      Step();
      const long fd = syscall(SYS_openat2, dirfd, rel.c_str(), &how, sizeof(how));
      if (fd >= 0) return static_cast<int>(fd);
      // EAGAIN: a concurrent rename raced the lookup; the kernel asks for a retry.
      if (errno != EAGAIN || attempt == 8) return -1;
    }
  }
  Fd owned;
  int cur = dirfd;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const int next = OpenOneNoFollow(cur, std::string(parts[i]), O_PATH | O_DIRECTORY, 0);
    if (next < 0) return -1;
    owned = Fd(next);
    cur = next;
  }
  return OpenOneNoFollow(cur, std::string(parts.back()), flags, mode);
}

// What a non-regular file is, for errors.
const char* FileKind(mode_t mode) {
  return S_ISFIFO(mode)                   ? "a FIFO"
         : S_ISDIR(mode)                  ? "a directory"
         : S_ISCHR(mode) || S_ISBLK(mode) ? "a device"
         : S_ISSOCK(mode)                 ? "a socket"
         : S_ISLNK(mode)                  ? "a symbolic link"
                                          : "a special file";
}

}  // namespace

void SetResolveModeForTesting(ResolveMode mode) { g_mode.store(mode); }

ResolveMode ActiveResolveMode() {
  static const ResolveMode kernel = ProbeKernel();
  const ResolveMode mode = g_mode.load();
  return mode == ResolveMode::kAuto ? kernel : mode;
}

void SetStepHookForTesting(std::function<void(int step)> hook) {
  delete g_hook;
  g_hook = hook ? new std::function<void(int)>(std::move(hook)) : nullptr;
  g_step = 0;
}

absl::StatusOr<DirHandle> DirHandle::Open(std::string field, std::string path) {
  DirHandle named(std::move(field), std::move(path), -1, 0, 0);
  absl::string_view rel = named.path_;
  Fd start;
  if (!rel.empty() && rel.front() == '/') {
    while (!rel.empty() && rel.front() == '/') rel.remove_prefix(1);
    while (!rel.empty() && rel.back() == '/') rel.remove_suffix(1);
    Step();
    start = Fd(open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (start.get() < 0) return named.Error(errno, "open", "");
  }
  const int base = rel.empty() || start.get() >= 0 ? start.get() : AT_FDCWD;
  Fd fd;
  if (rel.empty()) {
    fd = std::move(start);
  } else {
    const std::vector<absl::string_view> parts = Components(rel);
    if (parts.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(named.field_, ": ", named.path_,
                       ": not a path of plain components (\"\", \".\" or \"..\" in it)"));
    }
    fd = Fd(ResolveBeneath(base, parts, O_PATH | O_DIRECTORY, 0));
    if (fd.get() < 0) return named.Error(errno, "open the directory", "");
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return named.Error(errno, "stat", "");
  named.dev_ = st.st_dev;
  named.ino_ = st.st_ino;
  named.fd_ = fd.release();
  return named;
}

DirHandle::DirHandle(DirHandle&& other) noexcept
    : field_(std::move(other.field_)),
      path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      dev_(other.dev_),
      ino_(other.ino_) {}

DirHandle& DirHandle::operator=(DirHandle&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    field_ = std::move(other.field_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    dev_ = other.dev_;
    ino_ = other.ino_;
  }
  return *this;
}

DirHandle::~DirHandle() {
  if (fd_ >= 0) close(fd_);
}

std::string DirHandle::PathOf(absl::string_view rel) const {
  if (rel.empty()) return path_;
  return absl::StrCat(path_, path_.empty() || path_.back() == '/' ? "" : "/", rel);
}

absl::Status DirHandle::Error(int err, absl::string_view what, absl::string_view rel) const {
  const std::string where = absl::StrCat(field_, ": ", PathOf(rel));
  if (err == ELOOP) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": cannot ", what,
        ": it is or passes through a symbolic link, which quantd does not follow here (was the ",
        field_, " directory or a directory in it replaced by a link?)"));
  }
  if (err == EXDEV) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": cannot ", what, ": it leads outside the ", field_, " directory"));
  }
  return absl::ErrnoToStatus(err, absl::StrCat(where, ": cannot ", what));
}

absl::StatusOr<int> DirHandle::OpenAt(absl::string_view rel, int flags, mode_t mode) const {
  const std::vector<absl::string_view> parts = Components(rel);
  if (parts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field_, ": ", PathOf(rel), ": not a relative path of plain components beneath ", path_));
  }
  const int fd = ResolveBeneath(fd_, parts, flags | O_NOFOLLOW, mode);
  if (fd < 0) return Error(errno, (flags & O_CREAT) != 0 ? "create" : "open", rel);
  return fd;
}

absl::StatusOr<int> DirHandle::CreateForWrite(absl::string_view rel) const {
  // O_NONBLOCK: a FIFO planted there fails the open (ENXIO without a reader) instead of blocking.
  absl::StatusOr<int> fd = OpenAt(rel, O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK, 0644);
  if (!fd.ok()) {
    if (absl::IsFailedPrecondition(fd.status())) return fd.status();
    absl::StatusOr<struct stat> st = Stat(rel);
    if (st.ok() && !S_ISREG(st->st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(field_, ": ", PathOf(rel), ": is ",
                                                     FileKind(st->st_mode),
                                                     "; only regular files are written"));
    }
    return fd.status();
  }
  struct stat st;
  if (fstat(*fd, &st) != 0) {
    const int err = errno;
    close(*fd);
    return Error(err, "stat", rel);
  }
  if (!S_ISREG(st.st_mode)) {  // a FIFO with a reader, a device
    close(*fd);
    return absl::InvalidArgumentError(absl::StrCat(field_, ": ", PathOf(rel), ": is ",
                                                   FileKind(st.st_mode),
                                                   "; only regular files are written"));
  }
  return *fd;
}

absl::StatusOr<int> DirHandle::OpenRegularFile(absl::string_view rel, struct stat* st) const {
  absl::StatusOr<int> fd = OpenAt(rel, O_RDONLY | O_NONBLOCK);
  if (!fd.ok()) return fd.status();
  if (fstat(*fd, st) != 0) {
    const int err = errno;
    close(*fd);
    return Error(err, "stat", rel);
  }
  if (!S_ISREG(st->st_mode)) {
    close(*fd);
    return absl::InvalidArgumentError(absl::StrCat(field_, ": ", PathOf(rel), ": is ",
                                                   FileKind(st->st_mode),
                                                   "; only regular files are read"));
  }
  return *fd;
}

absl::StatusOr<std::pair<int, std::string>> DirHandle::OpenParent(absl::string_view rel) const {
  const std::vector<absl::string_view> parts = Components(rel);
  if (parts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field_, ": ", PathOf(rel), ": not a relative path of plain components beneath ", path_));
  }
  int parent;
  if (parts.size() == 1) {
    parent = fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  } else {
    const std::vector<absl::string_view> dirs(parts.begin(), parts.end() - 1);
    parent = ResolveBeneath(fd_, dirs, O_PATH | O_DIRECTORY, 0);
  }
  if (parent < 0) return Error(errno, "open the directory of", rel);
  return std::make_pair(parent, std::string(parts.back()));
}

absl::StatusOr<struct stat> DirHandle::Stat(absl::string_view rel) const {
  absl::StatusOr<std::pair<int, std::string>> parent = OpenParent(rel);
  if (!parent.ok()) return parent.status();
  Fd dir(parent->first);
  struct stat st;
  Step();
  if (fstatat(dir.get(), parent->second.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return Error(errno, "stat", rel);
  }
  return st;
}

absl::Status DirHandle::MakeDirs(absl::string_view rel) const {
  const std::vector<absl::string_view> parts = Components(rel);
  if (parts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field_, ": ", PathOf(rel), ": not a relative path of plain components beneath ", path_));
  }
  Fd cur(fcntl(fd_, F_DUPFD_CLOEXEC, 0));
  if (cur.get() < 0) return Error(errno, "open", "");
  for (absl::string_view part : parts) {
    const std::string name(part);
    Step();
    if (mkdirat(cur.get(), name.c_str(), 0755) != 0 && errno != EEXIST) {
      return Error(errno, "create the directory", rel);
    }
    const int next = OpenOneNoFollow(cur.get(), name, O_PATH | O_DIRECTORY, 0);
    if (next < 0) return Error(errno, "create the directory", rel);
    cur = Fd(next);
  }
  return absl::OkStatus();
}

absl::StatusOr<DirHandle> DirHandle::OpenSubdir(absl::string_view rel) const {
  absl::StatusOr<int> fd = OpenAt(rel, O_PATH | O_DIRECTORY);
  if (!fd.ok()) return fd.status();
  struct stat st;
  if (fstat(*fd, &st) != 0) {
    const int err = errno;
    close(*fd);
    return Error(err, "stat", rel);
  }
  return DirHandle(field_, PathOf(rel), *fd, st.st_dev, st.st_ino);
}

absl::Status DirHandle::Rename(absl::string_view from, absl::string_view to, bool replace) const {
  absl::StatusOr<std::pair<int, std::string>> src = OpenParent(from);
  if (!src.ok()) return src.status();
  Fd src_dir(src->first);
  absl::StatusOr<std::pair<int, std::string>> dst = OpenParent(to);
  if (!dst.ok()) return dst.status();
  Fd dst_dir(dst->first);
  Step();
  if (renameat2(src_dir.get(), src->second.c_str(), dst_dir.get(), dst->second.c_str(),
                replace ? 0 : RENAME_NOREPLACE) != 0) {
    return Error(errno, absl::StrCat("rename ", from, " to"), to);
  }
  // The rename is durable only once the directory entry is on disk.
  Fd sync(openat(dst_dir.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (sync.get() < 0) return Error(errno, "open the directory of", to);
  if (fsync(sync.get()) != 0) return Error(errno, "fsync the directory of", to);
  return absl::OkStatus();
}

absl::Status DirHandle::Remove(absl::string_view rel, bool directory) const {
  absl::StatusOr<std::pair<int, std::string>> parent = OpenParent(rel);
  if (!parent.ok()) return parent.status();
  Fd dir(parent->first);
  Step();
  if (unlinkat(dir.get(), parent->second.c_str(), directory ? AT_REMOVEDIR : 0) != 0) {
    return Error(errno, "remove", rel);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<DirEntry>> DirHandle::List(absl::string_view rel) const {
  int fd;
  if (rel.empty()) {
    Step();
    fd = openat(fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return Error(errno, "list", rel);
  } else {
    absl::StatusOr<int> opened = OpenAt(rel, O_RDONLY | O_DIRECTORY);
    if (!opened.ok()) return opened.status();
    fd = *opened;
  }
  DIR* dir = fdopendir(fd);
  if (dir == nullptr) {
    const int err = errno;
    close(fd);
    return Error(err, "list", rel);
  }
  std::vector<DirEntry> entries;
  errno = 0;
  while (const struct dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (fstatat(dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // gone meanwhile
    entries.push_back({name, static_cast<mode_t>(st.st_mode & S_IFMT)});
    errno = 0;
  }
  const int err = errno;
  closedir(dir);
  if (err != 0) return Error(err, "list", rel);
  std::sort(entries.begin(), entries.end(),
            [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
  return entries;
}

absl::Status DirHandle::Sync() const {
  Fd dir(openat(fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() < 0) return Error(errno, "open", "");
  if (fsync(dir.get()) != 0) return Error(errno, "fsync", "");
  return absl::OkStatus();
}

absl::Status DirHandle::CheckUnchanged() const {
  absl::StatusOr<DirHandle> now = Open(field_, path_);
  if (!now.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        field_, ": ", path_,
        " no longer names the directory the job opened (removed, renamed or replaced since; the "
        "job writes only into the directory it checked): ",
        now.status().message()));
  }
  if (now->dev_ != dev_ || now->ino_ != ino_) {
    return absl::FailedPreconditionError(absl::StrCat(
        field_, ": ", path_,
        " names another directory than the one the job opened (it was renamed or replaced "
        "since; the job writes only into the directory it checked)"));
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomicallyAt(const DirHandle& dir, absl::string_view rel,
                                   absl::string_view contents, bool replace) {
  const std::string tmp = absl::StrCat(rel, ".tmp");
  absl::StatusOr<int> fd = dir.CreateForWrite(tmp);
  if (!fd.ok()) return fd.status();
  const std::string tmp_path = dir.PathOf(tmp);
  absl::Status status = WriteFully(*fd, contents.data(), contents.size(), tmp_path);
  if (status.ok()) {
    status = SyncAndClose(*fd, tmp_path);
  } else {
    close(*fd);
  }
  if (status.ok()) status = dir.Rename(tmp, rel, replace);
  if (!status.ok()) dir.Remove(tmp).IgnoreError();
  return status;
}

}  // namespace quantd::checkpoint
