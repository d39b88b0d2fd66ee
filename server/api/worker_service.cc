#include "server/api/worker_service.h"

#include <limits.h>
#include <math.h>
#include <stdint.h>

#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "server/api/unary_call.h"
#include "server/base/status_macros.h"
#include "server/base/utf8.h"
#include "server/compute/device_name.h"
#include "server/pipeline/stage.h"
#include "server/scheduler/job_proto.h"

namespace quantd::api {
namespace {

using scheduler::WithReason;

constexpr size_t kMaxNameBytes = 128;                  // a worker's name, its id
// The name quantctl shows for the tasks the daemon ran itself (client/report_view.cc), which no
// worker may take.
constexpr char kDaemonRunnerName[] = "local";
constexpr int kMaxDevices = 64;                        // devices of one worker
constexpr int64_t kMaxMemoryBytes = int64_t{1} << 50;  // 1 PiB: more is not a device
constexpr int kMaxOpenJobs = 1024;                     // LeaseTaskRequest.open_jobs entries
constexpr size_t kMaxMessageBytes = 4096;              // FailTaskRequest.message, summary
constexpr size_t kMaxTensorNameBytes = 1024;           // a statistics row's tensor name
constexpr size_t kMaxReasonBytes = 64;                 // FailTaskRequest.job_reason

absl::Status Invalid(const std::string& message) {
  return WithReason(absl::InvalidArgumentError(message), "INVALID_REQUEST");
}

// Printable ASCII without spaces, 1 to kMaxNameBytes bytes.
absl::Status CheckName(const std::string& field, const std::string& value) {
  if (value.empty() || value.size() > kMaxNameBytes) {
    return Invalid(
        absl::StrCat(field, ": must be 1 to ", kMaxNameBytes, " bytes, got ", value.size()));
  }
  for (const char c : value) {
    if (c <= 0x20 || c > 0x7e) {
      return Invalid(absl::StrCat(field, ": must be printable ASCII without spaces"));
    }
  }
  return absl::OkStatus();
}

// Valid UTF-8 of at most `max` bytes.
absl::Status CheckText(const std::string& field, const std::string& value, size_t max) {
  if (value.size() > max) {
    return Invalid(absl::StrCat(field, ": ", value.size(), " bytes, more than ", max));
  }
  if (base::FirstInvalidUtf8(value).has_value()) {
    return Invalid(absl::StrCat(field, ": not valid UTF-8"));
  }
  return absl::OkStatus();
}

absl::Status CheckAttempt(int64_t task_id, int32_t attempt) {
  if (task_id <= 0) return Invalid(absl::StrCat("task_id: must be > 0, got ", task_id));
  if (attempt <= 0) return Invalid(absl::StrCat("attempt: must be > 0, got ", attempt));
  return absl::OkStatus();
}

absl::Status CheckSha256(const std::string& hex) {
  if (hex.empty()) return absl::OkStatus();
  if (hex.size() != 64) {
    return Invalid(
        absl::StrCat("output_sha256: must be 64 hex digits, got ", hex.size(), " bytes"));
  }
  for (const char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c)) || absl::ascii_isupper(c)) {
      return Invalid("output_sha256: must be lowercase hex digits");
    }
  }
  return absl::OkStatus();
}

void ToProto(const store::TaskRow& t, v1::WorkerTaskRow* out) {
  out->set_id(t.id);
  out->set_stage_id(t.stage_id);
  out->set_stage_kind(t.stage_kind);
  out->set_ordinal(t.ordinal);
  out->set_name(t.name);
  out->set_payload_json(t.payload_json);
  out->set_bytes_total(t.bytes_total);
  out->set_label(t.label);
  out->set_requires_gpu(t.requirement.gpu);
  out->set_memory_bytes(t.requirement.memory_bytes);
  if (t.state == store::TaskState::kDone) {
    out->set_done(true);
    out->set_output_path(t.output_path);
    out->set_output_bytes(t.output_bytes.value_or(0));
    out->set_output_sha256(t.output_sha256);
  }
}

