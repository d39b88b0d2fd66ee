// ClientChannel: how a client of the daemon connects and authenticates, shared by quantctl and
// `quantd worker`: the address (unix:PATH or HOST:PORT), a bearer token read from a file, TLS
// with the daemon's CA and optionally a client certificate (mTLS).
#ifndef QUANTD_SERVER_API_CLIENT_CHANNEL_H_
#define QUANTD_SERVER_API_CLIENT_CHANNEL_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace quantd::api {

struct ClientOptions {
  std::string server;      // "unix:/path/to.sock" or "HOST:PORT"
  std::string token_file;  // bearer token sent with every call; "" for none
  std::string tls_ca;      // PEM CA of the daemon's certificate: TLS
  std::string tls_cert;    // PEM client certificate (mTLS); implies TLS
  std::string tls_key;     // its private key
};

class ClientChannel {
 public:
  // Reads the token and TLS files. InvalidArgument naming the flag or the file.
  static absl::StatusOr<ClientChannel> Open(const ClientOptions& options);

  // The channel (connected lazily by gRPC).
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // Adds the bearer token (if any) to `ctx`.
  void Authenticate(grpc::ClientContext* ctx) const;

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::string authorization_;  // "Bearer <token>"; empty: none
};

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_CLIENT_CHANNEL_H_
