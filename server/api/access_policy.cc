#include "server/api/access_policy.h"

#include <openssl/crypto.h>
#include <pwd.h>

#include <nlohmann/json.hpp>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/api/token_file.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/sha256.h"

namespace quantd::api {
namespace {

using nlohmann::json;

constexpr size_t kMaxConfigBytes = 1 << 20;

std::string Sha256Hex(std::string_view text) {
  checkpoint::Sha256 sha;
  sha.Update(text.data(), text.size());
  return sha.HexDigest();
}

// Reads one entry of "callers"; errors name the file and the entry.
class EntryReader {
 public:
  EntryReader(const std::string& path, size_t index, const json& entry)
      : path_(path), index_(index), entry_(entry) {}

  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": callers[", index_, "]: ", what));
  }

  absl::StatusOr<Role> ReadRole() const {
    const auto it = entry_.find("role");
    if (it == entry_.end()) return Error("'role' is missing (reader, admin or worker)");
    if (*it == "reader") return Role::kReader;
    if (*it == "admin") return Role::kAdmin;
    if (*it == "worker") return Role::kWorker;
    return Error("'role' must be \"reader\", \"admin\" or \"worker\"");
  }

  absl::StatusOr<std::vector<std::filesystem::path>> ReadRoots() const {
    std::vector<std::filesystem::path> roots;
    const auto it = entry_.find("allowed_roots");
    if (it == entry_.end()) return roots;
    if (!it->is_array()) return Error("'allowed_roots' must be an array of absolute paths");
    for (const json& root : *it) {
      if (!root.is_string() || root.get<std::string>().empty() ||
          root.get<std::string>()[0] != '/') {
        return Error("'allowed_roots' must be an array of absolute paths");
      }
      roots.push_back(ResolvePath(root.get<std::string>()));
    }
    return roots;
  }

 private:
  const std::string& path_;  // the config file, for errors
  const size_t index_;       // the entry's index in "callers"
  const json& entry_;        // the entry
};

absl::StatusOr<uid_t> LookUpUser(const std::string& name) {
  struct passwd pw = {};
  struct passwd* found = nullptr;
  std::vector<char> buffer(16384);
  if (getpwnam_r(name.c_str(), &pw, buffer.data(), buffer.size(), &found) != 0 ||
      found == nullptr) {
    return absl::NotFoundError(absl::StrCat("no user named \"", name, "\""));
  }
  return found->pw_uid;
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kAdmin:
      return "admin";
    case Role::kWorker:
      return "worker";
    case Role::kReader:
      break;
  }
  return "reader";
}

std::filesystem::path ResolvePath(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::path absolute = std::filesystem::absolute(path, ec);
  if (ec) absolute = path;
  std::filesystem::path resolved = std::filesystem::weakly_canonical(absolute, ec);
  if (ec) return absolute.lexically_normal();
  return resolved.lexically_normal();
}

bool PathIsInside(const std::filesystem::path& path, const std::filesystem::path& root) {
  auto p = path.begin();
  for (auto r = root.begin(); r != root.end(); ++r, ++p) {
    if (r->empty()) continue;  // the trailing "" of "/models/alice/"
    if (p == path.end() || *p != *r) return false;
  }
  return true;
}

