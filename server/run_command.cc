#include "server/run_command.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <functional>
#include <iostream>
#include <memory>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/checkpoint/atomic_file.h"
#include "server/compute/device_name.h"
#include "server/job/job_paths.h"
#include "server/job/job_spec.h"
#include "server/scheduler/run_job.h"

namespace quantd {
namespace {

constexpr int kFailed = 1;
constexpr int kUsage = 2;
constexpr int kInterrupted = 130;

// Watches SIGINT, SIGTERM and SIGHUP on its own thread while it lives: the first sets `cancel`
// (the runner pauses the job), a second one ends the process at once, which the state file makes
// as safe as a crash.
class SignalWatch {
 public:
  explicit SignalWatch(std::atomic<bool>* cancel)
      : cancel_(cancel), signals_(io_, SIGINT, SIGTERM, SIGHUP) {
    Wait();
    thread_ = std::thread([this] { io_.run(); });
  }
  ~SignalWatch() {
    io_.stop();
    thread_.join();
  }

 private:
  void Wait() {
    signals_.async_wait([this](const boost::system::error_code& ec, int) {
      if (ec) return;
      if (cancel_->exchange(true)) _exit(kInterrupted);
      Wait();
    });
  }

  std::atomic<bool>* const cancel_;     // set by the first signal
  boost::asio::io_context io_;          // runs the signal handler
  boost::asio::signal_set signals_;     // SIGINT, SIGTERM, SIGHUP
  std::thread thread_;                  // runs io_
};

int Fail(const absl::Status& status, int code) {
  std::cerr << "quantd run: " << status.message() << "\n";
  return code;
}

}  // namespace

int RunMain(const RunArgs& args) {
  if (args.workers < 1) {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat("--workers must be >= 1, got ", args.workers)),
        kUsage);
  }
  if (args.threads < 0) {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat("--threads must be >= 0, got ", args.threads)),
        kUsage);
  }
  int cuda_index = 0;
  if (!args.device.empty() && args.device != "auto" &&
      !compute::ParseDeviceName(args.device, &cuda_index)) {
    return Fail(absl::InvalidArgumentError(
                    absl::StrCat("--device ", args.device, ": expected cpu, cuda:N or auto")),
                kUsage);
  }
  absl::StatusOr<std::string> text = checkpoint::ReadFile(args.spec_path, job::kMaxJobSpecBytes);
  if (!text.ok()) return Fail(text.status(), kUsage);
  absl::StatusOr<job::JobSpec> spec = job::ParseJobSpec(*text, args.spec_path);
  if (!spec.ok()) return Fail(spec.status(), kUsage);
  if (absl::Status s = job::ResolveJobPaths(&*spec, /*allow_relative=*/true); !s.ok()) {
    return Fail(absl::Status(s.code(), absl::StrCat(args.spec_path, ": ", s.message())), kUsage);
  }

  scheduler::RunOptions options;
  options.state_path = args.state_path;
  options.spec = *std::move(spec);
  options.workers = args.workers;
  if (!args.device.empty()) options.devices = {args.device};
  options.cpu_threads = args.threads;
  options.progress = &std::cerr;
  options.progress_tty = isatty(STDERR_FILENO) == 1;
  std::atomic<bool> cancel{false};
  options.cancel = &cancel;
  absl::Status s;
  {
    SignalWatch watch(&cancel);
    s = scheduler::RunJob(options);
  }
  if (s.ok()) return 0;
  if (s.code() == absl::StatusCode::kCancelled && cancel.load()) {
    return Fail(s, kInterrupted);
  }
  return Fail(s, kFailed);
}

void AddRunCommand(CLI::App& app, int& rc) {
  auto args = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand(
      "run", "Run a conversion job from a JSON spec; run it again to resume after a stop");
  cmd->add_option("--state", args->state_path, "SQLite state file (created when absent)")
      ->required();
  cmd->add_option("--workers", args->workers, "tasks in flight at once")->capture_default_str();
  cmd->add_option("--device", args->device, "cpu, cuda:N or auto (default: the spec's devices)");
  cmd->add_option("--threads", args->threads, "CPU threads per kernel call (0 = all cores)")
      ->capture_default_str();
  cmd->add_option("SPEC", args->spec_path, "job spec JSON file")->required();
  cmd->footer(
      "Exit codes: 0 succeeded, 1 failed, 2 usage, 130 interrupted by SIGINT, SIGTERM or SIGHUP "
      "(the job is PAUSED).");
  cmd->callback([args, &rc] { rc = RunMain(*args); });
}

}  // namespace quantd
