#include "server/scheduler/job_proto.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/types/optional.h"

namespace quantd::scheduler {
namespace {

// The absl::Status payload key that carries the reason between the scheduler and the service.
constexpr char kReasonPayload[] = "quantd-reason";
constexpr char kWorkerOwnerPrefix[] = "worker:";

}  // namespace

v1::JobState JobStateToProto(store::JobState state) {
  switch (state) {
    case store::JobState::kPending:
      return v1::PENDING;
    case store::JobState::kRunning:
      return v1::RUNNING;
    case store::JobState::kPaused:
      return v1::PAUSED;
    case store::JobState::kSucceeded:
      return v1::SUCCEEDED;
    case store::JobState::kFailed:
      return v1::FAILED;
    case store::JobState::kCancelled:
      return v1::CANCELLED;
  }
  return v1::JOB_STATE_UNSPECIFIED;
}

store::JobState JobStateFromProto(v1::JobState state) {
  switch (state) {
    case v1::RUNNING:
      return store::JobState::kRunning;
    case v1::PAUSED:
      return store::JobState::kPaused;
    case v1::SUCCEEDED:
      return store::JobState::kSucceeded;
    case v1::FAILED:
      return store::JobState::kFailed;
    case v1::CANCELLED:
      return store::JobState::kCancelled;
    default:
      return store::JobState::kPending;
  }
}

v1::StageProgress::State StageStateToProto(store::StageState state) {
  switch (state) {
    case store::StageState::kPending:
      return v1::StageProgress::PENDING;
    case store::StageState::kRunning:
      return v1::StageProgress::RUNNING;
    case store::StageState::kSucceeded:
      return v1::StageProgress::SUCCEEDED;
    case store::StageState::kFailed:
      return v1::StageProgress::FAILED;
  }
  return v1::StageProgress::STATE_UNSPECIFIED;
}

google::protobuf::Timestamp TimestampFromMs(int64_t unix_ms) {
  google::protobuf::Timestamp t;
  t.set_seconds(unix_ms / 1000);
  t.set_nanos(static_cast<int32_t>(unix_ms % 1000) * 1'000'000);
  return t;
}

absl::Status WithReason(absl::Status status, const std::string& reason) {
  status.SetPayload(kReasonPayload, absl::Cord(reason));
  return status;
}

std::string ReasonOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kReasonPayload);  // absl::optional here, not std::
  return payload.has_value() ? std::string(*payload) : std::string();
}

std::string WorkerLeaseOwner(const std::string& worker_name) {
  return absl::StrCat(kWorkerOwnerPrefix, worker_name);
}

std::string WorkerOfLeaseOwner(const std::string& owner) {
  absl::string_view name = owner;
  return absl::ConsumePrefix(&name, kWorkerOwnerPrefix) ? std::string(name) : std::string();
}

}  // namespace quantd::scheduler
