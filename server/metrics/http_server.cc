#include "server/metrics/http_server.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cstdint>
#include <exception>
#include <limits>
#include <list>
#include <set>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace quantd::metrics {
namespace {

namespace net = boost::asio;
namespace http = boost::beast::http;
using boost::system::error_code;
using tcp = net::ip::tcp;

// The Prometheus text exposition format, version 0.0.4.
constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";
// How long the accept loop waits after a failed accept (out of descriptors) before it tries again.
constexpr std::chrono::milliseconds kAcceptRetry{100};

}  // namespace

class MetricsHttpServer::Impl {
 public:
  Impl(std::function<std::string()> render, const MetricsHttpLimits& limits)
      : render_(std::move(render)), limits_(limits) {}

  // Stops on the server's thread and joins it.
  ~Impl() {
    if (thread_.joinable()) {
      net::post(io_, [this] { Stop(); });
      thread_.join();
    }
  }

  absl::Status Bind(const std::string& host, int port) {
    // "[::1]" names the address ::1.
    const std::string name = host.size() > 2 && host.front() == '[' && host.back() == ']'
                                 ? host.substr(1, host.size() - 2)
                                 : host;
    const std::string address = absl::StrCat(host, ":", port);
    error_code ec;
    tcp::resolver resolver(io_);
    const tcp::resolver::results_type found =
        resolver.resolve(name, std::to_string(port), tcp::resolver::numeric_service, ec);
    if (ec || found.empty()) {
      return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", address, ": ",
                                                 ec ? ec.message() : "no address"));
    }
    const tcp::endpoint endpoint = found.begin()->endpoint();
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("metrics: cannot listen on ", address, ": ", ec.message()));
    }
    port_ = acceptor_.local_endpoint().port();
    return absl::OkStatus();
  }

  void Run() {
    Accept();
    thread_ = std::thread([this] { io_.run(); });
  }

  int port() const { return port_; }

 private:
  class Connection;

  void Accept() {
    acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted) return;  // stopping
      if (ec) {  // e.g. out of descriptors: try again shortly, not in a busy loop
        retry_.expires_after(kAcceptRetry);
        retry_.async_wait([this](error_code e) {
          if (!e) Accept();
        });
        return;
      }
      Admit(std::move(socket));
      Accept();
    });
  }

  // Serves `socket`, closing the oldest connection still waiting for its header to make room
  // when max_connections are open (or `socket` itself when none is waiting).
  void Admit(tcp::socket socket);
  void Stop();

  const std::function<std::string()> render_;  // the exposition, on this thread
  const MetricsHttpLimits limits_;
  net::io_context io_;
  tcp::acceptor acceptor_{io_};
  net::steady_timer retry_{io_};  // the pause after a failed accept
  int port_ = 0;                  // bound
  bool stopping_ = false;         // Stop ran: no more accepts
  // The open connections; those still waiting for their request header, oldest first. Entries
  // leave both when the connection is destroyed, so every pointer here is alive. Only the
  // server's thread touches them.
  std::set<Connection*> open_;
  std::list<Connection*> waiting_;
  std::thread thread_;  // runs io_
};

