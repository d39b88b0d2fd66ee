#include "server/api/quant_service.h"

#include <grpcpp/alarm.h>
#include <stdint.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/base/status_macros.h"
#include "server/base/utf8.h"
#include "server/job/job_paths.h"
#include "server/job/job_spec.h"
#include "server/scheduler/job_proto.h"

namespace quantd::api {
namespace {

using scheduler::WithReason;

// Reasons for the errors the service detects itself (quantd.proto lists the others).
constexpr char kInvalidRequest[] = "INVALID_REQUEST";  // a request field other than the spec
constexpr char kInvalidSpec[] = "INVALID_SPEC";
constexpr char kJobNotFound[] = "JOB_NOT_FOUND";
constexpr char kShuttingDown[] = "SHUTTING_DOWN";
constexpr char kOutputInUse[] = "OUTPUT_IN_USE";

constexpr size_t kMaxRequestIdLength = 128;
constexpr int kDefaultPageSize = 100;
constexpr int kMaxPageSize = 1000;
// A ListJobs response stays below this many bytes, under gRPC's default 4 MiB receive limit.
constexpr size_t kMaxListResponseBytes = 3 << 20;
// A page token is the decimal id of the previous page's last job; longer ones are not ours.
constexpr size_t kMaxPageTokenLength = 18;

absl::Status InvalidRequest(const std::string& message) {
  return WithReason(absl::InvalidArgumentError(message), kInvalidRequest);
}

absl::Status CheckId(int64_t id) {
  if (id > 0) return absl::OkStatus();
  return InvalidRequest(absl::StrCat("id: must be > 0, got ", id));
}

absl::Status CheckRequestId(const std::string& id) {
  if (id.size() > kMaxRequestIdLength) {
    return InvalidRequest(
        absl::StrCat("request_id: at most ", kMaxRequestIdLength, " characters, got ", id.size()));
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    if (c < 0x20 || c > 0x7e) {
      return InvalidRequest(absl::StrFormat(
          "request_id: must be printable ASCII, byte 0x%02x at offset %d is not", c, i));
    }
  }
  return absl::OkStatus();
}

// Every string of the spec (paths, globs, names) must be valid UTF-8 (nlohmann refuses to write
// anything else into the JSON spec) and at most a path long; the error names the field and never
// quotes it. ValidateJobSpec applies the finer limits (globs) afterwards.
absl::Status CheckSpecText(const google::protobuf::Message& message, const std::string& prefix) {
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const google::protobuf::Reflection* reflection = message.GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    const std::string name = absl::StrCat(prefix, field->name());
    if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
      if (!field->is_repeated()) {
        if (!reflection->HasField(message, field)) continue;
        RETURN_IF_ERROR(CheckSpecText(reflection->GetMessage(message, field), name + "."));
        continue;
      }
      for (int k = 0; k < reflection->FieldSize(message, field); ++k) {  // calibration.datasets
        RETURN_IF_ERROR(CheckSpecText(reflection->GetRepeatedMessage(message, field, k),
                                      absl::StrCat(name, "[", k, "].")));
      }
      continue;
    }
    if (field->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_STRING) continue;
    const int n = field->is_repeated() ? reflection->FieldSize(message, field) : 1;
    for (int k = 0; k < n; ++k) {
      const std::string value = field->is_repeated()
                                    ? reflection->GetRepeatedString(message, field, k)
                                    : reflection->GetString(message, field);
      const std::string entry = field->is_repeated() ? absl::StrCat(" entry ", k) : "";
      if (value.size() > job::kMaxPathBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("SubmitJobRequest.spec: field '", name, "'", entry, " is ", value.size(),
                         " bytes, more than ", job::kMaxPathBytes, " (PATH_MAX)"));
      }
      if (base::FirstInvalidUtf8(value).has_value()) {
        return absl::InvalidArgumentError(absl::StrCat("SubmitJobRequest.spec: field '", name,
                                                       "'", entry, " is not valid UTF-8"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSpecLimits(const v1::JobSpec& spec) {
  if (absl::Status s = CheckSpecText(spec, ""); !s.ok()) return s;
  if (spec.ByteSizeLong() > job::kMaxJobSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("SubmitJobRequest.spec: ", spec.ByteSizeLong(),
                                                   " bytes, more than the limit of ",
                                                   job::kMaxJobSpecBytes));
  }
  return absl::OkStatus();
}

absl::Status ShuttingDown() {
  return WithReason(absl::UnavailableError("the server is shutting down"), kShuttingDown);
}

// The scheduler's answer with a job, written into `response` before the call finishes.
scheduler::Scheduler::JobDone JobAnswer(const std::function<void(const absl::Status&)>& finish,
                                        v1::Job* response) {
  return [finish, response](absl::StatusOr<v1::Job> job) {
    if (job.ok()) *response = *std::move(job);
    finish(job.status());
  };
}

absl::Status JobNotFound(int64_t id) {
  return WithReason(absl::NotFoundError(absl::StrCat("job ", id, " not found")), kJobNotFound);
}

// The id after which a ListJobs page starts: 0 for the first page.
absl::StatusOr<int64_t> ParsePageToken(const std::string& token) {
  if (token.empty()) return 0;
  bool digits = token.size() <= kMaxPageTokenLength;
  for (char c : token) digits = digits && absl::ascii_isdigit(static_cast<unsigned char>(c));
  int64_t after_id = 0;
  if (!digits || !absl::SimpleAtoi(token, &after_id) || after_id <= 0) {
    return InvalidRequest(
        absl::StrCat("page_token: \"", absl::CEscape(token), "\" is not a token from ListJobs"));
  }
  return after_id;
}

// A WatchJob stream ends after a snapshot in one of these states.
bool EndsWatch(v1::JobState state) {
  return state == v1::SUCCEEDED || state == v1::FAILED || state == v1::CANCELLED ||
         state == v1::PAUSED;
}

}  // namespace

// One WatchJob stream. Snapshots come from the board; its listener runs on the publishing
// thread while the board holds its listener mutex, so the listener only notes the change and,
// when the stream is idle, sets an alarm whose callback (a gRPC thread) reads the board and
// writes. Lock order: the board's listener mutex, then mu_; Unsubscribe is never called with mu_
// held. The reactor deletes itself once gRPC called OnDone and no alarm callback is pending.
class QuantService::WatchReactor final : public grpc::ServerWriteReactor<v1::Job> {
 public:
  WatchReactor(QuantService* service, grpc::CallbackServerContext* context, int64_t job_id)
      : service_(service), context_(context), job_id_(job_id) {
    absl::Status refused = CheckId(job_id_);
    if (refused.ok() && service_->authorizer_ != nullptr) {
      refused = service_->authorizer_->AllowRead(*context, "WatchJob");
    }
    if (refused.ok() && !service_->AddWatch(this)) refused = ShuttingDown();
    if (!refused.ok()) {
      absl::MutexLock lock(&mu_);
      FinishLocked(refused);
      return;
    }
    token_ = board().Subscribe(job_id_, [this] { Changed(); });
    absl::MutexLock lock(&mu_);
    changed_ = true;
    PumpLocked();
  }

  // Ends the stream with UNAVAILABLE unless it has ended (QuantService::BeginShutdown).
  void Stop() {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    FinishLocked(ShuttingDown());
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (finished_) return;
    if (!ok) {
      FinishLocked(absl::CancelledError("WatchJob: the stream broke"));
      return;
    }
    if (EndsWatch(written_.state())) {
      FinishLocked(absl::OkStatus());
      return;
    }
    PumpLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    FinishLocked(absl::CancelledError("WatchJob cancelled"));
  }

  void OnDone() override {
    if (token_ != 0) board().Unsubscribe(token_);  // no listener call runs or follows after this
    service_->RemoveWatch(this);
    bool idle = false;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      idle = !alarm_pending_;
    }
    if (idle) delete this;  // else the pending alarm's callback deletes it
  }

 private:
  scheduler::JobBoard& board() { return service_->scheduler_->board(); }

  // The board's listener: a newer snapshot exists.
  void Changed() {
    absl::MutexLock lock(&mu_);
    changed_ = true;
    if (finished_ || writing_ || alarm_pending_) return;  // OnWriteDone or Wake will look
    alarm_pending_ = true;
    alarm_ = std::make_unique<grpc::Alarm>();  // a fired alarm is not set twice
    alarm_->Set(std::chrono::system_clock::now(), [this](bool) { Wake(); });
  }

  // The alarm's callback.
  void Wake() {
    mu_.Lock();
    alarm_pending_ = false;
    if (done_) {
      mu_.Unlock();
      delete this;
      return;
    }
    PumpLocked();
    mu_.Unlock();
  }

  // When no write is in flight and a change was noted, writes the newest snapshot if it differs
  // from the last one written; a job that disappeared ends the stream with NOT_FOUND.
  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_ || !changed_) return;
    changed_ = false;
    std::optional<v1::Job> job = board().Get(job_id_);
    if (!job.has_value() && !wrote_) {
      FinishLocked(JobNotFound(job_id_));
      return;
    }
    if (!job.has_value()) {
      FinishLocked(WithReason(absl::NotFoundError(absl::StrCat("job ", job_id_, " was deleted")),
                              kJobNotFound));
      return;
    }
    if (wrote_ && google::protobuf::util::MessageDifferencer::Equals(*job, written_)) return;
    written_ = *std::move(job);
    wrote_ = true;
    writing_ = true;
    StartWrite(&written_);
  }

