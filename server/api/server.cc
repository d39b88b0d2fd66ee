#include "server/api/server.h"

#include <arpa/inet.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/resource_quota.h>

#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"

namespace quantd::api {
namespace {

constexpr char kServiceName[] = "quantd.v1.QuantService";

constexpr char kUnixPrefix[] = "unix:";

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

std::shared_ptr<grpc::ServerCredentials> TcpCredentials(const TlsPem& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      tls.client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = tls.client_ca;
  ssl.pem_key_cert_pairs.push_back({tls.key, tls.cert});
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

bool IsLoopbackAddress(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "localhost") return true;
  in_addr v4 = {};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6 = {};
  return inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

absl::StatusOr<std::unique_ptr<ApiServer>> ApiServer::Start(ApiServerOptions options,
                                                            scheduler::Scheduler* scheduler,
                                                            metrics::Metrics* metrics) {
  const std::vector<std::string>& listen = options.listen;
  if (listen.empty()) return absl::InvalidArgumentError("no listen address");
  std::vector<std::string> tcp;
  std::vector<std::string> unix_paths;
  std::vector<int> wanted_ports;
  for (const std::string& address : listen) {
    absl::StatusOr<int> port = ParsePort(address);
    if (!port.ok()) return port.status();
    if (*port < 0) {
      unix_paths.push_back(address.substr(sizeof(kUnixPrefix) - 1));
    } else {
      tcp.push_back(address);
      wanted_ports.push_back(*port);
    }
  }

  // Both are process-wide settings that the builder reads.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::unique_ptr<ApiServer> server(new ApiServer());
  server->policy_ = std::move(options.policy);
  if (!unix_paths.empty()) {
    ASSIGN_OR_RETURN(server->unix_listener_, UnixListener::Bind(unix_paths, options.unix_socket));
  }
  server->authorizer_ = std::make_unique<Authorizer>(
      &server->policy_, server->unix_listener_.get(),
      [scheduler](int64_t id) -> std::optional<v1::JobSpec> {
        std::optional<v1::Job> job = scheduler->board().Get(id);
        if (!job.has_value()) return std::nullopt;
        return job->spec();
      });
  server->service_ =
      std::make_unique<QuantService>(scheduler, metrics, server->authorizer_.get());
  server->worker_service_ =
      std::make_unique<WorkerService>(scheduler, metrics, server->authorizer_.get());
  grpc::ServerBuilder builder;
  RefuseSharedPorts(builder);
  LimitConnections(builder);
  const std::shared_ptr<grpc::ServerCredentials> credentials = TcpCredentials(options.tls);
  std::vector<int> bound_ports(tcp.size(), 0);
  for (size_t i = 0; i < tcp.size(); ++i) {
    builder.AddListeningPort(tcp[i], credentials, &bound_ports[i]);
  }
  builder.RegisterService(server->service_.get());
  builder.RegisterService(server->worker_service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    for (const std::string& address : tcp) {
      if (tcp.size() == 1 || !CanBind(address)) {
        return absl::UnavailableError(
            absl::StrCat("cannot listen on ", address, " (in use, or not a usable address)"));
      }
    }
    return absl::UnavailableError(absl::StrCat("cannot listen on ", absl::StrJoin(tcp, ", ")));
  }
  size_t next_unix = 0;
  size_t next_tcp = 0;
  for (const std::string& address : listen) {
    if (absl::StartsWith(address, kUnixPrefix)) {
      server->bound_.push_back(
          absl::StrCat(kUnixPrefix, server->unix_listener_->paths()[next_unix++]));
      continue;
    }
    const size_t i = next_tcp++;
    server->bound_.push_back(
        wanted_ports[i] != 0
            ? address
            : absl::StrCat(address.substr(0, address.rfind(':') + 1), bound_ports[i]));
  }
  if (server->unix_listener_ != nullptr) server->unix_listener_->Serve(server->server_.get());
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
  if (unix_listener_ != nullptr) unix_listener_->Stop();
  service_->BeginShutdown();
  server_->Shutdown(until);
  server_->Wait();
  server_.reset();
}

}  // namespace quantd::api
