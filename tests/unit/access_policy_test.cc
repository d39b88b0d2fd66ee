// Access control without a server: token files, the access config (defaults, entries, errors that
// name the file and entry), token lookup, path containment and the allowed-roots check of a spec.
#include "server/api/access_policy.h"

#include <gtest/gtest.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/api/authorizer.h"
#include "server/api/token_file.h"
#include "tests/unit/test_dirs.h"

namespace quantd::api {
namespace {

namespace fs = std::filesystem;

constexpr uid_t kDaemonUid = 4321;
constexpr char kToken[] = "a-token-of-24-characters";

class AccessPolicyTest : public testing_util::TempDirTest {
 protected:
  // Writes `text` to dir_/name with `mode`; returns the path.
  std::string Write(const std::string& name, const std::string& text, mode_t mode = 0600) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    EXPECT_EQ(chmod(path.c_str(), mode), 0);
    return path;
  }

  absl::StatusOr<AccessPolicy> LoadConfig(const std::string& json) {
    return AccessPolicy::Load(Write("access.json", json), "", kDaemonUid);
  }
};

TEST_F(AccessPolicyTest, TokenFileRules) {
  EXPECT_EQ(*ReadTokenFile(Write("ok", std::string(kToken) + "\n"), TokenFileAccess::kPrivate),
            kToken);
  const std::string shared = Write("shared", kToken, 0640);
  EXPECT_EQ(ReadTokenFile(shared, TokenFileAccess::kPrivate).status().message(),
            "token file " + shared + ": readable by group or others (mode 0640); chmod 600 it");
  EXPECT_EQ(*ReadTokenFile(shared, TokenFileAccess::kAny), kToken);
  const std::string short_token = Write("short", "secret\n");
  EXPECT_EQ(ReadTokenFile(short_token, TokenFileAccess::kAny).status().message(),
            "token file " + short_token + ": the token must have 16 to 1024 characters, it has 6");
  const std::string spaced = Write("spaced", "a token with spaces in it");
  EXPECT_EQ(ReadTokenFile(spaced, TokenFileAccess::kAny).status().message(),
            "token file " + spaced + ": the token must be printable ASCII without spaces; byte 1 "
                                     "is not");
  // A FIFO is refused at once (no writer needed), a symlink is not followed.
  const std::string fifo = dir_ + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(ReadTokenFile(fifo, TokenFileAccess::kAny).status().message(),
            "token file " + fifo + ": not a regular file");
  const std::string link = dir_ + "/link";
  fs::create_symlink(dir_ + "/ok", link);
  EXPECT_EQ(ReadTokenFile(link, TokenFileAccess::kAny).status().message(),
            "token file " + link + ": cannot open (Too many levels of symbolic links)");
}

TEST_F(AccessPolicyTest, DefaultsWithoutConfig) {
  auto policy = AccessPolicy::Load("", "", kDaemonUid);
  ASSERT_TRUE(policy.ok()) << policy.status();
  for (uid_t owner : {kDaemonUid, uid_t{0}}) {
    const Grant grant = policy->ForUid(owner);
    EXPECT_EQ(grant.role, Role::kAdmin);
    EXPECT_TRUE(grant.any_path);
  }
  const Grant other = policy->ForUid(1001);
  EXPECT_EQ(other.caller, "uid 1001");
  EXPECT_EQ(other.role, Role::kReader);
  EXPECT_FALSE(other.any_path);
  EXPECT_FALSE(policy->has_tokens());
  EXPECT_FALSE(policy->ForToken(kToken).has_value());
  const Grant cert = policy->ForCertificate("ci");
  EXPECT_EQ(cert.caller, "client certificate CN=ci");
  EXPECT_EQ(cert.role, Role::kReader);
}

TEST_F(AccessPolicyTest, TokensMatchExactly) {
  const std::string admin = Write("admin.token", kToken);
  const std::string reader = Write("reader.token", "another-token-for-readers");
  auto policy = AccessPolicy::Load(
      Write("access.json", R"({"callers": [{"token_file": ")" + reader + R"(", "role": "reader"}]})"),
      admin, kDaemonUid);
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_TRUE(policy->has_tokens());
  std::optional<Grant> grant = policy->ForToken(kToken);
  ASSERT_TRUE(grant.has_value());
  EXPECT_EQ(grant->caller, "the token of " + admin);
  EXPECT_EQ(grant->role, Role::kAdmin);
  EXPECT_TRUE(grant->any_path);
  grant = policy->ForToken("another-token-for-readers");
  ASSERT_TRUE(grant.has_value());
  EXPECT_EQ(grant->role, Role::kReader);
  EXPECT_FALSE(grant->any_path);
  // One character off, a prefix, an extension, the empty token: unknown.
  EXPECT_FALSE(policy->ForToken("a-token-of-24-characterS").has_value());
  EXPECT_FALSE(policy->ForToken("a-token-of-24-character").has_value());
  EXPECT_FALSE(policy->ForToken("a-token-of-24-characters!").has_value());
  EXPECT_FALSE(policy->ForToken("").has_value());
}

TEST_F(AccessPolicyTest, WorkerTokensAndCertificatesHaveTheWorkerRole) {
  const std::string worker = Write("worker.token", "a-token-for-remote-workers");
  auto policy = LoadConfig(R"({"callers": [
      {"token_file": ")" + worker + R"(", "role": "worker"},
      {"tls_common_name": "node-07", "role": "worker"}]})");
  ASSERT_TRUE(policy.ok()) << policy.status();
  const std::optional<Grant> grant = policy->ForToken("a-token-for-remote-workers");
  ASSERT_TRUE(grant.has_value());
  EXPECT_EQ(grant->role, Role::kWorker);
  EXPECT_EQ(grant->caller, "the token of " + worker);
  EXPECT_FALSE(grant->any_path);
  EXPECT_EQ(policy->ForCertificate("node-07").role, Role::kWorker);
  EXPECT_STREQ(RoleName(Role::kWorker), "worker");
  EXPECT_STREQ(RoleName(Role::kAdmin), "admin");
  EXPECT_STREQ(RoleName(Role::kReader), "reader");
}