absl::StatusOr<AccessPolicy> AccessPolicy::Load(const std::string& config_path,
                                                const std::string& token_file, uid_t daemon_uid) {
  AccessPolicy policy;
  policy.daemon_uid_ = daemon_uid;
  if (!token_file.empty()) {
    ASSIGN_OR_RETURN(const std::string token, ReadTokenFile(token_file, TokenFileAccess::kPrivate));
    Grant grant;
    grant.caller = absl::StrCat("the token of ", token_file);
    grant.role = Role::kAdmin;
    grant.any_path = true;
    policy.tokens_.push_back({Sha256Hex(token), std::move(grant)});
  }
  if (config_path.empty()) return policy;

  absl::StatusOr<std::string> text = checkpoint::ReadFile(config_path, kMaxConfigBytes);
  if (!text.ok()) return absl::InvalidArgumentError(text.status().message());
  if (text->size() > kMaxConfigBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path, ": larger than ", kMaxConfigBytes, " bytes"));
  }
  const json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(config_path, ": not a JSON object"));
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "callers") {
      return absl::InvalidArgumentError(
          absl::StrCat(config_path, ": key '", it.key(), "' is not a known setting"));
    }
  }
  const auto callers = j.find("callers");
  if (callers == j.end()) return policy;
  if (!callers->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path, ": 'callers' must be an array of objects"));
  }
  for (size_t i = 0; i < callers->size(); ++i) {
    const json& entry = (*callers)[i];
    const EntryReader r(config_path, i, entry);
    if (!entry.is_object()) return r.Error("must be an object");
    int selectors = 0;
    for (auto field = entry.begin(); field != entry.end(); ++field) {
      const std::string& key = field.key();
      if (key == "uid" || key == "user" || key == "token_file" || key == "tls_common_name") {
        ++selectors;
      } else if (key != "role" && key != "allowed_roots") {
        return r.Error(absl::StrCat("key '", key, "' is not a known setting"));
      }
    }
    if (selectors != 1) {
      return r.Error("must name exactly one of uid, user, token_file, tls_common_name");
    }
    Grant grant;
    ASSIGN_OR_RETURN(grant.role, r.ReadRole());
    ASSIGN_OR_RETURN(grant.allowed_roots, r.ReadRoots());

    if (entry.contains("uid") || entry.contains("user")) {
      uid_t uid = 0;
      if (entry.contains("uid")) {
        const json& value = entry["uid"];
        if (!value.is_number_unsigned() || value.get<uint64_t>() >= uint64_t{1} << 32) {
          return r.Error("'uid' must be a non-negative integer");
        }
        uid = static_cast<uid_t>(value.get<uint64_t>());
      } else {
        if (!entry["user"].is_string()) return r.Error("'user' must be a string");
        absl::StatusOr<uid_t> found = LookUpUser(entry["user"].get<std::string>());
        if (!found.ok()) return r.Error(std::string(found.status().message()));
        uid = *found;
      }
      grant.caller = absl::StrCat("uid ", uid);
      grant.any_path = grant.allowed_roots.empty() && (uid == daemon_uid || uid == 0);
      if (!policy.uids_.emplace(uid, std::move(grant)).second) {
        return r.Error(absl::StrCat("uid ", uid, " has an earlier entry"));
      }
    } else if (entry.contains("token_file")) {
      if (!entry["token_file"].is_string()) return r.Error("'token_file' must be a string");
      const std::string file = entry["token_file"].get<std::string>();
      absl::StatusOr<std::string> token = ReadTokenFile(file, TokenFileAccess::kPrivate);
      if (!token.ok()) return r.Error(std::string(token.status().message()));
      const std::string digest = Sha256Hex(*token);
      for (const TokenGrant& known : policy.tokens_) {
        if (known.sha256 == digest) {
          return r.Error(absl::StrCat("the token of ", file, " is also ", known.grant.caller));
        }
      }
      grant.caller = absl::StrCat("the token of ", file);
      policy.tokens_.push_back({digest, std::move(grant)});
    } else {
      if (!entry["tls_common_name"].is_string() ||
          entry["tls_common_name"].get<std::string>().empty()) {
        return r.Error("'tls_common_name' must be a non-empty string");
      }
      const std::string name = entry["tls_common_name"].get<std::string>();
      grant.caller = absl::StrCat("client certificate CN=", name);
      if (!policy.common_names_.emplace(name, std::move(grant)).second) {
        return r.Error(absl::StrCat("tls_common_name \"", name, "\" has an earlier entry"));
      }
    }
  }
  return policy;
}

Grant AccessPolicy::ForUid(uid_t uid) const {
  if (auto it = uids_.find(uid); it != uids_.end()) return it->second;
  Grant grant;
  grant.caller = absl::StrCat("uid ", uid);
  const bool owner = uid == daemon_uid_ || uid == 0;
  grant.role = owner ? Role::kAdmin : Role::kReader;
  grant.any_path = owner;
  return grant;
}

std::optional<Grant> AccessPolicy::ForToken(std::string_view token) const {
  const std::string digest = Sha256Hex(token);
  const TokenGrant* match = nullptr;
  for (const TokenGrant& known : tokens_) {  // no early exit: every comparison is made
    if (CRYPTO_memcmp(known.sha256.data(), digest.data(), digest.size()) == 0) match = &known;
  }
  if (match == nullptr) return std::nullopt;
  return match->grant;
}

Grant AccessPolicy::ForCertificate(const std::string& common_name) const {
  if (auto it = common_names_.find(common_name); it != common_names_.end()) return it->second;
  Grant grant;
  grant.caller = absl::StrCat("client certificate CN=", common_name);
  return grant;
}

}  // namespace quantd::api
