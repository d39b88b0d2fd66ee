// AccessPolicy: who a caller is allowed to be. Maps each kind of caller identity (the peer uid on
// the unix socket, a bearer token, a TLS client certificate) to a Grant: a role and the roots that
// the caller's job paths must lie in. README "Security model" describes it for operators.
//
// The access config (quantd serve --access-config FILE) is a JSON object:
//   {"callers": [
//     {"uid": 1001, "role": "admin", "allowed_roots": ["/models/alice"]},
//     {"user": "bob", "role": "reader"},
//     {"token_file": "/etc/quantd/ci.token", "role": "admin", "allowed_roots": ["/models/ci"]},
//     {"tls_common_name": "trainer-01", "role": "admin", "allowed_roots": ["/models/shared"]}]}
// Each entry names exactly one of uid, user (resolved to its uid at start), token_file (a
// 0600 file read at start; see token_file.h) or tls_common_name (the CN of a client certificate
// that --tls-client-ca verified), a role ("reader", "admin" or "worker") and optionally
// allowed_roots (absolute directories, resolved at start).
//
// Callers without an entry: the daemon's own uid and root are admins that may name any path; any
// other uid that can open the socket (mode 0660: the socket's group) is a reader; the token of
// --token-file is an admin that may name any path; a client certificate the CA verified is a
// reader; any other token is unknown. An entry without allowed_roots may name no path at all unless
// it is the daemon's own uid or root.
#ifndef QUANTD_SERVER_API_ACCESS_POLICY_H_
#define QUANTD_SERVER_API_ACCESS_POLICY_H_

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace quantd::api {

// A worker (`quantd worker`) may call quantd.v1.WorkerService and nothing else; readers and
// admins may not call it.
enum class Role { kReader, kAdmin, kWorker };

// "reader", "admin" or "worker".
const char* RoleName(Role role);

// What one caller may do.
struct Grant {
  std::string caller;  // who, for messages: "uid 1001", "the token of /etc/quantd/ci.token"
  Role role = Role::kReader;
  bool any_path = false;  // may name any path (the daemon's own user, root, --token-file)
  std::vector<std::filesystem::path> allowed_roots;  // resolved; job paths must lie inside one
};

class AccessPolicy {
 public:
  // Reads the access config at `config_path` (empty: none) and the admin token in `token_file`
  // (empty: none). InvalidArgument naming the file and the entry for any error. `daemon_uid` is
  // the daemon's effective uid.
  static absl::StatusOr<AccessPolicy> Load(const std::string& config_path,
                                           const std::string& token_file, uid_t daemon_uid);

  // The grant of a unix-socket peer.
  Grant ForUid(uid_t uid) const;
  // The grant of a bearer token; nullopt for a token the policy does not know. Compares the
  // token's SHA-256 with every known one in constant time.
  std::optional<Grant> ForToken(std::string_view token) const;
  // The grant of a verified client certificate with this common name.
  Grant ForCertificate(const std::string& common_name) const;

  // Some token is known (TCP callers can authenticate without a client certificate).
  bool has_tokens() const { return !tokens_.empty(); }

 private:
  struct TokenGrant {
    std::string sha256;  // hex digest of the token
    Grant grant;
  };

  uid_t daemon_uid_ = 0;
  std::map<uid_t, Grant> uids_;                // entries by uid (and user)
  std::vector<TokenGrant> tokens_;             // entries by token, --token-file's included
  std::map<std::string, Grant> common_names_;  // entries by tls_common_name
};

// `path` made absolute (against the daemon's working directory) and resolved: symlinks of its
// existing part followed, "." and ".." removed.
std::filesystem::path ResolvePath(const std::filesystem::path& path);

// Whether the resolved `path` is the resolved `root` or lies inside it, compared by component:
// "/models/alice2" is not inside "/models/alice".
bool PathIsInside(const std::filesystem::path& path, const std::filesystem::path& root);

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_ACCESS_POLICY_H_
