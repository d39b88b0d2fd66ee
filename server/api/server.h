// ApiServer: the gRPC server of `quantd serve`: QuantService, grpc.health.v1 (overall and
// "quantd.v1.QuantService" SERVING while up) and server reflection, on any number of listen
// addresses ("host:port", port 0 = the system picks one; "unix:/path/to.sock"). Requests run on
// gRPC's own callback threads; Start returns once every address is bound.
#ifndef QUANTD_SERVER_API_SERVER_H_
#define QUANTD_SERVER_API_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/api/quant_service.h"
#include "server/metrics/metrics.h"
#include "server/scheduler/scheduler.h"

namespace quantd::api {

class ApiServer {
 public:
  // Binds every address and starts serving. InvalidArgument for a malformed address or none,
  // Unavailable naming the address that cannot be bound (in use, no such directory). The
  // scheduler and metrics (nullptr = none) must outlive the server.
  static absl::StatusOr<std::unique_ptr<ApiServer>> Start(const std::vector<std::string>& listen,
                                                          scheduler::Scheduler* scheduler,
                                                          metrics::Metrics* metrics);
  // Shutdown(0) unless it already ran.
  ~ApiServer();
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;

  // The listen addresses as bound: a port 0 replaced by the port the system picked.
  const std::vector<std::string>& bound_addresses() const { return bound_; }

  // Health turns NOT_SERVING, open WatchJob streams end with UNAVAILABLE, new calls are refused;
  // calls in progress get until `deadline` to finish and are cancelled then. Returns when every
  // call is done. Later calls do nothing.
  void Shutdown(std::chrono::milliseconds deadline);

 private:
  ApiServer() = default;

  std::unique_ptr<QuantService> service_;  // the RPC handlers; outlives server_
  std::unique_ptr<grpc::Server> server_;   // nullptr after Shutdown
  std::vector<std::string> bound_;         // bound_addresses()
};

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_SERVER_H_
