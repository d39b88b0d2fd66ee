// quantctl: the command-line client of the quantd daemon (README "quantctl"). Every unary call
// gets the --timeout deadline; watch uses it only for its first message. Errors go to stderr as
// "quantctl: <CODE>: <message>" and set the exit code of client/exit_codes.h.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/exit_codes.h"
#include "client/job_json.h"
#include "client/progress_view.h"
#include "client/report_view.h"
#include "client/spec_flags.h"
#include "client/table.h"
#include "client/workers_view.h"
#include "quantd/v1/quantd.grpc.pb.h"
#include "server/api/client_channel.h"
#include "server/api/default_socket.h"

namespace {

namespace client = quantd::client;
namespace v1 = quantd::v1;

// Prints "quantctl: <CODE>: <message>" to stderr; returns the exit code for `code`.
int Fail(grpc::StatusCode code, const std::string& message) {
  std::cerr << "quantctl: " << absl::StatusCodeToString(static_cast<absl::StatusCode>(code)) << ": "
            << message << "\n";
  return client::ExitCodeForStatus(code);
}

int Fail(const absl::Status& s) {
  return Fail(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// The options before (or after) the command, and the connection they describe.
class Session {
 public:
  std::string server = quantd::api::kDefaultServerAddress;  // --server / $QUANTD_SERVER
  double timeout_s = 10;         // --timeout: deadline of unary calls
  std::string output = "table";  // -o table|json
  std::string token_file;        // --token-file: bearer token sent with every call
  std::string tls_ca;            // --tls-ca: the CA of the daemon's certificate (TLS)
  std::string tls_cert;          // --tls-cert: the client certificate (mTLS)
  std::string tls_key;           // --tls-key: its private key

  bool json() const { return output == "json"; }

  // Reads the token and TLS files; call once after parsing. InvalidArgument naming the file.
  absl::Status Load() {
    absl::StatusOr<quantd::api::ClientChannel> channel =
        quantd::api::ClientChannel::Open({server, token_file, tls_ca, tls_cert, tls_key});
    if (!channel.ok()) return channel.status();
    channel_ = *std::move(channel);
    return absl::OkStatus();
  }

  v1::QuantService::Stub& stub() {
    if (stub_ == nullptr) stub_ = v1::QuantService::NewStub(channel_.channel());
    return *stub_;
  }

  // Adds the bearer token (if any) to `ctx`.
  void Authenticate(grpc::ClientContext* ctx) const { channel_.Authenticate(ctx); }

  // A context whose deadline is --timeout from now, with the token.
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(
                          std::chrono::duration<double>(timeout_s)));
    Authenticate(ctx.get());
    return ctx;
  }

  // Fail() for an RPC error; an unreachable daemon is named.
  int RpcFail(const grpc::Status& s) const {
    std::string message = s.error_message();
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      absl::StrAppend(&message, " (server ", server, ")");
    }
    return Fail(s.error_code(), message);
  }

  // Prints `m` as one line of proto3 JSON.
  int PrintJson(const google::protobuf::Message& m) const {
    absl::StatusOr<std::string> text = client::MessageToJson(m);
    if (!text.ok()) return Fail(text.status());
    std::cout << *text << "\n" << std::flush;
    return client::kExitOk;
  }

  // "job <id> <STATE>" or the Job as JSON.
  int PrintJobHeader(const v1::Job& job) const {
    if (json()) return PrintJson(job);
    std::cout << client::FormatJobHeader(job) << "\n" << std::flush;
    return client::kExitOk;
  }

  // Follows job `id` until it ends; `submitted` (or nullptr) is the job as SubmitJob returned it,
  // shown first so that its id is printed even if the watch fails.
  int Watch(int64_t id, const v1::Job* submitted);

 private:
  std::unique_ptr<v1::QuantService::Stub> stub_;  // created on the first call
  quantd::api::ClientChannel channel_;            // opened by Load
};

void ExitOnInterrupt(int) { _exit(client::kExitInterrupted); }

// Terminal columns of stdout, 0 when unknown.
size_t TerminalWidth() {
  struct winsize ws = {};
  return ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;
}

