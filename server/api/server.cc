#include "server/api/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace quantd::api {
namespace {

constexpr char kServiceName[] = "quantd.v1.QuantService";

// Connection limits (LimitConnections).
constexpr int kMaxConcurrentStreams = 128;           // per connection
constexpr int kHandshakeTimeoutMs = 10'000;          // a connection must speak HTTP/2 by then
constexpr int kMaxConnectionIdleMs = 10 * 60'000;    // without a call in flight
constexpr size_t kTransportMemoryBytes = 512 << 20;  // all connections' buffers together

// The ":port" of a "host:port" address, or -1 for a unix socket. InvalidArgument when malformed.
absl::StatusOr<int> ParsePort(const std::string& address) {
  if (absl::StartsWith(address, "unix:")) {
    if (address.size() == 5) {
      return absl::InvalidArgumentError("listen address \"unix:\": the socket path is missing");
    }
    return -1;
  }
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address \"", address, "\": expected HOST:PORT (PORT 0-65535) or unix:PATH"));
  }
  return port;
}

// gRPC sets SO_REUSEPORT by default, which would let a second daemon share a port with the first.
void RefuseSharedPorts(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

// Bounds what idle or hostile connections can hold: streams per connection, a deadline for the
// HTTP/2 handshake (a connection that never speaks is closed), idle connections closed, and a
// memory quota for the transport. The process's descriptor limit is raised at start
// (serve_command.cc), so connections cannot exhaust it before these apply.
void LimitConnections(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxConcurrentStreams);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHandshakeTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kMaxConnectionIdleMs);
  grpc::ResourceQuota quota("quantd-api");
  quota.Resize(kTransportMemoryBytes);
  builder.SetResourceQuota(quota);
}

// Whether a server with only `address` starts (to find which one of several cannot be bound).
bool CanBind(const std::string& address) {
  grpc::ServerBuilder builder;
  RefuseSharedPorts(builder);
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> probe = builder.BuildAndStart();
  if (probe == nullptr) return false;
  probe->Shutdown();
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ApiServer>> ApiServer::Start(const std::vector<std::string>& listen,
                                                            scheduler::Scheduler* scheduler,
                                                            metrics::Metrics* metrics) {
  if (listen.empty()) return absl::InvalidArgumentError("no listen address");
  std::vector<int> wanted_ports;
  for (const std::string& address : listen) {
    absl::StatusOr<int> port = ParsePort(address);
    if (!port.ok()) return port.status();
    wanted_ports.push_back(*port);
  }

  // Both are process-wide settings that the builder reads.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::unique_ptr<ApiServer> server(new ApiServer());
  server->service_ = std::make_unique<QuantService>(scheduler, metrics);
  grpc::ServerBuilder builder;
  RefuseSharedPorts(builder);
  LimitConnections(builder);
  std::vector<int> bound_ports(listen.size(), 0);
  for (size_t i = 0; i < listen.size(); ++i) {
    builder.AddListeningPort(listen[i], grpc::InsecureServerCredentials(), &bound_ports[i]);
  }
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    for (const std::string& address : listen) {
      if (listen.size() == 1 || !CanBind(address)) {
        return absl::UnavailableError(
            absl::StrCat("cannot listen on ", address, " (in use, or not a usable address)"));
      }
    }
    return absl::UnavailableError(absl::StrCat("cannot listen on ", absl::StrJoin(listen, ", ")));
  }
  for (size_t i = 0; i < listen.size(); ++i) {
    if (wanted_ports[i] != 0) {
      server->bound_.push_back(listen[i]);
    } else {
      server->bound_.push_back(
          absl::StrCat(listen[i].substr(0, listen[i].rfind(':') + 1), bound_ports[i]));
    }
  }
  grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(kServiceName, true);
  return server;
}

ApiServer::~ApiServer() { Shutdown(std::chrono::milliseconds(0)); }

void ApiServer::Shutdown(std::chrono::milliseconds deadline) {
  if (server_ == nullptr) return;
  const auto until = std::chrono::system_clock::now() + deadline;
  server_->GetHealthCheckService()->SetServingStatus(false);
  service_->BeginShutdown();
  server_->Shutdown(until);
  server_->Wait();
  server_.reset();
}

}  // namespace quantd::api
