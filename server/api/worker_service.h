// WorkerService: the quantd.v1.WorkerService gRPC service (callback API) through which remote
// workers (`quantd worker`) lease tasks from the scheduler (scheduler.h "Remote workers"). Every
// call needs the worker role (authorizer.h). Every request field is checked on the gRPC thread
// (bounded sizes, ranges, printable names; errors name the field and never quote it) before the
// call is posted to the scheduler's strand, which finishes it; a Lease waits there for a task
// (long poll) without holding a gRPC thread.
#ifndef QUANTD_SERVER_API_WORKER_SERVICE_H_
#define QUANTD_SERVER_API_WORKER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "quantd/v1/quantd.grpc.pb.h"
#include "server/api/authorizer.h"
#include "server/metrics/metrics.h"
#include "server/scheduler/scheduler.h"

namespace quantd::api {

// The longest Lease wait a worker may ask for.
inline constexpr int kMaxLeaseWaitMs = 30'000;

class WorkerService final : public v1::WorkerService::CallbackService {
 public:
  // No pointer is owned; `metrics` may be nullptr; `authorizer` nullptr allows every call (tests
  // in one process only).
  WorkerService(scheduler::Scheduler* scheduler, metrics::Metrics* metrics,
                const Authorizer* authorizer);

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const v1::RegisterWorkerRequest* request,
                                     v1::RegisterWorkerResponse* response) override;
  grpc::ServerUnaryReactor* Lease(grpc::CallbackServerContext* context,
                                  const v1::LeaseTaskRequest* request,
                                  v1::LeaseTaskResponse* response) override;
  grpc::ServerUnaryReactor* Renew(grpc::CallbackServerContext* context,
                                  const v1::RenewLeaseRequest* request,
                                  v1::RenewLeaseResponse* response) override;
  grpc::ServerUnaryReactor* Complete(grpc::CallbackServerContext* context,
                                     const v1::CompleteTaskRequest* request,
                                     v1::CompleteTaskResponse* response) override;
  grpc::ServerUnaryReactor* Fail(grpc::CallbackServerContext* context,
                                 const v1::FailTaskRequest* request,
                                 v1::FailTaskResponse* response) override;

 private:
  // The worker role (authorizer.h), or anything without an authorizer.
  absl::Status Allow(const grpc::CallbackServerContext& context, const char* method) const;

  scheduler::Scheduler* const scheduler_;  // not owned
  metrics::Metrics* const metrics_;        // not owned; may be nullptr
  const Authorizer* const authorizer_;     // not owned; nullptr = every call allowed
};

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_WORKER_SERVICE_H_