TEST_F(AccessPolicyTest, EntriesByUidUserAndCommonName) {
  fs::create_directories(dir_ + "/models/alice");
  auto policy = LoadConfig(R"({"callers": [
      {"uid": 1001, "role": "admin", "allowed_roots": [")" + dir_ + R"(/models/alice/"]},
      {"user": "root", "role": "reader"},
      {"uid": 4321, "role": "admin"},
      {"tls_common_name": "trainer", "role": "admin", "allowed_roots": ["/models/shared"]}]})");
  ASSERT_TRUE(policy.ok()) << policy.status();
  const Grant alice = policy->ForUid(1001);
  EXPECT_EQ(alice.role, Role::kAdmin);
  EXPECT_FALSE(alice.any_path);
  ASSERT_EQ(alice.allowed_roots.size(), 1u);
  EXPECT_EQ(alice.allowed_roots[0], fs::path(dir_ + "/models/alice"));
  EXPECT_EQ(policy->ForUid(0).role, Role::kReader);  // root's entry overrides the default
  EXPECT_TRUE(policy->ForUid(kDaemonUid).any_path);  // the daemon's uid without roots
  const Grant trainer = policy->ForCertificate("trainer");
  EXPECT_EQ(trainer.role, Role::kAdmin);
  EXPECT_EQ(trainer.allowed_roots, std::vector<fs::path>{"/models/shared"});
}

TEST_F(AccessPolicyTest, ConfigErrorsNameTheFileAndEntry) {
  const std::string file = dir_ + "/access.json";
  const std::string token = Write("t.token", kToken);
  const std::pair<std::string, std::string> cases[] = {
      {"[]", file + ": not a JSON object"},
      {R"({"users": []})", file + ": key 'users' is not a known setting"},
      {R"({"callers": {}})", file + ": 'callers' must be an array of objects"},
      {R"({"callers": [{"role": "admin"}]})",
       file + ": callers[0]: must name exactly one of uid, user, token_file, tls_common_name"},
      {R"({"callers": [{"uid": 1, "user": "root", "role": "admin"}]})",
       file + ": callers[0]: must name exactly one of uid, user, token_file, tls_common_name"},
      {R"({"callers": [{"uid": 1}]})",
       file + ": callers[0]: 'role' is missing (reader, admin or worker)"},
      {R"({"callers": [{"uid": 1, "role": "root"}]})",
       file + ": callers[0]: 'role' must be \"reader\", \"admin\" or \"worker\""},
      {R"({"callers": [{"uid": -1, "role": "admin"}]})",
       file + ": callers[0]: 'uid' must be a non-negative integer"},
      {R"({"callers": [{"uid": 1, "role": "admin", "allowed_roots": ["models"]}]})",
       file + ": callers[0]: 'allowed_roots' must be an array of absolute paths"},
      {R"({"callers": [{"uid": 1, "role": "admin", "color": "red"}]})",
       file + ": callers[0]: key 'color' is not a known setting"},
      {R"({"callers": [{"uid": 1, "role": "admin"}, {"uid": 1, "role": "reader"}]})",
       file + ": callers[1]: uid 1 has an earlier entry"},
      {R"({"callers": [{"user": "no-such-user-here", "role": "admin"}]})",
       file + ": callers[0]: no user named \"no-such-user-here\""},
      {R"({"callers": [{"token_file": ")" + token + R"(", "role": "admin"}, {"token_file": ")" +
           token + R"(", "role": "reader"}]})",
       file + ": callers[1]: the token of " + token + " is also the token of " + token},
  };
  for (const auto& [json, message] : cases) {
    auto policy = LoadConfig(json);
    EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_EQ(policy.status().message(), message) << json;
  }
}

