// libFuzzer target: the quantd.v1.QuantService handlers in process. The first input byte picks
// the method, the rest is the serialized request, sent as raw bytes through a generic stub over
// an in-process channel to a QuantService on a real Scheduler (one CPU worker, a JobStore in a
// scratch directory), so gRPC's deserialization and every handler see mutated requests.
//
// Besides the sanitizers' checks: a request that parses as its message type never gets
// INTERNAL, UNKNOWN or DATA_LOSS (handler exceptions and unexpected errors become those).
//
// Scratch: a fresh directory under $QUANTD_FUZZ_SCRATCH (default /tmp) per process.
// Sandbox: SubmitJob requests that parse have every path of their spec (source, output,
// materialize_bf16, calibration files) replaced by a name under the scratch directory where no
// checkpoint exists, so the jobs they create fail to start and never read or write outside it.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "google/protobuf/stubs/logging.h"
#include "quantd/v1/quantd.grpc.pb.h"
#include "server/api/quant_service.h"
#include "server/scheduler/scheduler.h"
#include "server/store/job_store.h"

namespace {

using quantd::v1::SubmitJobRequest;

// Aborts (a finding for the fuzzer) when an invariant breaks.
void Check(bool condition) {
  if (!condition) __builtin_trap();
}

// The unary methods, indexed by the first input byte (WatchJob is served separately).
struct Method {
  const char* path;
  bool (*parses)(const std::string& bytes);
};

template <typename Request>
bool Parses(const std::string& bytes) {
  Request r;
  return r.ParseFromString(bytes);
}

const Method kUnary[] = {
    {"/quantd.v1.QuantService/SubmitJob", Parses<quantd::v1::SubmitJobRequest>},
    {"/quantd.v1.QuantService/GetJob", Parses<quantd::v1::GetJobRequest>},
    {"/quantd.v1.QuantService/ListJobs", Parses<quantd::v1::ListJobsRequest>},
    {"/quantd.v1.QuantService/CancelJob", Parses<quantd::v1::CancelJobRequest>},
    {"/quantd.v1.QuantService/ResumeJob", Parses<quantd::v1::ResumeJobRequest>},
    {"/quantd.v1.QuantService/DeleteJob", Parses<quantd::v1::DeleteJobRequest>},
    {"/quantd.v1.QuantService/GetJobReport", Parses<quantd::v1::GetJobReportRequest>},
};
constexpr size_t kMethods = sizeof(kUnary) / sizeof(kUnary[0]);  // byte % (kMethods + 1)
constexpr auto kDeadline = std::chrono::seconds(10);
constexpr auto kWatchDeadline = std::chrono::milliseconds(300);

// The daemon's parts, set up once per fuzzing process.
struct Harness {
  std::string sandbox;  // the scratch directory
  std::unique_ptr<quantd::scheduler::Scheduler> scheduler;
  std::unique_ptr<quantd::api::QuantService> service;
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> generic;
  std::unique_ptr<quantd::v1::QuantService::Stub> stub;
};

Harness& Get() {
  static Harness* h = [] {
    // Mutated strings are often invalid UTF-8, which protobuf logs at every parse: keep quiet.
    google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int,
                                       const std::string&) {});
    auto* h = new Harness;
    const char* base = getenv("QUANTD_FUZZ_SCRATCH");
    std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/grpc-fuzz-XXXXXX";
    Check(mkdtemp(tmpl.data()) != nullptr);
    h->sandbox = tmpl;
    auto store = quantd::store::JobStore::Open(h->sandbox + "/quantd.db");
    Check(store.ok());
    quantd::scheduler::SchedulerOptions options;
    options.devices = {"cpu"};
    options.queue_limit = 16;
    auto scheduler = quantd::scheduler::Scheduler::Start(*std::move(store), options);
    Check(scheduler.ok());
    h->scheduler = *std::move(scheduler);
    h->service = std::make_unique<quantd::api::QuantService>(h->scheduler.get(), nullptr);
    grpc::ServerBuilder builder;
    builder.RegisterService(h->service.get());
    h->server = builder.BuildAndStart();
    Check(h->server != nullptr);
    h->channel = h->server->InProcessChannel(grpc::ChannelArguments());
    h->generic = std::make_unique<grpc::GenericStub>(h->channel);
    h->stub = quantd::v1::QuantService::NewStub(h->channel);
    return h;
  }();
  return *h;
}

// A path under the sandbox for any string: slashes and dots cannot climb out.
std::string Confined(const std::string& sandbox, const char* kind, const std::string& path) {
  std::string name;
  for (char c : path.substr(0, 64)) name += (c == '/' || c == '\0') ? '_' : c;
  return sandbox + "/" + kind + "/x" + name;
}

// Confines every path of a SubmitJob spec; returns the request re-serialized.
std::string Sandboxed(const std::string& sandbox, SubmitJobRequest request) {
  quantd::v1::JobSpec& spec = *request.mutable_spec();
  if (!spec.source().empty()) spec.set_source(Confined(sandbox, "in", spec.source()));
  if (!spec.output().empty()) spec.set_output(Confined(sandbox, "out", spec.output()));
  if (!spec.materialize_bf16().empty()) {
    spec.set_materialize_bf16(Confined(sandbox, "bf16", spec.materialize_bf16()));
  }
  if (spec.has_calibration()) {
    quantd::v1::CalibrationSpec& c = *spec.mutable_calibration();
    if (!c.amax_file().empty()) c.set_amax_file(Confined(sandbox, "in", c.amax_file()));
    if (!c.dataset().empty()) c.set_dataset(Confined(sandbox, "in", c.dataset()));
    for (quantd::v1::CalibrationDataset& d : *c.mutable_datasets()) {
      if (!d.path().empty()) d.set_path(Confined(sandbox, "in", d.path()));
    }
    if (!c.amax_out().empty()) c.set_amax_out(Confined(sandbox, "out", c.amax_out()));
  }
  return request.SerializeAsString();
}

// One unary call with raw request bytes; returns its status.
grpc::Status Call(Harness& h, const char* method, const std::string& bytes) {
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kDeadline);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status result;
  h.generic->UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                       [&](grpc::Status s) {
                         std::lock_guard<std::mutex> lock(mu);
                         result = std::move(s);
                         done = true;
                         cv.notify_one();
                       });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  return result;
}

bool Unexpected(grpc::StatusCode code) {
  return code == grpc::StatusCode::INTERNAL || code == grpc::StatusCode::UNKNOWN ||
         code == grpc::StatusCode::DATA_LOSS;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Harness& h = Get();
  const size_t pick = data[0] % (kMethods + 1);
  std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if (pick == kMethods) {  // WatchJob: read the stream until it ends or the short deadline
    quantd::v1::WatchJobRequest request;
    if (!request.ParseFromString(bytes)) return 0;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kWatchDeadline);
    std::unique_ptr<grpc::ClientReader<quantd::v1::Job>> reader =
        h.stub->WatchJob(&context, request);
    quantd::v1::Job job;
    while (reader->Read(&job)) Check(job.id() == request.id());
    Check(!Unexpected(reader->Finish().error_code()));
    return 0;
  }
  const Method& method = kUnary[pick];
  const bool parses = method.parses(bytes);
  if (pick == 0 && parses) {  // bytes that do not parse here do not parse in the server either
    SubmitJobRequest request;
    request.ParseFromString(bytes);
    bytes = Sandboxed(h.sandbox, std::move(request));
  }
  const grpc::Status status = Call(h, method.path, bytes);
  if (parses) Check(!Unexpected(status.error_code()));
  return 0;
}