// The stage's output as the worker reported it; InvalidArgument naming the field.
absl::StatusOr<pipeline::TaskOutput> OutputOf(const v1::CompleteTaskRequest& r) {
  RETURN_IF_ERROR(CheckText("output_path", r.output_path(), PATH_MAX - 1));
  if (!r.output_path().empty() && r.output_path().front() != '/') {
    return Invalid("output_path: must be absolute");
  }
  if (r.output_bytes() < 0) {
    return Invalid(absl::StrCat("output_bytes: must be >= 0, got ", r.output_bytes()));
  }
  RETURN_IF_ERROR(CheckSha256(r.output_sha256()));
  if (r.output_path().empty() != r.output_sha256().empty()) {
    return Invalid("output_sha256: must be given exactly when output_path is");
  }
  RETURN_IF_ERROR(CheckText("summary", r.summary(), kMaxMessageBytes));
  pipeline::TaskOutput out;
  out.path = r.output_path();
  out.bytes = static_cast<uint64_t>(r.output_bytes());
  out.sha256 = r.output_sha256();
  out.summary = r.summary();
  out.stats.reserve(r.stats_size());
  for (int i = 0; i < r.stats_size(); ++i) {
    const v1::TensorStats& s = r.stats(i);
    const std::string field = absl::StrCat("stats[", i, "]");
    RETURN_IF_ERROR(CheckText(field + ".tensor", s.tensor(), kMaxTensorNameBytes));
    if (s.tensor().empty()) return Invalid(field + ".tensor: empty");
    // SQNR is +inf for an exact tensor; nothing is NaN or negative but the dB.
    if (isnan(s.rel_rmse()) || isnan(s.sqnr_db()) || isnan(s.max_abs_err()) || s.rel_rmse() < 0 ||
        s.max_abs_err() < 0) {
      return Invalid(field + ": rel_rmse and max_abs_err must be >= 0, and nothing NaN");
    }
    out.stats.push_back({s.tensor(), s.rel_rmse(), s.sqnr_db(), s.max_abs_err()});
  }
  for (int i = 0; i < r.figures_size(); ++i) {
    const v1::TaskFigureEntry& f = r.figures(i);
    const std::string field = absl::StrCat("figures[", i, "]");
    RETURN_IF_ERROR(CheckName(field + ".metric", f.metric()));
    if (!isfinite(f.value()) || f.value() < 0) {
      return Invalid(field + ".value: must be finite and >= 0");
    }
    out.figures.push_back({f.metric(), f.value()});
  }
  return out;
}

// The stage's error as the worker reported it; InvalidArgument naming the field.
absl::StatusOr<absl::Status> ErrorOf(const v1::FailTaskRequest& r) {
  if (r.code() <= 0 || r.code() > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return Invalid(absl::StrCat("code: must be a google.rpc.Code from 1 to 16, got ", r.code()));
  }
  RETURN_IF_ERROR(CheckText("message", r.message(), kMaxMessageBytes));
  absl::Status error(static_cast<absl::StatusCode>(r.code()), r.message());
  if (!r.job_reason().empty()) {
    if (r.job_reason().size() > kMaxReasonBytes) {
      return Invalid(absl::StrCat("job_reason: more than ", kMaxReasonBytes, " bytes"));
    }
    for (const char c : r.job_reason()) {
      if (!absl::ascii_isupper(static_cast<unsigned char>(c)) && c != '_') {
        return Invalid("job_reason: must be upper-case letters and '_'");
      }
    }
    error = pipeline::WithJobReason(std::move(error), r.job_reason());
  }
  return error;
}

}  // namespace

WorkerService::WorkerService(scheduler::Scheduler* scheduler, metrics::Metrics* metrics,
                             const Authorizer* authorizer)
    : scheduler_(scheduler), metrics_(metrics), authorizer_(authorizer) {}

absl::Status WorkerService::Allow(const grpc::CallbackServerContext& context,
                                  const char* method) const {
  if (authorizer_ == nullptr) return absl::OkStatus();
  return authorizer_->AllowWorker(context, method).status();
}

