#include "server/api/unary_call.h"

#include <exception>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/scheduler/job_proto.h"

namespace quantd::api {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

grpc::ServerUnaryReactor* StartUnaryCall(
    grpc::CallbackServerContext* context, const char* method, metrics::Metrics* metrics,
    const std::function<absl::Status(const Finisher&)>& start) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const Finisher finish = [context, reactor, method, metrics](const absl::Status& status) {
    const std::string reason = scheduler::ReasonOf(status);
    if (!reason.empty()) context->AddTrailingMetadata(kReasonKey, reason);
    if (metrics != nullptr) {
      metrics->RpcHandled(method, absl::StatusCodeToString(status.code()));
    }
    reactor->Finish(ToGrpcStatus(status));
  };
  absl::Status refused;
  try {
    refused = start(finish);
  } catch (const std::exception& e) {
    refused = absl::InternalError(absl::StrCat(method, ": ", e.what()));
  } catch (...) {
    refused = absl::InternalError(absl::StrCat(method, ": unknown exception"));
  }
  if (!refused.ok()) finish(refused);
  return reactor;
}

}  // namespace quantd::api
