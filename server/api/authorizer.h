// Authorizer: the access check at the top of every QuantService handler. Identifies the caller of
// a call (the peer uid on a unix socket, else a bearer token in the "authorization" metadata, else
// a verified TLS client certificate), asks the AccessPolicy for its grant and checks the role the
// RPC needs and, for job paths, the caller's allowed roots.
//
// Readers may call GetJob, ListJobs, WatchJob, GetJobReport and ListWorkers; SubmitJob,
// CancelJob, ResumeJob and DeleteJob need the admin role; WorkerService needs the worker role,
// which may call nothing else, and an admin with allowed_roots may submit or change only
// jobs whose paths all lie inside them. Health checking and reflection are gRPC's own services and
// need no credentials (they reveal no job).
//
// Errors: UNAUTHENTICATED (reason NOT_AUTHENTICATED) when no caller is known, PERMISSION_DENIED
// with reason ADMIN_ONLY or WORKER_ONLY (the role a call needs), WORKER_ROLE (a worker called
// QuantService) or PATH_NOT_ALLOWED (a path, named by its spec field).
#ifndef QUANTD_SERVER_API_AUTHORIZER_H_
#define QUANTD_SERVER_API_AUTHORIZER_H_

#include <grpcpp/grpcpp.h>
#include <stdint.h>

#include <functional>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "quantd/v1/quantd.pb.h"
#include "server/api/access_policy.h"
#include "server/api/unix_listener.h"

namespace quantd::api {

class Authorizer {
 public:
  // The spec of a job, nullopt when there is no such job.
  using JobSpecLookup = std::function<std::optional<v1::JobSpec>(int64_t id)>;

  // None of the pointers is owned; `unix_listener` may be nullptr (no unix sockets).
  Authorizer(const AccessPolicy* policy, const UnixListener* unix_listener, JobSpecLookup job_spec);

  // GetJob, ListJobs, WatchJob, GetJobReport, ListWorkers (`method`): any known caller but a
  // worker.
  absl::Status AllowRead(const grpc::ServerContextBase& context, const char* method) const;
  // WorkerService's `method`: a worker only. Returns its grant.
  absl::StatusOr<Grant> AllowWorker(const grpc::ServerContextBase& context,
                                    const char* method) const;
  // SubmitJob: an admin whose allowed roots hold every path of `spec`. Returns the roots that
  // symbolic links inside the job's source may lead into (job::JobSpec::source_roots): the
  // caller's allowed roots, or nullopt for a caller that may name any path.
  absl::StatusOr<std::optional<std::vector<std::string>>> AllowSubmit(
      const grpc::ServerContextBase& context, const v1::JobSpec& spec) const;
  // CancelJob, ResumeJob, DeleteJob (`method`) of job `id`: an admin whose allowed roots hold every
  // path of the job (a job that does not exist passes, so that the RPC answers NOT_FOUND).
  absl::Status AllowChange(const grpc::ServerContextBase& context, const char* method,
                           int64_t id) const;

  // The grant of the caller of `context`; UNAUTHENTICATED when none is known.
  absl::StatusOr<Grant> Identify(const grpc::ServerContextBase& context) const;

 private:
  const AccessPolicy* const policy_;         // grants; not owned
  const UnixListener* const unix_listener_;  // peer uids; not owned, may be nullptr
  const JobSpecLookup job_spec_;             // specs of existing jobs
};

// PERMISSION_DENIED naming the first field of `spec` whose path is outside `grant`'s allowed roots
// (source, output, materialize_bf16, calibration.amax_file, calibration.dataset,
// calibration.datasets[i].path, calibration.amax_out; the roots serve reads and writes alike),
// INVALID_ARGUMENT for a path of PATH_MAX bytes or more (a caller restricted to roots only); OK
// otherwise.
absl::Status CheckPaths(const Grant& grant, const v1::JobSpec& spec);

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_AUTHORIZER_H_
