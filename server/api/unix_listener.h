// UnixListener: the daemon's unix sockets, served by a gRPC server whose callers are known by uid.
//
// gRPC 1.51 names a unix-socket peer "unix:" plus the socket path, the same for every client, and
// its local credentials do not carry the peer's uid. So quantd accepts on its unix sockets itself,
// reads each connection's SO_PEERCRED uid, and hands the connection to the server
// (grpc::AddInsecureChannelFromFd); gRPC then names the peer "fd:N", and PeerUid maps that back to
// the uid. gRPC closes a connection's descriptor only when its transport is destroyed, after every
// call on it has ended, so while a call runs "fd:N" names that call's connection; PeerUid also
// checks that descriptor N is still the socket it accepted.
//
// Each socket is created under a temporary name, given its mode and group and only then renamed
// into place and opened for connections, so no one connects while it has the wrong permissions.
#ifndef QUANTD_SERVER_API_UNIX_LISTENER_H_
#define QUANTD_SERVER_API_UNIX_LISTENER_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace quantd::api {

struct UnixSocketOptions {
  mode_t mode = 0660;          // permissions of every socket file
  std::optional<gid_t> group;  // its group; nullopt: the daemon's
};

class UnixListener {
 public:
  // Creates and binds every socket (absolute or relative paths). A stale socket at a path (no one
  // accepts on it) is replaced; a live one, or anything that is not a socket, is an error naming
  // the path (Unavailable, resp. FailedPrecondition). InvalidArgument for a path longer than a
  // socket address holds.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(const std::vector<std::string>& paths,
                                                            const UnixSocketOptions& options);
  // Stop(), then removes the socket files it created.
  ~UnixListener();
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Starts accepting: every connection goes to `server` (which must outlive Stop()).
  void Serve(grpc::Server* server);
  // Stops accepting and waits for the accepting thread; connections already handed over stay with
  // the server. Later calls do nothing.
  void Stop();

  // The uid of the peer that gRPC names `peer` ("fd:N"); nullopt for any other peer.
  std::optional<uid_t> PeerUid(const std::string& peer) const;

  // The socket paths, absolute, in the order given.
  const std::vector<std::string>& paths() const { return paths_; }

 private:
  struct Peer {
    uid_t uid;    // SO_PEERCRED of the connection
    ino_t inode;  // its socket's inode, to recognise the descriptor later
  };

  UnixListener() = default;
  void AcceptLoop(grpc::Server* server);
  // Accepts one connection on `listen_fd` and hands it to `server`.
  void AcceptOne(int listen_fd, grpc::Server* server);

  std::vector<std::string> paths_;  // socket files, absolute
  std::vector<ino_t> inodes_;       // their inodes, so that only our own files are removed
  std::vector<int> listen_fds_;     // one listening descriptor per path
  int wake_fd_ = -1;                // eventfd that ends AcceptLoop
  std::thread accept_thread_;       // runs AcceptLoop while serving

  mutable absl::Mutex mu_;
  std::map<int, Peer> peers_ ABSL_GUARDED_BY(mu_);  // by descriptor: the connection accepted last
};

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_UNIX_LISTENER_H_