TEST_F(AccessPolicyTest, PathContainment) {
  EXPECT_TRUE(PathIsInside("/models/alice/run1", "/models/alice"));
  EXPECT_TRUE(PathIsInside("/models/alice", "/models/alice"));
  EXPECT_FALSE(PathIsInside("/models/alice2", "/models/alice"));
  EXPECT_FALSE(PathIsInside("/models", "/models/alice"));
  EXPECT_TRUE(PathIsInside("/anything", "/"));
  EXPECT_EQ(ResolvePath("/models/alice/../bob/./out"), fs::path("/models/bob/out"));
  // A symlink inside a root that points out of it resolves to where it points.
  fs::create_directories(dir_ + "/alice");
  fs::create_directories(dir_ + "/secret");
  fs::create_directory_symlink(dir_ + "/secret", dir_ + "/alice/link");
  EXPECT_EQ(ResolvePath(dir_ + "/alice/link/out"), fs::path(dir_ + "/secret/out"));
  EXPECT_FALSE(PathIsInside(ResolvePath(dir_ + "/alice/link/out"), ResolvePath(dir_ + "/alice")));
}

TEST_F(AccessPolicyTest, CheckPathsNamesTheField) {
  Grant alice;
  alice.caller = "uid 1001";
  alice.role = Role::kAdmin;
  alice.allowed_roots = {"/models/alice", "/data/alice"};
  v1::JobSpec spec;
  spec.set_source("/models/alice/v4");
  spec.set_output("/models/alice/v4-nvfp4");
  spec.mutable_calibration()->set_dataset("/data/alice/cal.jsonl");
  EXPECT_TRUE(CheckPaths(alice, spec).ok());
  spec.mutable_calibration()->set_amax_file("/models/alice/../bob/amax.json");
  absl::Status s = CheckPaths(alice, spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(),
            "spec.calibration.amax_file: /models/bob/amax.json is outside the allowed roots of "
            "uid 1001 (/models/alice, /data/alice)");
  Grant no_roots = alice;
  no_roots.allowed_roots.clear();
  EXPECT_EQ(CheckPaths(no_roots, spec).message(),
            "spec.source: uid 1001 has no allowed_roots in the access config, so it may name no "
            "path");
  no_roots.any_path = true;
  EXPECT_TRUE(CheckPaths(no_roots, spec).ok());
  // The calibration's other paths: datasets named by index, amax_out (written) like the rest.
  spec.mutable_calibration()->clear_amax_file();
  spec.mutable_calibration()->add_datasets()->set_path("/data/alice/news.jsonl");
  spec.mutable_calibration()->add_datasets()->set_path("/data/bob/chat.jsonl");
  s = CheckPaths(alice, spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(),
            "spec.calibration.datasets[1].path: /data/bob/chat.jsonl is outside the allowed roots "
            "of uid 1001 (/models/alice, /data/alice)");
  spec.mutable_calibration()->mutable_datasets(1)->set_path("/data/alice/chat.jsonl");
  spec.mutable_calibration()->set_amax_out("/etc/quantd/amax.json");
  s = CheckPaths(alice, spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(),
            "spec.calibration.amax_out: /etc/quantd/amax.json is outside the allowed roots of "
            "uid 1001 (/models/alice, /data/alice)");
  spec.mutable_calibration()->set_amax_out("/models/alice/amax.json");
  EXPECT_TRUE(CheckPaths(alice, spec).ok());
  // An overlong path is neither resolved nor echoed.
  spec.set_output("/models/alice/" + std::string(PATH_MAX, 'x'));
  s = CheckPaths(alice, spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), absl::StrCat("spec.output: ", PATH_MAX + 14,
                                      " bytes, longer than PATH_MAX (", PATH_MAX, ")"));
}

}  // namespace
}  // namespace quantd::api
