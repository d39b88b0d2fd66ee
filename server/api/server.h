// ApiServer: the gRPC server of `quantd serve`: QuantService, WorkerService (remote workers),
// grpc.health.v1 (overall and "quantd.v1.QuantService" SERVING while up) and server reflection, on
// any number of listen addresses: "unix:/path/to.sock" (callers known by their uid,
// unix_listener.h) and "host:port" (port 0 = the system picks one; callers known by a bearer token
// or a TLS client certificate). Every call of both services passes the Authorizer first
// (authorizer.h). Requests run on gRPC's own
// callback threads; Start returns once every address is bound.
#ifndef QUANTD_SERVER_API_SERVER_H_
#define QUANTD_SERVER_API_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/api/access_policy.h"
#include "server/api/authorizer.h"
#include "server/api/quant_service.h"
#include "server/api/unix_listener.h"
#include "server/api/worker_service.h"
#include "server/metrics/metrics.h"
#include "server/scheduler/scheduler.h"

namespace quantd::api {

// PEM texts of the TCP addresses' TLS; all empty: plaintext TCP.
struct TlsPem {
  std::string cert;       // the server's certificate chain
  std::string key;        // its private key
  std::string client_ca;  // when set, clients must present a certificate this CA signed (mTLS)

  bool enabled() const { return !cert.empty(); }
};

struct ApiServerOptions {
  std::vector<std::string> listen;  // "unix:PATH" and "HOST:PORT" addresses
  UnixSocketOptions unix_socket;    // mode and group of the unix sockets
  TlsPem tls;                       // for the TCP addresses
  AccessPolicy policy;              // who may do what
};

// Whether the "HOST:PORT" address is on a loopback interface (127.0.0.0/8, [::1], localhost).
bool IsLoopbackAddress(const std::string& address);

class ApiServer {
 public:
  // Binds every address and starts serving. InvalidArgument for a malformed address or none,
  // Unavailable naming the address that cannot be bound (in use, no such directory), any
  // UnixListener::Bind error. The scheduler and metrics (nullptr = none) must outlive the server.
  static absl::StatusOr<std::unique_ptr<ApiServer>> Start(ApiServerOptions options,
                                                          scheduler::Scheduler* scheduler,
                                                          metrics::Metrics* metrics);
  // Shutdown(0) unless it already ran.
  ~ApiServer();
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;

  // The listen addresses as bound: a port 0 replaced by the port the system picked, a unix socket
  // path made absolute.
  const std::vector<std::string>& bound_addresses() const { return bound_; }

  // Health turns NOT_SERVING, open WatchJob streams end with UNAVAILABLE, new calls are refused;
  // calls in progress get until `deadline` to finish and are cancelled then. Returns when every
  // call is done. Later calls do nothing.
  void Shutdown(std::chrono::milliseconds deadline);

 private:
  ApiServer() = default;

  AccessPolicy policy_;                         // the authorizer's grants
  std::unique_ptr<UnixListener> unix_listener_;  // the unix sockets; nullptr when none
  std::unique_ptr<Authorizer> authorizer_;      // the service's access checks
  std::unique_ptr<QuantService> service_;       // the RPC handlers; outlive server_
  std::unique_ptr<WorkerService> worker_service_;
  std::unique_ptr<grpc::Server> server_;        // nullptr after Shutdown
  std::vector<std::string> bound_;              // bound_addresses()
};

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_SERVER_H_