int Session::Watch(int64_t id, const v1::Job* submitted) {
  // Ctrl-C leaves the job running: the stream just closes with the process.
  signal(SIGINT, ExitOnInterrupt);
  const bool tty = !json() && isatty(STDOUT_FILENO) == 1;
  client::ProgressView view(&std::cout, tty, tty ? TerminalWidth() : 0);
  if (submitted != nullptr) {
    if (json()) {
      const int rc = PrintJson(*submitted);
      if (rc != client::kExitOk) return rc;
    } else {
      view.Show(*submitted);
    }
  }

  grpc::ClientContext ctx;  // no deadline: the stream lasts as long as the job runs
  Authenticate(&ctx);
  v1::WatchJobRequest request;
  request.set_id(id);
  // --timeout bounds the wait for the first message only.
  absl::Notification first;
  bool timed_out = false;  // set by `timer`; read only after it was joined
  std::thread timer([&] {
    if (!first.WaitForNotificationWithTimeout(absl::Seconds(timeout_s))) {
      timed_out = true;
      ctx.TryCancel();
    }
  });
  std::unique_ptr<grpc::ClientReader<v1::Job>> reader = stub().WatchJob(&ctx, request);
  v1::Job job;
  bool got_one = false;
  int rc = client::kExitOk;
  while (reader->Read(&job)) {
    if (!got_one) {
      got_one = true;
      first.Notify();
    }
    if (json()) {
      rc = PrintJson(job);
      if (rc != client::kExitOk) break;
    } else {
      view.Show(job);
    }
  }
  if (!first.HasBeenNotified()) first.Notify();
  timer.join();
  if (rc != client::kExitOk) {
    ctx.TryCancel();
    reader->Finish();
    return rc;
  }
  const grpc::Status status = reader->Finish();
  if (timed_out) {  // (a first message that raced the timer is cut off too)
    return Fail(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrCat("no reply to WatchJob within ", timeout_s, " s (server ", server, ")"));
  }
  if (!status.ok()) return RpcFail(status);
  const v1::JobState state = job.state();
  if (!got_one || (state != v1::SUCCEEDED && state != v1::FAILED && state != v1::CANCELLED &&
                   state != v1::PAUSED)) {
    return Fail(grpc::StatusCode::UNAVAILABLE,
                absl::StrCat("the daemon closed the watch of job ", id, " before it finished",
                             " (server ", server, ")"));
  }
  return client::ExitCodeForFinalState(state);
}

