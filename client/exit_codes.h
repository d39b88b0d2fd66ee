// quantctl's exit codes (README): what scripts can rely on.
#ifndef QUANTD_CLIENT_EXIT_CODES_H_
#define QUANTD_CLIENT_EXIT_CODES_H_

#include <grpcpp/support/status.h>

#include "quantd/v1/quantd.pb.h"

namespace quantd::client {

constexpr int kExitOk = 0;
constexpr int kExitJobNotSucceeded = 1;  // a watched job ended FAILED, CANCELLED or PAUSED
constexpr int kExitUsage = 2;            // usage error or INVALID_ARGUMENT
constexpr int kExitNotFound = 3;
constexpr int kExitPrecondition = 4;  // FAILED_PRECONDITION or ALREADY_EXISTS
constexpr int kExitUnavailable = 5;   // UNAVAILABLE or DEADLINE_EXCEEDED
constexpr int kExitQueueFull = 6;     // RESOURCE_EXHAUSTED
constexpr int kExitOther = 7;
constexpr int kExitInterrupted = 130;  // Ctrl-C during watch (the job keeps running)

// The exit code for an RPC that ended with `code` (kExitOk for OK).
int ExitCodeForStatus(grpc::StatusCode code);
// The exit code of watch / submit --watch when the job reached `state`.
int ExitCodeForFinalState(v1::JobState state);

}  // namespace quantd::client

#endif  // QUANTD_CLIENT_EXIT_CODES_H_
