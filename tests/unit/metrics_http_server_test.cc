// The metrics HTTP server (metrics/http_server.h) against hostile clients on real sockets: slow
// and idle connections beyond the connection limit do not keep a prompt scraper out, a header over
// the limit is refused, a request body is never waited for, a slow header is dropped at its
// deadline, and other paths and methods get 404 / 405.
#include "server/metrics/http_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace quantd::metrics {
namespace {

constexpr char kExposition[] = "quantd_up 1\n";

// A connected socket to 127.0.0.1:port whose reads give up after 30 s (a test that hangs fails).
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval timeout{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

void Send(int fd, const std::string& text) {
  ASSERT_EQ(send(fd, text.data(), text.size(), MSG_NOSIGNAL), static_cast<ssize_t>(text.size()));
}

// Everything the server sends until it closes the connection.
std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  return out;
}

std::string Request(int port, const std::string& text) {
  const int fd = Connect(port);
  Send(fd, text);
  std::string response = ReadAll(fd);
  close(fd);
  return response;
}

std::string StatusLine(const std::string& response) {
  return response.substr(0, response.find("\r\n"));
}

std::string Body(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

class MetricsHttpServerTest : public testing::Test {
 protected:
  void Start(const MetricsHttpLimits& limits) {
    auto server = MetricsHttpServer::Start(
        "127.0.0.1", 0,
        [this] {
          ++renders_;
          return std::string(kExposition);
        },
        limits);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  int port() const { return server_->port(); }

  std::atomic<int> renders_{0};
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpServerTest, AnswersGetMetricsOnlyAndClosesTheConnection) {
  Start({});
  const std::string ok = Request(port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(StatusLine(ok), "HTTP/1.1 200 OK");
  EXPECT_NE(ok.find("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"),
            std::string::npos)
      << ok;
  EXPECT_NE(ok.find("Connection: close\r\n"), std::string::npos) << ok;
  EXPECT_EQ(Body(ok), kExposition);
  EXPECT_EQ(Body(Request(port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n")), kExposition);
  EXPECT_EQ(StatusLine(Request(port(), "GET / HTTP/1.1\r\n\r\n")), "HTTP/1.1 404 Not Found");
  const std::string post = Request(port(), "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(StatusLine(post), "HTTP/1.1 405 Method Not Allowed");
  EXPECT_NE(post.find("Allow: GET\r\n"), std::string::npos) << post;
  EXPECT_EQ(StatusLine(Request(port(), "NOT HTTP AT ALL\r\n\r\n")), "HTTP/1.1 400 Bad Request");
  EXPECT_EQ(renders_.load(), 2);
}

TEST_F(MetricsHttpServerTest, HugeHeadersAreRefusedAndBodiesNeverWaitedFor) {
  Start({});
  const int big = Connect(port());
  Send(big, "GET /metrics HTTP/1.1\r\nX-Big: ");
  // The server stops reading past the limit: send what fits in the socket buffers, no more.
  const std::string filler(64 << 10, 'a');
  for (int i = 0; i < 4; ++i) {
    if (send(big, filler.data(), filler.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) break;
  }
  EXPECT_EQ(StatusLine(ReadAll(big)), "HTTP/1.1 431 Request Header Fields Too Large");
  close(big);
  // A body of 1 TB is announced and never sent: the answer does not wait for it.
  const int body = Connect(port());
  Send(body, "GET /metrics HTTP/1.1\r\nContent-Length: 1000000000000\r\n\r\n");
  EXPECT_EQ(Body(ReadAll(body)), kExposition);
  close(body);
}

TEST_F(MetricsHttpServerTest, ASlowHeaderIsDroppedAtItsDeadline) {
  MetricsHttpLimits limits;
  limits.request_timeout = std::chrono::milliseconds(200);
  Start(limits);
  const int slow = Connect(port());
  Send(slow, "GET /metrics HTTP/1.1\r\nX-Slow: a");
  EXPECT_EQ(ReadAll(slow), "");  // closed without an answer, well before the 30 s read timeout
  close(slow);
  EXPECT_EQ(renders_.load(), 0);
}

TEST_F(MetricsHttpServerTest, SlowConnectionsBeyondTheLimitDoNotKeepAScraperOut) {
  MetricsHttpLimits limits;
  limits.max_connections = 8;
  limits.request_timeout = std::chrono::minutes(10);  // only eviction can free a slot
  Start(limits);
  std::vector<int> slow;
  for (int i = 0; i < 40; ++i) {
    slow.push_back(Connect(port()));
    Send(slow.back(), "GET /metrics HTTP/1.1\r\nX-Slow: ");
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Body(Request(port(), "GET /metrics HTTP/1.1\r\n\r\n")), kExposition) << i;
  }
  // Every slow connection but the newest few was closed to make room: at most the limit are open.
  int open = 0;
  for (int fd : slow) {
    char c;
    const ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
    open += n < 0 && errno == EAGAIN;
  }
  EXPECT_LE(open, 8);
  for (int fd : slow) close(fd);
}

}  // namespace
}  // namespace quantd::metrics
