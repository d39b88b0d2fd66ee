// StartUnaryCall: how every unary handler of quantd's gRPC services (QuantService, WorkerService)
// runs on the callback API: `start` runs on the gRPC thread and either fails at once or hands the
// Finisher to whoever answers later (the scheduler's strand), so no gRPC thread ever waits. The
// Finisher adds the machine-readable reason (scheduler::ReasonOf) as trailing metadata
// "quantd-reason", counts the call in the metrics and finishes it; an exception becomes INTERNAL.
#ifndef QUANTD_SERVER_API_UNARY_CALL_H_
#define QUANTD_SERVER_API_UNARY_CALL_H_

#include <grpcpp/grpcpp.h>

#include <functional>

#include "absl/status/status.h"
#include "server/metrics/metrics.h"

namespace quantd::api {

// The trailing-metadata key of the reason (quantd.proto).
inline constexpr char kReasonKey[] = "quantd-reason";

// Completes a unary call; callable from any thread, once.
using Finisher = std::function<void(const absl::Status&)>;

// `metrics` may be nullptr; `method` must outlive the call (a literal).
grpc::ServerUnaryReactor* StartUnaryCall(grpc::CallbackServerContext* context, const char* method,
                                         metrics::Metrics* metrics,
                                         const std::function<absl::Status(const Finisher&)>& start);

// The absl::Status as a grpc::Status (same code and message).
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_UNARY_CALL_H_