// One accepted connection: reads one request header under its deadline, answers, closes.
class MetricsHttpServer::Impl::Connection
    : public std::enable_shared_from_this<MetricsHttpServer::Impl::Connection> {
 public:
  Connection(Impl& server, tcp::socket socket)
      : server_(server),
        socket_(std::move(socket)),
        deadline_(server.io_),
        buffer_(server.limits_.max_header_bytes) {
    server_.open_.insert(this);
    waiting_ = server_.waiting_.insert(server_.waiting_.end(), this);
  }

  ~Connection() {
    StopWaiting();
    server_.open_.erase(this);
  }

  void Start() {
    Expire(server_.limits_.request_timeout);
    parser_.header_limit(static_cast<uint32_t>(server_.limits_.max_header_bytes));
    // A body is never read, so its size does not matter (under boost::none, Beast 1.74 refuses
    // every body, even an empty one).
    parser_.body_limit(std::numeric_limits<std::uint64_t>::max());
    http::async_read_header(
        socket_, buffer_, parser_,
        [self = shared_from_this()](error_code ec, size_t) { self->OnHeader(ec); });
  }

  // Ends the connection: its pending operation completes (aborted) and lets go of it.
  void Close() {
    StopWaiting();
    error_code ignored;
    deadline_.cancel();
    socket_.close(ignored);
  }

  // Leaves the list of connections waiting for their header.
  void StopWaiting() {
    if (waiting_ == server_.waiting_.end()) return;
    server_.waiting_.erase(waiting_);
    waiting_ = server_.waiting_.end();
  }

 private:
  // Closes the connection `timeout` from now unless it has ended by then.
  void Expire(std::chrono::milliseconds timeout) {
    deadline_.expires_after(timeout);
    deadline_.async_wait([weak = weak_from_this()](error_code ec) {
      if (ec) return;  // cancelled
      if (std::shared_ptr<Connection> self = weak.lock()) self->Close();
    });
  }

  void OnHeader(error_code ec) {
    StopWaiting();
    if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
      Answer(http::status::request_header_fields_too_large, "request header too large\n");
      return;
    }
    if (ec.category() == http::make_error_code(http::error::bad_method).category() &&
        ec != http::error::end_of_stream && ec != http::error::partial_message) {
      Answer(http::status::bad_request, "malformed request\n");
      return;
    }
    if (ec) {  // closed, reset, timed out
      Close();
      return;
    }
    const http::request_header<>& request = parser_.get();
    const std::string_view target(request.target().data(), request.target().size());
    if (target.substr(0, target.find('?')) != "/metrics") {
      Answer(http::status::not_found, "not found\n");
    } else if (request.method() != http::verb::get) {
      Answer(http::status::method_not_allowed, "only GET\n");
    } else {
      std::string text;
      try {
        text = server_.render_();
      } catch (const std::exception& e) {
        Answer(http::status::internal_server_error, absl::StrCat(e.what(), "\n"));
        return;
      }
      Answer(http::status::ok, std::move(text), kMetricsContentType);
    }
  }

  // Writes the answer (the request's body, if any, is never read) and closes.
  void Answer(http::status status, std::string body, const char* content_type = "text/plain") {
    Expire(server_.limits_.write_timeout);
    const unsigned version = parser_.is_header_done() && parser_.get().version() == 10 ? 10 : 11;
    response_ = http::response<http::string_body>(status, version);
    response_.set(http::field::content_type, content_type);
    if (status == http::status::method_not_allowed) response_.set(http::field::allow, "GET");
    response_.keep_alive(false);
    response_.body() = std::move(body);
    response_.prepare_payload();
    http::async_write(socket_, response_, [self = shared_from_this()](error_code ec, size_t) {
      if (!ec) {
        error_code ignored;
        self->socket_.shutdown(tcp::socket::shutdown_send, ignored);
      }
      self->Close();
    });
  }

  Impl& server_;
  tcp::socket socket_;
  net::steady_timer deadline_;        // the request's, then the answer's
  boost::beast::flat_buffer buffer_;  // holds at most the header limit
  http::request_parser<http::empty_body> parser_;
  http::response<http::string_body> response_;
  std::list<Connection*>::iterator waiting_;  // in server_.waiting_; end() once the header came
};

void MetricsHttpServer::Impl::Admit(tcp::socket socket) {
  if (stopping_) return;
  if (open_.size() >= limits_.max_connections) {
    if (waiting_.empty()) {  // every slot is answering: this one waits for none of them
      error_code ignored;
      socket.close(ignored);
      return;
    }
    waiting_.front()->Close();
  }
  std::make_shared<Connection>(*this, std::move(socket))->Start();
}

void MetricsHttpServer::Impl::Stop() {
  stopping_ = true;
  error_code ignored;
  acceptor_.close(ignored);
  retry_.cancel();
  // Closing completes each connection's pending operation, which then lets go of it.
  for (Connection* c : std::vector<Connection*>(open_.begin(), open_.end())) c->Close();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, std::function<std::string()> render,
    const MetricsHttpLimits& limits) {
  auto impl = std::make_unique<Impl>(std::move(render), limits);
  if (absl::Status s = impl->Bind(host, port); !s.ok()) return s;
  impl->Run();
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl)));
}

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsHttpServer::~MetricsHttpServer() = default;

int MetricsHttpServer::port() const { return impl_->port(); }

}  // namespace quantd::metrics