  void FinishLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    const std::string reason = scheduler::ReasonOf(status);
    if (!reason.empty()) context_->AddTrailingMetadata(kReasonKey, reason);
    service_->Record("WatchJob", status.code());
    Finish(ToGrpcStatus(status));
  }

  QuantService* const service_;                 // its scheduler's board, metrics, stream registry
  grpc::CallbackServerContext* const context_;  // valid until OnDone
  const int64_t job_id_;                        // the watched job
  int64_t token_ = 0;                           // board subscription; 0 = none

  absl::Mutex mu_;  // guards the members below
  v1::Job written_ ABSL_GUARDED_BY(mu_);         // the snapshot in flight or last written
  bool wrote_ ABSL_GUARDED_BY(mu_) = false;      // written_ holds a snapshot
  bool changed_ ABSL_GUARDED_BY(mu_) = false;    // the board changed since the last look
  bool writing_ ABSL_GUARDED_BY(mu_) = false;    // a StartWrite awaits OnWriteDone
  bool finished_ ABSL_GUARDED_BY(mu_) = false;   // Finish was called
  bool alarm_pending_ ABSL_GUARDED_BY(mu_) = false;  // alarm_'s callback has yet to run
  bool done_ ABSL_GUARDED_BY(mu_) = false;       // OnDone ran
  // Wakes the stream after a change while it was idle.
  std::unique_ptr<grpc::Alarm> alarm_ ABSL_GUARDED_BY(mu_);
};

