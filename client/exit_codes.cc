#include "client/exit_codes.h"

namespace quantd::client {

int ExitCodeForStatus(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return kExitOk;
    case grpc::StatusCode::INVALID_ARGUMENT:
      return kExitUsage;
    case grpc::StatusCode::NOT_FOUND:
      return kExitNotFound;
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
      return kExitPrecondition;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return kExitUnavailable;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return kExitQueueFull;
    default:
      return kExitOther;
  }
}

int ExitCodeForFinalState(v1::JobState state) {
  return state == v1::SUCCEEDED ? kExitOk : kExitJobNotSucceeded;
}

}  // namespace quantd::client
