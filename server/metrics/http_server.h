// MetricsHttpServer: the metrics endpoint (GET /metrics over HTTP/1.x), served by one thread with
// Boost.Asio and Beast, so that an open connection costs a socket and a small buffer, not a
// thread. prometheus-cpp's exposer (civetweb) gives each connection a thread for as long as it
// takes to send its request: 8 threads and a queue of 20 let a few hundred connections that send
// their header byte by byte ("slowloris"), or simply stay idle, starve every scrape for as long as
// they last.
//
// What a client can hold (MetricsHttpLimits): a connection must deliver its whole request header
// (at most max_header_bytes) within request_timeout of being accepted, and read the answer within
// write_timeout; at most max_connections are open, and when one more arrives the oldest that has
// not delivered its header yet is closed for it, so a scraper that sends its request at once is
// answered however many slow connections an attacker keeps opening. A request body is never read
// (the answer goes out and the connection closes), each connection serves one request
// (Connection: close), and nothing is buffered per connection beyond its header and its answer.
#ifndef QUANTD_SERVER_METRICS_HTTP_SERVER_H_
#define QUANTD_SERVER_METRICS_HTTP_SERVER_H_

#include <stddef.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace quantd::metrics {

struct MetricsHttpLimits {
  size_t max_connections = 256;
  size_t max_header_bytes = 8192;
  std::chrono::milliseconds request_timeout{2000};  // accept to the header's last byte
  std::chrono::milliseconds write_timeout{10000};   // for the answer
};

class MetricsHttpServer {
 public:
  // Binds `host` (a name, an IPv4 address or a bracketed IPv6 address) and `port` (0: the system
  // picks one) and answers GET and HEAD of /metrics with `render()` as Prometheus text, any other
  // path 404 and any other method 405. `render` runs on the server's thread. Unavailable naming
  // the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, std::function<std::string()> render,
      const MetricsHttpLimits& limits = {});
  // Stops serving: closes the listener and every connection, joins the thread.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The port bound.
  int port() const;

 private:
  class Impl;
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;  // the io_context, its thread and the connections
};

}  // namespace quantd::metrics

#endif  // QUANTD_SERVER_METRICS_HTTP_SERVER_H_
