// Conversions between the engine's types and the quantd.v1 messages, shared by the scheduler
// (snapshots), the gRPC service and quantctl. The spec's are job::ValidateJobSpec and
// job::JobSpecToProto (server/job/job_spec.h).
#ifndef QUANTD_SERVER_SCHEDULER_JOB_PROTO_H_
#define QUANTD_SERVER_SCHEDULER_JOB_PROTO_H_

#include <stdint.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/timestamp.pb.h"
#include "quantd/v1/quantd.pb.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {

v1::JobState JobStateToProto(store::JobState state);
store::JobState JobStateFromProto(v1::JobState state);  // UNSPECIFIED maps to PENDING
v1::StageProgress::State StageStateToProto(store::StageState state);

google::protobuf::Timestamp TimestampFromMs(int64_t unix_ms);

// Attaches the machine-readable reason (quantd.proto: "quantd-reason") to a status, and reads it
// back ("" when none).
absl::Status WithReason(absl::Status status, const std::string& reason);
std::string ReasonOf(const absl::Status& status);

// The lease owner of a remote worker's tasks (store::TaskRow::lease_owner, ran_by):
// "worker:<name>". WorkerOfLeaseOwner reads the name back, "" for any other owner (this quantd
// leases as "quantd:<pid>").
std::string WorkerLeaseOwner(const std::string& worker_name);
std::string WorkerOfLeaseOwner(const std::string& owner);

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_JOB_PROTO_H_