QuantService::QuantService(scheduler::Scheduler* scheduler, metrics::Metrics* metrics,
                           const Authorizer* authorizer)
    : scheduler_(scheduler), metrics_(metrics), authorizer_(authorizer) {}

grpc::ServerUnaryReactor* QuantService::Unary(grpc::CallbackServerContext* context,
                                              const char* method,
                                              const std::function<absl::Status()>& body) {
  return AsyncUnary(context, method, [&](const Finisher& finish) {
    finish(body());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* QuantService::AsyncUnary(
    grpc::CallbackServerContext* context, const char* method,
    const std::function<absl::Status(const Finisher&)>& start) {
  return StartUnaryCall(context, method, metrics_, start);
}

void QuantService::Record(const char* method, absl::StatusCode code) {
  if (metrics_ != nullptr) metrics_->RpcHandled(method, absl::StatusCodeToString(code));
}

grpc::ServerUnaryReactor* QuantService::SubmitJob(grpc::CallbackServerContext* context,
                                                  const v1::SubmitJobRequest* request,
                                                  v1::Job* response) {
  return AsyncUnary(context, "SubmitJob", [&](const Finisher& finish) -> absl::Status {
    std::optional<std::vector<std::string>> source_roots;  // no authorizer: any path
    if (authorizer_ != nullptr) {
      ASSIGN_OR_RETURN(source_roots, authorizer_->AllowSubmit(*context, request->spec()));
    }
    RETURN_IF_ERROR(CheckRequestId(request->request_id()));
    if (absl::Status s = CheckSpecLimits(request->spec()); !s.ok()) {
      return WithReason(s, kInvalidSpec);
    }
    absl::StatusOr<job::JobSpec> spec =
        job::ValidateJobSpec(request->spec(), "SubmitJobRequest.spec");
    if (!spec.ok()) return WithReason(spec.status(), kInvalidSpec);
    spec->source_roots = std::move(source_roots);
    if (absl::Status s = job::ResolveJobPaths(&*spec, /*allow_relative=*/false); !s.ok()) {
      return WithReason(
          absl::InvalidArgumentError(absl::StrCat("SubmitJobRequest.spec: ", s.message())),
          kInvalidSpec);
    }
    if (absl::Status s = job::CheckDirsUnclaimed(*spec, ClaimedDirs(request->request_id()));
        !s.ok()) {
      return WithReason(
          absl::Status(s.code(), absl::StrCat("SubmitJobRequest.spec: ", s.message())),
          kOutputInUse);
    }
    scheduler_->SubmitAsync(request->request_id(), *spec,
                            [finish, response](absl::StatusOr<v1::Job> job, bool /*created*/) {
                              if (job.ok()) *response = *std::move(job);
                              finish(job.status());
                            });
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* QuantService::ListWorkers(grpc::CallbackServerContext* context,
                                                    const v1::ListWorkersRequest* /*request*/,
                                                    v1::ListWorkersResponse* response) {
  return AsyncUnary(context, "ListWorkers", [&](const Finisher& finish) -> absl::Status {
    if (authorizer_ != nullptr) RETURN_IF_ERROR(authorizer_->AllowRead(*context, "ListWorkers"));
    scheduler_->ListWorkersAsync([finish, response](std::vector<scheduler::RemoteWorkerView> all) {
      for (const scheduler::RemoteWorkerView& w : all) {
        v1::WorkerInfo* info = response->add_workers();
        info->set_name(w.name);
        info->set_peer(w.peer);
        for (const scheduler::RemoteDevice& d : w.devices) {
          v1::WorkerDevice* device = info->add_devices();
          device->set_name(d.name);
          device->set_gpu(d.gpu);
          device->set_memory_bytes(d.memory_bytes);
        }
        for (const std::string& task : w.tasks) info->add_tasks(task);
        info->set_tasks_leased(w.tasks_leased);
        *info->mutable_register_time() = scheduler::TimestampFromMs(w.registered_ms);
        *info->mutable_last_seen_time() = scheduler::TimestampFromMs(w.last_seen_ms);
      }
      finish(absl::OkStatus());
    });
    return absl::OkStatus();
  });
}

std::vector<job::ClaimedDir> QuantService::ClaimedDirs(const std::string& request_id) const {
  std::vector<job::ClaimedDir> claimed;
  bool more = true;
  for (int64_t after_id = 0; more;) {
    const std::vector<v1::Job> page =
        scheduler_->board().List(v1::JOB_STATE_UNSPECIFIED, after_id, kMaxPageSize, &more);
    for (const v1::Job& job : page) {
      after_id = job.id();
      // Failed and cancelled jobs do not hold their output (a resumed one still finds its
      // marker there); a resubmission of the same request is that job itself.
      if (job.state() == v1::FAILED || job.state() == v1::CANCELLED) continue;
      if (!request_id.empty() && job.request_id() == request_id) continue;
      for (const std::string* dir : {&job.spec().output(), &job.spec().materialize_bf16()}) {
        if (!dir->empty()) claimed.push_back({job.id(), *dir});
      }
      if (!job.spec().calibration().amax_out().empty()) {
        claimed.push_back({job.id(), job.spec().calibration().amax_out(), /*amax_out=*/true});
      }
    }
    if (page.empty()) break;
  }
  return claimed;
}

grpc::ServerUnaryReactor* QuantService::GetJob(grpc::CallbackServerContext* context,
                                               const v1::GetJobRequest* request,
                                               v1::Job* response) {
  return Unary(context, "GetJob", [&]() -> absl::Status {
    if (authorizer_ != nullptr) RETURN_IF_ERROR(authorizer_->AllowRead(*context, "GetJob"));
    if (absl::Status s = CheckId(request->id()); !s.ok()) return s;
    std::optional<v1::Job> job = scheduler_->board().Get(request->id());
    if (!job.has_value()) return JobNotFound(request->id());
    *response = *std::move(job);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* QuantService::ListJobs(grpc::CallbackServerContext* context,
                                                 const v1::ListJobsRequest* request,
                                                 v1::ListJobsResponse* response) {
  return Unary(context, "ListJobs", [&]() -> absl::Status {
    if (authorizer_ != nullptr) RETURN_IF_ERROR(authorizer_->AllowRead(*context, "ListJobs"));
    if (!v1::JobState_IsValid(request->state())) {
      return InvalidRequest(absl::StrCat("state: unknown value ", request->state()));
    }
    if (request->page_size() < 0 || request->page_size() > kMaxPageSize) {
      return InvalidRequest(absl::StrCat("page_size: must be in [0, ", kMaxPageSize, "], got ",
                                         request->page_size()));
    }
    absl::StatusOr<int64_t> after_id = ParsePageToken(request->page_token());
    if (!after_id.ok()) return after_id.status();
    const int limit = request->page_size() == 0 ? kDefaultPageSize : request->page_size();
    bool more = false;
    std::vector<v1::Job> jobs = scheduler_->board().List(request->state(), *after_id, limit, &more);
    // A page ends early rather than outgrow what clients accept (jobs carry their specs); it
    // always holds at least one job, which the spec limit keeps far below the cap.
    size_t bytes = 0;
    for (v1::Job& job : jobs) {
      const size_t job_bytes = job.ByteSizeLong();
      if (response->jobs_size() > 0 && bytes + job_bytes > kMaxListResponseBytes) {
        more = true;
        break;
      }
      bytes += job_bytes;
      *response->add_jobs() = std::move(job);
    }
    if (more) response->set_next_page_token(absl::StrCat(response->jobs().rbegin()->id()));
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::Job>* QuantService::WatchJob(grpc::CallbackServerContext* context,
                                                          const v1::WatchJobRequest* request) {
  return new WatchReactor(this, context, request->id());
}

grpc::ServerUnaryReactor* QuantService::CancelJob(grpc::CallbackServerContext* context,
                                                  const v1::CancelJobRequest* request,
                                                  v1::Job* response) {
  return AsyncUnary(context, "CancelJob", [&](const Finisher& finish) -> absl::Status {
    if (authorizer_ != nullptr) {
      RETURN_IF_ERROR(authorizer_->AllowChange(*context, "CancelJob", request->id()));
    }
    RETURN_IF_ERROR(CheckId(request->id()));
    scheduler_->CancelAsync(request->id(), request->pause(), "", JobAnswer(finish, response));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* QuantService::ResumeJob(grpc::CallbackServerContext* context,
                                                  const v1::ResumeJobRequest* request,
                                                  v1::Job* response) {
  return AsyncUnary(context, "ResumeJob", [&](const Finisher& finish) -> absl::Status {
    if (authorizer_ != nullptr) {
      RETURN_IF_ERROR(authorizer_->AllowChange(*context, "ResumeJob", request->id()));
    }
    RETURN_IF_ERROR(CheckId(request->id()));
    scheduler_->ResumeAsync(request->id(), JobAnswer(finish, response));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* QuantService::DeleteJob(grpc::CallbackServerContext* context,
                                                  const v1::DeleteJobRequest* request,
                                                  v1::DeleteJobResponse* /*response*/) {
  return AsyncUnary(context, "DeleteJob", [&](const Finisher& finish) -> absl::Status {
    if (authorizer_ != nullptr) {
      RETURN_IF_ERROR(authorizer_->AllowChange(*context, "DeleteJob", request->id()));
    }
    RETURN_IF_ERROR(CheckId(request->id()));
    scheduler_->DeleteAsync(request->id(), store::DeletePrecondition::kNotRunning,
                            [finish](absl::Status s) { finish(s); });
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* QuantService::GetJobReport(grpc::CallbackServerContext* context,
                                                     const v1::GetJobReportRequest* request,
                                                     v1::JobReport* response) {
  return AsyncUnary(context, "GetJobReport", [&](const Finisher& finish) -> absl::Status {
    if (authorizer_ != nullptr) {
      RETURN_IF_ERROR(authorizer_->AllowRead(*context, "GetJobReport"));
    }
    RETURN_IF_ERROR(CheckId(request->id()));
    if (request->worst() < 0) {
      return InvalidRequest(absl::StrCat("worst: must be >= 0, got ", request->worst()));
    }
    scheduler_->ReportAsync(request->id(), request->worst(),
                            [finish, response](absl::StatusOr<v1::JobReport> report) {
                              if (report.ok()) *response = *std::move(report);
                              finish(report.status());
                            });
    return absl::OkStatus();
  });
}

void QuantService::BeginShutdown() {
  absl::MutexLock lock(&watches_mu_);
  shutting_down_ = true;
  for (WatchReactor* watch : watches_) watch->Stop();
}

bool QuantService::AddWatch(WatchReactor* watch) {
  absl::MutexLock lock(&watches_mu_);
  if (shutting_down_) return false;
  watches_.insert(watch);
  return true;
}

void QuantService::RemoveWatch(WatchReactor* watch) {
  absl::MutexLock lock(&watches_mu_);
  watches_.erase(watch);
}

}  // namespace quantd::api