grpc::ServerUnaryReactor* WorkerService::Register(grpc::CallbackServerContext* context,
                                                  const v1::RegisterWorkerRequest* request,
                                                  v1::RegisterWorkerResponse* response) {
  return StartUnaryCall(context, "Register", metrics_, [&](const Finisher& finish) -> absl::Status {
    RETURN_IF_ERROR(Allow(*context, "Register"));
    RETURN_IF_ERROR(CheckName("name", request->name()));
    if (request->name() == kDaemonRunnerName) {
      return Invalid(absl::StrCat("name: \"", kDaemonRunnerName,
                                  "\" is how quantctl names the daemon's own work; choose another"));
    }
    if (request->devices_size() < 1 || request->devices_size() > kMaxDevices) {
      return Invalid(absl::StrCat("devices: must hold 1 to ", kMaxDevices, " devices, got ",
                                  request->devices_size()));
    }
    std::vector<scheduler::RemoteDevice> devices;
    for (int i = 0; i < request->devices_size(); ++i) {
      const v1::WorkerDevice& d = request->devices(i);
      const std::string field = absl::StrCat("devices[", i, "]");
      int index = 0;
      if (d.name().size() > kMaxNameBytes || !compute::ParseDeviceName(d.name(), &index)) {
        return Invalid(field + ".name: must be cpu or cuda:N");
      }
      if (d.gpu() != (d.name() != "cpu")) {
        return Invalid(field + ".gpu: must be true exactly for a cuda:N device");
      }
      if (d.memory_bytes() <= 0 || d.memory_bytes() > kMaxMemoryBytes) {
        return Invalid(absl::StrCat(field, ".memory_bytes: must be in [1, ", kMaxMemoryBytes,
                                    "], got ", d.memory_bytes()));
      }
      devices.push_back({d.name(), d.gpu(), d.memory_bytes()});
    }
    scheduler_->RegisterWorkerAsync(
        request->name(), context->peer(), std::move(devices),
        [finish, response](absl::StatusOr<scheduler::RemoteRegistration> registered) {
          if (registered.ok()) {
            response->set_worker_id(registered->worker_id);
            response->set_lease_ms(registered->lease_ms);
          }
          finish(registered.status());
        });
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::Lease(grpc::CallbackServerContext* context,
                                               const v1::LeaseTaskRequest* request,
                                               v1::LeaseTaskResponse* response) {
  return StartUnaryCall(context, "Lease", metrics_, [&](const Finisher& finish) -> absl::Status {
    RETURN_IF_ERROR(Allow(*context, "Lease"));
    RETURN_IF_ERROR(CheckName("worker_id", request->worker_id()));
    if (request->device() < 0 || request->device() >= kMaxDevices) {
      return Invalid(
          absl::StrCat("device: must be in [0, ", kMaxDevices - 1, "], got ", request->device()));
    }
    if (request->wait_ms() < 0 || request->wait_ms() > kMaxLeaseWaitMs) {
      return Invalid(
          absl::StrCat("wait_ms: must be in [0, ", kMaxLeaseWaitMs, "], got ", request->wait_ms()));
    }
    if (request->open_jobs_size() > kMaxOpenJobs) {
      return Invalid(absl::StrCat("open_jobs: at most ", kMaxOpenJobs, " entries, got ",
                                  request->open_jobs_size()));
    }
    std::set<int64_t> open_jobs;
    for (const int64_t id : request->open_jobs()) {
      if (id <= 0) return Invalid(absl::StrCat("open_jobs: ids must be > 0, got ", id));
      open_jobs.insert(id);
    }
    scheduler_->LeaseRemoteAsync(
        request->worker_id(), request->device(), request->wait_ms(), std::move(open_jobs),
        [finish, response](absl::StatusOr<std::optional<scheduler::RemoteLease>> lease) {
          if (!lease.ok()) return finish(lease.status());
          if (!lease->has_value()) return finish(absl::OkStatus());
          const scheduler::RemoteLease& l = **lease;
          response->set_leased(true);
          response->set_job_id(l.job_id);
          response->set_task_id(l.task.id);
          response->set_attempt(l.task.attempt);
          response->set_job_created_ms(l.job_created_ms);
          if (l.job_included) {
            response->set_job_store(l.job_store);
            response->set_spec_json(l.spec_json);
            response->set_work_dir(l.work_dir);
            for (const store::AmaxRow& row : l.input_amax) {
              v1::AmaxEntry* entry = response->add_input_amax();
              entry->set_module(row.module);
              entry->set_amax(row.value);
            }
          }
          for (const store::TaskRow& t : l.tasks) ToProto(t, response->add_tasks());
          finish(absl::OkStatus());
        });
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::Renew(grpc::CallbackServerContext* context,
                                               const v1::RenewLeaseRequest* request,
                                               v1::RenewLeaseResponse* response) {
  return StartUnaryCall(context, "Renew", metrics_, [&](const Finisher& finish) -> absl::Status {
    RETURN_IF_ERROR(Allow(*context, "Renew"));
    RETURN_IF_ERROR(CheckName("worker_id", request->worker_id()));
    RETURN_IF_ERROR(CheckAttempt(request->task_id(), request->attempt()));
    if (request->bytes_done() < 0) {
      return Invalid(absl::StrCat("bytes_done: must be >= 0, got ", request->bytes_done()));
    }
    scheduler_->RenewRemoteAsync(request->worker_id(), request->task_id(), request->attempt(),
                                 static_cast<uint64_t>(request->bytes_done()),
                                 [finish, response](absl::StatusOr<bool> cancel) {
                                   if (cancel.ok()) response->set_cancel(*cancel);
                                   finish(cancel.status());
                                 });
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::Complete(grpc::CallbackServerContext* context,
                                                  const v1::CompleteTaskRequest* request,
                                                  v1::CompleteTaskResponse* /*response*/) {
  return StartUnaryCall(context, "Complete", metrics_, [&](const Finisher& finish) -> absl::Status {
    RETURN_IF_ERROR(Allow(*context, "Complete"));
    RETURN_IF_ERROR(CheckName("worker_id", request->worker_id()));
    RETURN_IF_ERROR(CheckAttempt(request->task_id(), request->attempt()));
    ASSIGN_OR_RETURN(pipeline::TaskOutput output, OutputOf(*request));
    scheduler_->CompleteRemoteAsync(request->worker_id(), request->task_id(), request->attempt(),
                                    std::move(output), finish);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::Fail(grpc::CallbackServerContext* context,
                                              const v1::FailTaskRequest* request,
                                              v1::FailTaskResponse* /*response*/) {
  return StartUnaryCall(context, "Fail", metrics_, [&](const Finisher& finish) -> absl::Status {
    RETURN_IF_ERROR(Allow(*context, "Fail"));
    RETURN_IF_ERROR(CheckName("worker_id", request->worker_id()));
    RETURN_IF_ERROR(CheckAttempt(request->task_id(), request->attempt()));
    ASSIGN_OR_RETURN(absl::Status error, ErrorOf(*request));
    scheduler_->CompleteRemoteAsync(request->worker_id(), request->task_id(), request->attempt(),
                                    std::move(error), finish);
    return absl::OkStatus();
  });
}

}  // namespace quantd::api
