// QuantService: the quantd.v1.QuantService gRPC service (callback API) over the scheduler.
//
// Reads (GetJob, ListJobs, WatchJob) come from the scheduler's JobBoard and never wait on the
// store. The other RPCs validate the request on the gRPC thread, post the command to the
// scheduler's strand and return; the strand finishes the call (the reactor's Finish) once the
// command ran, so no gRPC thread ever waits for the scheduler. Every error is the absl::Status code and message as
// a grpc::Status, with the machine-readable reason (scheduler::ReasonOf) in the trailing metadata
// key "quantd-reason"; no exception crosses the RPC boundary (one becomes INTERNAL).
//
// WatchJob streams are coalescing: a stream has at most one write in flight and, when it
// completes, writes the newest snapshot if it differs from the last one written, so a slow client
// sees fewer messages, never a growing queue.
#ifndef QUANTD_SERVER_API_QUANT_SERVICE_H_
#define QUANTD_SERVER_API_QUANT_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "quantd/v1/quantd.grpc.pb.h"
#include "server/api/authorizer.h"
#include "server/api/unary_call.h"
#include "server/job/job_paths.h"
#include "server/metrics/metrics.h"
#include "server/scheduler/scheduler.h"

namespace quantd::api {

class QuantService final : public v1::QuantService::CallbackService {
 public:
  // No pointer is owned; `metrics` may be nullptr. Every handler first asks `authorizer`
  // (authorizer.h); nullptr allows every call, for in-process use only (ApiServer passes one).
  QuantService(scheduler::Scheduler* scheduler, metrics::Metrics* metrics,
               const Authorizer* authorizer = nullptr);

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* context,
                                      const v1::SubmitJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* context,
                                   const v1::GetJobRequest* request, v1::Job* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerWriteReactor<v1::Job>* WatchJob(grpc::CallbackServerContext* context,
                                              const v1::WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* context,
                                      const v1::CancelJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerUnaryReactor* ResumeJob(grpc::CallbackServerContext* context,
                                      const v1::ResumeJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerUnaryReactor* DeleteJob(grpc::CallbackServerContext* context,
                                      const v1::DeleteJobRequest* request,
                                      v1::DeleteJobResponse* response) override;
  grpc::ServerUnaryReactor* GetJobReport(grpc::CallbackServerContext* context,
                                         const v1::GetJobReportRequest* request,
                                         v1::JobReport* response) override;

  grpc::ServerUnaryReactor* ListWorkers(grpc::CallbackServerContext* context,
                                        const v1::ListWorkersRequest* request,
                                        v1::ListWorkersResponse* response) override;

  // Ends every open WatchJob stream with UNAVAILABLE (reason SHUTTING_DOWN) and refuses new
  // ones, so that the server's shutdown does not wait for them. Called before Server::Shutdown.
  void BeginShutdown();

 private:
  class WatchReactor;

  // Runs `body` (exceptions become INTERNAL), records the outcome and finishes the call.
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, const char* method,
                                  const std::function<absl::Status()>& body);
  // Runs `start` on the gRPC thread: an error (or exception) finishes the call at once; OK means
  // `start` handed the Finisher to someone who calls it later (the scheduler's strand).
  grpc::ServerUnaryReactor* AsyncUnary(grpc::CallbackServerContext* context, const char* method,
                                       const std::function<absl::Status(const Finisher&)>& start);
  // Counts one finished RPC in the metrics.
  void Record(const char* method, absl::StatusCode code);
  // The output directories and calibration.amax_out files that jobs on the board own (PENDING,
  // RUNNING, PAUSED, SUCCEEDED), except those of the job a resubmission of `request_id` would
  // return.
  std::vector<job::ClaimedDir> ClaimedDirs(const std::string& request_id) const;

  // Registers a new stream; false once BeginShutdown ran.
  bool AddWatch(WatchReactor* watch);
  // Forgets a stream that is done.
  void RemoveWatch(WatchReactor* watch);

  scheduler::Scheduler* const scheduler_;  // the engine; not owned
  metrics::Metrics* const metrics_;        // not owned; nullptr = no metrics
  const Authorizer* const authorizer_;     // not owned; nullptr = every call allowed

  absl::Mutex watches_mu_;  // guards the members below; taken before a stream's own mutex
  std::set<WatchReactor*> watches_ ABSL_GUARDED_BY(watches_mu_);  // open WatchJob streams
  bool shutting_down_ ABSL_GUARDED_BY(watches_mu_) = false;       // BeginShutdown ran
};

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_QUANT_SERVICE_H_
