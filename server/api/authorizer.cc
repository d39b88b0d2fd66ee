#include "server/api/authorizer.h"

#include <limits.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "server/scheduler/job_proto.h"

namespace quantd::api {
namespace {

using scheduler::WithReason;

constexpr char kNotAuthenticated[] = "NOT_AUTHENTICATED";
constexpr char kAdminOnly[] = "ADMIN_ONLY";
constexpr char kPathNotAllowed[] = "PATH_NOT_ALLOWED";
constexpr char kInvalidSpec[] = "INVALID_SPEC";

constexpr char kAuthorizationKey[] = "authorization";
constexpr char kBearerPrefix[] = "Bearer ";

absl::Status NotAuthenticated(const std::string& message) {
  return WithReason(absl::UnauthenticatedError(message), kNotAuthenticated);
}

constexpr char kWorkerOnly[] = "WORKER_ONLY";
constexpr char kWorkerRole[] = "WORKER_ROLE";

absl::Status CheckNotWorker(const Grant& grant, const char* method) {
  if (grant.role != Role::kWorker) return absl::OkStatus();
  return WithReason(absl::PermissionDeniedError(absl::StrCat(
                        method, ": ", grant.caller,
                        " has the worker role, which may call quantd.v1.WorkerService only")),
                    kWorkerRole);
}

absl::Status CheckAdmin(const Grant& grant, const char* method) {
  if (grant.role == Role::kAdmin) return absl::OkStatus();
  return WithReason(
      absl::PermissionDeniedError(absl::StrCat(method, " needs the admin role; ", grant.caller,
                                               " is a ", RoleName(grant.role))),
      kAdminOnly);
}

}  // namespace

absl::Status CheckPaths(const Grant& grant, const v1::JobSpec& spec) {
  if (grant.any_path) return absl::OkStatus();
  std::vector<std::pair<std::string, const std::string*>> fields = {
      {"source", &spec.source()},
      {"output", &spec.output()},
      {"materialize_bf16", &spec.materialize_bf16()},
      {"calibration.amax_file", &spec.calibration().amax_file()},
      {"calibration.dataset", &spec.calibration().dataset()},
  };
  for (int i = 0; i < spec.calibration().datasets_size(); ++i) {
    fields.emplace_back(absl::StrCat("calibration.datasets[", i, "].path"),
                        &spec.calibration().datasets(i).path());
  }
  fields.emplace_back("calibration.amax_out", &spec.calibration().amax_out());
  for (const auto& [field, value] : fields) {
    if (value->empty()) continue;
    if (value->size() >= PATH_MAX) {  // not resolved, not echoed
      return WithReason(absl::InvalidArgumentError(absl::StrCat(
                            "spec.", field, ": ", value->size(), " bytes, longer than PATH_MAX (",
                            PATH_MAX, ")")),
                        kInvalidSpec);
    }
    if (grant.allowed_roots.empty()) {
      return WithReason(absl::PermissionDeniedError(absl::StrCat(
                            "spec.", field, ": ", grant.caller,
                            " has no allowed_roots in the access config, so it may name no path")),
                        kPathNotAllowed);
    }
    const std::filesystem::path resolved = ResolvePath(*value);
    bool inside = false;
    for (const std::filesystem::path& root : grant.allowed_roots) {
      inside = inside || PathIsInside(resolved, root);
    }
    if (!inside) {
      std::vector<std::string> roots;
      for (const std::filesystem::path& root : grant.allowed_roots) roots.push_back(root.string());
      return WithReason(
          absl::PermissionDeniedError(absl::StrCat(
              "spec.", field, ": ", resolved.string(), " is outside the allowed roots of ",
              grant.caller, " (", absl::StrJoin(roots, ", "), ")")),
          kPathNotAllowed);
    }
  }
  return absl::OkStatus();
}

Authorizer::Authorizer(const AccessPolicy* policy, const UnixListener* unix_listener,
                       JobSpecLookup job_spec)
    : policy_(policy), unix_listener_(unix_listener), job_spec_(std::move(job_spec)) {}

absl::StatusOr<Grant> Authorizer::Identify(const grpc::ServerContextBase& context) const {
  if (unix_listener_ != nullptr) {
    if (std::optional<uid_t> uid = unix_listener_->PeerUid(context.peer())) {
      return policy_->ForUid(*uid);
    }
  }
  const auto& metadata = context.client_metadata();
  if (auto it = metadata.find(kAuthorizationKey); it != metadata.end()) {
    const absl::string_view value(it->second.data(), it->second.size());
    if (!absl::StartsWith(value, kBearerPrefix)) {
      return NotAuthenticated("authorization metadata: expected \"Bearer <token>\"");
    }
    const absl::string_view token = value.substr(sizeof(kBearerPrefix) - 1);
    std::optional<Grant> grant = policy_->ForToken(std::string_view(token.data(), token.size()));
    if (!grant.has_value()) return NotAuthenticated("the bearer token is not one quantd knows");
    return *std::move(grant);
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    const std::vector<grpc::string_ref> names = auth->FindPropertyValues("x509_common_name");
    if (!names.empty())
      return policy_->ForCertificate(std::string(names[0].data(), names[0].size()));
  }
  return NotAuthenticated(
      "no credentials: connect over quantd's unix socket, or send a bearer token (quantctl "
      "--token-file) or a client certificate (quantctl --tls-cert/--tls-key)");
}

absl::Status Authorizer::AllowRead(const grpc::ServerContextBase& context,
                                   const char* method) const {
  ASSIGN_OR_RETURN(const Grant grant, Identify(context));
  return CheckNotWorker(grant, method);
}

absl::StatusOr<Grant> Authorizer::AllowWorker(const grpc::ServerContextBase& context,
                                              const char* method) const {
  ASSIGN_OR_RETURN(Grant grant, Identify(context));
  if (grant.role == Role::kWorker) return grant;
  return WithReason(
      absl::PermissionDeniedError(absl::StrCat("WorkerService.", method,
                                               " needs the worker role; ", grant.caller, " is a",
                                               grant.role == Role::kAdmin ? "n " : " ",
                                               RoleName(grant.role))),
      kWorkerOnly);
}

absl::StatusOr<std::optional<std::vector<std::string>>> Authorizer::AllowSubmit(
    const grpc::ServerContextBase& context, const v1::JobSpec& spec) const {
  ASSIGN_OR_RETURN(const Grant grant, Identify(context));
  RETURN_IF_ERROR(CheckAdmin(grant, "SubmitJob"));
  RETURN_IF_ERROR(CheckPaths(grant, spec));
  std::optional<std::vector<std::string>> roots;
  if (grant.any_path) return roots;
  roots.emplace();
  for (const std::filesystem::path& root : grant.allowed_roots) roots->push_back(root.string());
  return roots;
}

absl::Status Authorizer::AllowChange(const grpc::ServerContextBase& context, const char* method,
                                     int64_t id) const {
  ASSIGN_OR_RETURN(const Grant grant, Identify(context));
  RETURN_IF_ERROR(CheckAdmin(grant, method));
  if (grant.any_path) return absl::OkStatus();
  std::optional<v1::JobSpec> spec = job_spec_(id);
  if (!spec.has_value()) return absl::OkStatus();
  absl::Status paths = CheckPaths(grant, *spec);
  if (paths.ok()) return paths;
  return WithReason(
      absl::PermissionDeniedError(absl::StrCat(method, " of job ", id, ": ", paths.message())),
      kPathNotAllowed);
}

}  // namespace quantd::api
