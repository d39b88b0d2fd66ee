// Conversions between the engine's types and the quantd.v1 messages, shared by the scheduler
// (snapshots), the gRPC service and quantctl.
#ifndef QUANTD_SERVER_SCHEDULER_JOB_PROTO_H_
#define QUANTD_SERVER_SCHEDULER_JOB_PROTO_H_

#include <stdint.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/timestamp.pb.h"
#include "quantd/v1/quantd.pb.h"
#include "server/job/job_spec.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {

// Validates a request's spec with the same rules (and messages) as a JSON spec file; errors are
// InvalidArgument naming the field: "SubmitJobRequest.spec: field 'weight_format' ...".
absl::StatusOr<job::JobSpec> JobSpecFromProto(const v1::JobSpec& spec);
// Every field spelled out, defaults included.
v1::JobSpec JobSpecToProto(const job::JobSpec& spec);
// The proto's JSON form of a spec as the JSON spec file spells it (snake_case keys, numbers as
// numbers), which ParseJobSpec reads.
std::string JobSpecProtoToJson(const v1::JobSpec& spec);

v1::JobState JobStateToProto(store::JobState state);
store::JobState JobStateFromProto(v1::JobState state);  // UNSPECIFIED maps to PENDING
v1::StageProgress::State StageStateToProto(store::StageState state);

google::protobuf::Timestamp TimestampFromMs(int64_t unix_ms);

// Attaches the machine-readable reason (quantd.proto: "quantd-reason") to a status, and reads it
// back ("" when none).
absl::Status WithReason(absl::Status status, const std::string& reason);
std::string ReasonOf(const absl::Status& status);

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_JOB_PROTO_H_
