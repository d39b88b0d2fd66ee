#include "server/api/unix_listener.h"

#include <errno.h>
#include <fcntl.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"

namespace quantd::api {
namespace {

constexpr int kBacklog = 128;
constexpr std::chrono::milliseconds kAcceptBackoff{100};
constexpr char kTmpSuffix[] = ".new";

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::UnavailableError(absl::StrCat(what, " ", path, ": ", strerror(errno)));
}

// The address of `path`, which must fit (CheckPathLength).
sockaddr_un Address(const std::string& path) {
  sockaddr_un address = {};
  address.sun_family = AF_UNIX;
  memcpy(address.sun_path, path.data(), std::min(path.size(), sizeof(address.sun_path) - 1));
  return address;
}

// The path and its temporary name must fit a socket address.
absl::Status CheckPathLength(const std::string& path) {
  const size_t limit = sizeof(sockaddr_un::sun_path) - sizeof(kTmpSuffix);
  if (path.size() <= limit) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("unix socket path ", path, " has ", path.size(),
                                                 " bytes; at most ", limit,
                                                 " fit: choose a shorter path"));
}

// Removes a socket at `path` that no one accepts on (connecting is refused); refuses anything
// else.
absl::Status RemoveStaleSocket(const std::string& path) {
  struct stat st = {};
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return Errno("cannot stat", path);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " exists and is not a socket; quantd does not replace it"));
  }
  const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (probe < 0) return Errno("cannot create a socket to probe", path);
  const sockaddr_un address = Address(path);
  const bool live =
      connect(probe, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
  const int connect_errno = errno;
  close(probe);
  if (live) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", path, ": another process accepts on it"));
  }
  if (connect_errno != ECONNREFUSED) {  // e.g. EACCES: someone else's socket, maybe live
    errno = connect_errno;
    return Errno("cannot tell whether another process accepts on", path);
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Errno("cannot remove the stale socket", path);
  }
  return absl::OkStatus();
}

// A listening socket at `path` with the given permissions; its inode in `inode`.
absl::StatusOr<int> Listen(const std::string& path, const UnixSocketOptions& options,
                           ino_t* inode) {
  RETURN_IF_ERROR(CheckPathLength(path));
  const std::string tmp = path + kTmpSuffix;
  const sockaddr_un tmp_address = Address(tmp);
  RETURN_IF_ERROR(RemoveStaleSocket(path));
  RETURN_IF_ERROR(RemoveStaleSocket(tmp));

  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("cannot create the socket", path);
  absl::Status status;
  struct stat st = {};
  if (bind(fd, reinterpret_cast<const sockaddr*>(&tmp_address), sizeof(tmp_address)) != 0) {
    status = Errno("cannot bind", tmp);
  } else if (chmod(tmp.c_str(), options.mode) != 0) {
    status = Errno("cannot set the mode of", tmp);
  } else if (options.group.has_value() && chown(tmp.c_str(), -1, *options.group) != 0) {
    status = Errno(absl::StrCat("cannot give group ", *options.group, " to"), tmp);
  } else if (lstat(tmp.c_str(), &st) != 0) {
    status = Errno("cannot stat", tmp);
  } else if (rename(tmp.c_str(), path.c_str()) != 0) {
    status = Errno(absl::StrCat("cannot rename ", tmp, " to"), path);
  } else if (listen(fd, kBacklog) != 0) {
    status = Errno("cannot listen on", path);
    unlink(path.c_str());
  }
  if (!status.ok()) {
    unlink(tmp.c_str());
    close(fd);
    return status;
  }
  *inode = st.st_ino;
  return fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(
    const std::vector<std::string>& paths, const UnixSocketOptions& options) {
  std::unique_ptr<UnixListener> listener(new UnixListener());
  listener->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (listener->wake_fd_ < 0) return Errno("cannot create an eventfd for", "the unix listener");
  for (const std::string& given : paths) {
    std::error_code ec;
    const std::string path = std::filesystem::absolute(given, ec).lexically_normal().string();
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("unix socket path ", given, ": ", ec.message()));
    }
    ino_t inode = 0;
    // On an error the listener's destructor removes the sockets made so far.
    ASSIGN_OR_RETURN(const int fd, Listen(path, options, &inode));
    listener->paths_.push_back(path);
    listener->inodes_.push_back(inode);
    listener->listen_fds_.push_back(fd);
  }
  return listener;
}

UnixListener::~UnixListener() {
  Stop();
  for (size_t i = 0; i < paths_.size(); ++i) {
    struct stat st = {};
    if (lstat(paths_[i].c_str(), &st) == 0 && S_ISSOCK(st.st_mode) && st.st_ino == inodes_[i]) {
      unlink(paths_[i].c_str());
    }
    close(listen_fds_[i]);
  }
  if (wake_fd_ >= 0) close(wake_fd_);
}

void UnixListener::Serve(grpc::Server* server) {
  accept_thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixListener::Stop() {
  if (!accept_thread_.joinable()) return;
  const uint64_t one = 1;
  while (write(wake_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
  accept_thread_.join();
}

void UnixListener::AcceptLoop(grpc::Server* server) {
  std::vector<pollfd> fds;
  for (int fd : listen_fds_) fds.push_back({fd, POLLIN, 0});
  fds.push_back({wake_fd_, POLLIN, 0});
  while (true) {
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds.back().revents != 0) return;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (fds[i].revents != 0) AcceptOne(fds[i].fd, server);
    }
  }
}

void UnixListener::AcceptOne(int listen_fd, grpc::Server* server) {
  // gRPC needs a non-blocking descriptor.
  const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    // Out of descriptors or memory: the connection stays queued and poll() would report it again
    // at once, so wait a little instead of spinning. (A client that left already: nothing to do.)
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      std::this_thread::sleep_for(kAcceptBackoff);
    }
    return;
  }
  ucred credentials = {};
  socklen_t size = sizeof(credentials);
  struct stat st = {};
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &size) != 0 ||
      size != sizeof(credentials) || fstat(fd, &st) != 0) {
    close(fd);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    peers_[fd] = Peer{credentials.uid, st.st_ino};
  }
  grpc::AddInsecureChannelFromFd(server, fd);  // gRPC owns the descriptor from here on
}

std::optional<uid_t> UnixListener::PeerUid(const std::string& peer) const {
  int fd = -1;
  if (!absl::StartsWith(peer, "fd:") || !absl::SimpleAtoi(peer.substr(3), &fd)) {
    return std::nullopt;
  }
  Peer known;
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(fd);
    if (it == peers_.end()) return std::nullopt;
    known = it->second;
  }
  struct stat st = {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_ino != known.inode) {
    return std::nullopt;
  }
  return known.uid;
}

}  // namespace quantd::api