void AddSubmit(CLI::App& app, Session& session, int& rc) {
  struct Args {
    client::SpecFlags spec;
    std::string request_id;
    bool watch = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("submit", "Submit a conversion job");
  client::AddSpecFlags(cmd, &args->spec);
  cmd->add_option("--request-id", args->request_id,
                  "idempotency key: submitting the same id again returns the same job");
  cmd->add_flag("--watch", args->watch, "watch the job until it ends");
  cmd->callback([args, &session, &rc] {
    absl::StatusOr<v1::JobSpec> spec = client::BuildSpec(args->spec);
    if (!spec.ok()) {
      rc = Fail(spec.status());
      return;
    }
    v1::SubmitJobRequest request;
    request.set_request_id(args->request_id);
    *request.mutable_spec() = *std::move(spec);
    v1::Job job;
    const grpc::Status s = session.stub().SubmitJob(session.Context().get(), request, &job);
    if (!s.ok()) {
      rc = session.RpcFail(s);
      return;
    }
    rc = args->watch ? session.Watch(job.id(), &job) : session.PrintJobHeader(job);
  });
}

void AddGet(CLI::App& app, Session& session, int& rc) {
  auto id = std::make_shared<int64_t>(0);
  CLI::App* cmd = app.add_subcommand("get", "Show a job");
  cmd->add_option("ID", *id, "job id")->required();
  cmd->callback([id, &session, &rc] {
    v1::GetJobRequest request;
    request.set_id(*id);
    v1::Job job;
    const grpc::Status s = session.stub().GetJob(session.Context().get(), request, &job);
    if (!s.ok()) {
      rc = session.RpcFail(s);
      return;
    }
    if (session.json()) {
      rc = session.PrintJson(job);
      return;
    }
    for (const std::string& line : client::JobLines(job)) std::cout << line << "\n";
    rc = client::kExitOk;
  });
}

void AddList(CLI::App& app, Session& session, int& rc) {
  struct Args {
    std::string state;
    int32_t page_size = 0;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("list", "List jobs in ascending id order");
  cmd->add_option(
      "--state", args->state,
      "only jobs in this state: PENDING, RUNNING, PAUSED, SUCCEEDED, FAILED, CANCELLED");
  cmd->add_option("--page-size", args->page_size, "jobs per call (0: the daemon's default)")
      ->check(CLI::NonNegativeNumber);
  cmd->callback([args, &session, &rc] {
    v1::ListJobsRequest request;
    request.set_page_size(args->page_size);
    if (!args->state.empty()) {
      v1::JobState state;
      if (!v1::JobState_Parse(absl::AsciiStrToUpper(args->state), &state) ||
          state == v1::JOB_STATE_UNSPECIFIED) {
        rc = Fail(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("--state: unknown state '", args->state,
                         "'; expected PENDING, RUNNING, PAUSED, SUCCEEDED, FAILED or CANCELLED"));
        return;
      }
      request.set_state(state);
    }
    // Every page, one call (and one deadline) each.
    v1::ListJobsResponse all;
    while (true) {
      v1::ListJobsResponse page;
      const grpc::Status s = session.stub().ListJobs(session.Context().get(), request, &page);
      if (!s.ok()) {
        rc = session.RpcFail(s);
        return;
      }
      for (v1::Job& job : *page.mutable_jobs()) *all.add_jobs() = std::move(job);
      if (page.next_page_token().empty()) break;
      if (page.next_page_token() == request.page_token()) {
        rc = Fail(grpc::StatusCode::INTERNAL, "ListJobs returned the same page token twice");
        return;
      }
      request.set_page_token(page.next_page_token());
    }
    if (session.json()) {
      rc = session.PrintJson(all);
      return;
    }
    std::vector<std::vector<std::string>> rows = {{"ID", "STATE", "STAGE", "OUTPUT"}};
    for (const v1::Job& job : all.jobs()) {
      std::string state = v1::JobState_Name(job.state());
      if (!job.reason().empty()) absl::StrAppend(&state, " (", job.reason(), ")");
      rows.push_back({absl::StrCat(job.id()), state,
                      job.current_stage().empty() ? "-" : job.current_stage(),
                      job.spec().output()});
    }
    std::cout << client::FormatTable(rows, "rlll");
    rc = client::kExitOk;
  });
}

void AddWatch(CLI::App& app, Session& session, int& rc) {
  auto id = std::make_shared<int64_t>(0);
  CLI::App* cmd = app.add_subcommand(
      "watch", "Follow a job's progress until it ends (exit 0 only when it SUCCEEDED)");
  cmd->add_option("ID", *id, "job id")->required();
  cmd->callback([id, &session, &rc] { rc = session.Watch(*id, nullptr); });
}

void AddCancel(CLI::App& app, Session& session, int& rc) {
  struct Args {
    int64_t id = 0;
    bool pause = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("cancel", "Cancel a job (or pause it with --pause)");
  cmd->add_option("ID", args->id, "job id")->required();
  cmd->add_flag("--pause", args->pause, "pause instead: the job can be resumed later");
  cmd->callback([args, &session, &rc] {
    v1::CancelJobRequest request;
    request.set_id(args->id);
    request.set_pause(args->pause);
    v1::Job job;
    const grpc::Status s = session.stub().CancelJob(session.Context().get(), request, &job);
    rc = s.ok() ? session.PrintJobHeader(job) : session.RpcFail(s);
  });
}

void AddResume(CLI::App& app, Session& session, int& rc) {
  auto id = std::make_shared<int64_t>(0);
  CLI::App* cmd = app.add_subcommand("resume", "Resume a PAUSED or FAILED job");
  cmd->add_option("ID", *id, "job id")->required();
  cmd->callback([id, &session, &rc] {
    v1::ResumeJobRequest request;
    request.set_id(*id);
    v1::Job job;
    const grpc::Status s = session.stub().ResumeJob(session.Context().get(), request, &job);
    rc = s.ok() ? session.PrintJobHeader(job) : session.RpcFail(s);
  });
}

void AddDelete(CLI::App& app, Session& session, int& rc) {
  auto id = std::make_shared<int64_t>(0);
  CLI::App* cmd = app.add_subcommand(
      "delete", "Forget a job that is not RUNNING (its output files stay on disk)");
  cmd->add_option("ID", *id, "job id")->required();
  cmd->callback([id, &session, &rc] {
    v1::DeleteJobRequest request;
    request.set_id(*id);
    v1::DeleteJobResponse response;
    const grpc::Status s = session.stub().DeleteJob(session.Context().get(), request, &response);
    if (!s.ok()) {
      rc = session.RpcFail(s);
      return;
    }
    if (session.json()) {
      rc = session.PrintJson(response);
      return;
    }
    std::cout << "job " << *id << " deleted\n";
    rc = client::kExitOk;
  });
}

void AddReport(CLI::App& app, Session& session, int& rc) {
  struct Args {
    int64_t id = 0;
    int32_t worst = 10;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "report", "Per-tensor error statistics (worst SQNR first) and the export-rule checks");
  cmd->add_option("ID", args->id, "job id")->required();
  cmd->add_option("--worst", args->worst, "how many tensors (0: all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->callback([args, &session, &rc] {
    v1::GetJobReportRequest request;
    request.set_id(args->id);
    request.set_worst(args->worst);
    v1::JobReport report;
    const grpc::Status s = session.stub().GetJobReport(session.Context().get(), request, &report);
    if (!s.ok()) {
      rc = session.RpcFail(s);
      return;
    }
    if (session.json()) {
      rc = session.PrintJson(report);
      return;
    }
    std::cout << client::FormatReport(report, isatty(STDOUT_FILENO) == 1);
    rc = client::kExitOk;
  });
}

void AddWorkers(CLI::App& app, Session& session, int& rc) {
  CLI::App* cmd = app.add_subcommand(
      "workers", "List the remote workers (quantd worker) registered with the daemon");
  cmd->callback([&session, &rc] {
    v1::ListWorkersResponse response;
    const grpc::Status s = session.stub().ListWorkers(session.Context().get(),
                                                      v1::ListWorkersRequest(), &response);
    if (!s.ok()) {
      rc = session.RpcFail(s);
      return;
    }
    if (session.json()) {
      rc = session.PrintJson(response);
      return;
    }
    std::cout << client::FormatWorkers(response, absl::Now());
    rc = client::kExitOk;
  });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"quantctl: submits and follows quantd conversion jobs"};
  app.set_version_flag("--version", QUANTD_VERSION);
  app.require_subcommand(1);
  app.fallthrough();  // the options below also work after the command
  Session session;
  app.add_option("--server", session.server,
                 "daemon address: unix:/path/to.sock or HOST:PORT (default: the socket of a "
                 "daemon with the default --state-dir, started in this directory)")
      ->envname("QUANTD_SERVER")
      ->capture_default_str();
  app.add_option("--token-file", session.token_file,
                 "file with a bearer token, sent with every call (TCP addresses)");
  app.add_option("--tls-ca", session.tls_ca,
                 "PEM CA of the daemon's certificate: connect with TLS");
  app.add_option("--tls-cert", session.tls_cert,
                 "PEM client certificate for a daemon with --tls-client-ca (implies TLS)");
  app.add_option("--tls-key", session.tls_key, "PEM private key of --tls-cert");
  app.add_option("--timeout", session.timeout_s,
                 "seconds: deadline of every call (watch: of its first message)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  // Only -o: submit's --output is the output directory.
  app.add_option("-o", session.output, "output format: table or json")
      ->capture_default_str()
      ->check(CLI::IsMember({"table", "json"}));

  int rc = client::kExitOk;
  AddSubmit(app, session, rc);
  AddGet(app, session, rc);
  AddList(app, session, rc);
  AddWatch(app, session, rc);
  AddCancel(app, session, rc);
  AddResume(app, session, rc);
  AddDelete(app, session, rc);
  AddReport(app, session, rc);
  AddWorkers(app, session, rc);
  // Subcommand callbacks run inside parse(); the files must be read before them.
  app.parse_complete_callback([&session, &rc] {
    if (absl::Status s = session.Load(); !s.ok()) {
      rc = Fail(s);
      throw CLI::RuntimeError(rc);
    }
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::RuntimeError& e) {  // reported already
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    return Fail(grpc::StatusCode::INVALID_ARGUMENT,
                absl::StrCat(e.what(), " (run quantctl --help)"));
  }
  return rc;
}
