#include "server/api/client_channel.h"

#include <stdint.h>

#include <utility>

#include "server/api/token_file.h"
#include "server/checkpoint/atomic_file.h"

namespace quantd::api {
namespace {

// The largest TLS certificate, key or CA file read.
constexpr uint64_t kMaxPemFileBytes = 1 << 20;

}  // namespace

absl::StatusOr<ClientChannel> ClientChannel::Open(const ClientOptions& options) {
  ClientChannel out;
  if (!options.token_file.empty()) {
    absl::StatusOr<std::string> token = ReadTokenFile(options.token_file, TokenFileAccess::kAny);
    if (!token.ok()) return token.status();
    out.authorization_ = "Bearer " + *token;
  }
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key: give both");
  }
  grpc::SslCredentialsOptions ssl;
  const std::pair<const std::string*, std::string*> pem_files[] = {
      {&options.tls_ca, &ssl.pem_root_certs},
      {&options.tls_cert, &ssl.pem_cert_chain},
      {&options.tls_key, &ssl.pem_private_key}};
  for (const auto& [path, pem] : pem_files) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> text = checkpoint::ReadFile(*path, kMaxPemFileBytes);
    if (!text.ok()) return absl::InvalidArgumentError(text.status().message());
    *pem = *std::move(text);
  }
  const bool tls = !options.tls_ca.empty() || !options.tls_cert.empty();
  out.channel_ = grpc::CreateChannel(
      options.server, tls ? grpc::SslCredentials(ssl) : grpc::InsecureChannelCredentials());
  return out;
}

void ClientChannel::Authenticate(grpc::ClientContext* ctx) const {
  if (!authorization_.empty()) ctx->AddMetadata("authorization", authorization_);
}

}  // namespace quantd::api
