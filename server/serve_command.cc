#include "server/serve_command.h"

#include <pthread.h>
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/backends.h"
#include "server/api/server.h"
#include "server/checkpoint/atomic_file.h"
#include "server/metrics/metrics.h"
#include "server/pipeline/job_spec.h"
#include "server/pipeline/stage_registry.h"
#include "server/scheduler/scheduler.h"
#include "server/store/file_lock.h"
#include "server/store/job_store.h"

namespace quantd {
namespace {

constexpr int kCannotStart = 1;
constexpr int kUsage = 2;
// The longest that RPCs in progress get to finish at shutdown (never more than the grace).
constexpr std::chrono::milliseconds kRpcDrain{5000};

using nlohmann::json;

// "auto" -> empty, else the comma-separated entries.
std::vector<std::string> ParseDeviceList(const std::string& text) {
  if (text == "auto") return {};
  return absl::StrSplit(text, ',');
}

// Reads one config value; errors name the file and key.
class ConfigReader {
 public:
  ConfigReader(const std::string& path, const std::string& key, const json& value)
      : path_(path), key_(key), value_(value) {}

  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": key '", key_, "' ", what));
  }
  absl::Status String(std::string* out) const {
    if (!value_.is_string()) return Error("must be a string");
    *out = value_.get<std::string>();
    return absl::OkStatus();
  }
  // A string (one entry) or an array of strings.
  absl::Status Strings(std::vector<std::string>* out) const {
    if (value_.is_string()) {
      *out = {value_.get<std::string>()};
      return absl::OkStatus();
    }
    if (!value_.is_array()) return Error("must be a string or an array of strings");
    out->clear();
    for (const json& v : value_) {
      if (!v.is_string()) return Error("must be a string or an array of strings");
      out->push_back(v.get<std::string>());
    }
    return absl::OkStatus();
  }
  template <typename Int>
  absl::Status Integer(Int* out) const {
    if (!value_.is_number_integer()) return Error("must be an integer");
    const int64_t v = value_.get<int64_t>();
    if (v < std::numeric_limits<Int>::min() || v > std::numeric_limits<Int>::max()) {
      return Error("is out of range");
    }
    *out = static_cast<Int>(v);
    return absl::OkStatus();
  }
  absl::Status Number(double* out) const {
    if (!value_.is_number()) return Error("must be a number");
    *out = value_.get<double>();
    return absl::OkStatus();
  }

 private:
  const std::string& path_;  // the config file, for errors
  const std::string& key_;   // the key being read
  const json& value_;        // its value
};

absl::Status CheckDevice(const std::string& device) {
  int index = 0;
  if (pipeline::ParseDeviceName(device, &index)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("devices (--devices): \"", device, "\" is not cpu or cuda:N"));
}

// The workers' devices: the explicit list when every CUDA device in it exists, else every CUDA
// device, else cpu_workers CPU workers.
absl::StatusOr<std::vector<std::string>> ResolveDevices(const ServeConfig& config) {
  const int cuda = kernels::CudaDeviceCount();
  if (config.devices.empty()) {
    std::vector<std::string> devices;
    for (int i = 0; i < cuda; ++i) devices.push_back(absl::StrCat("cuda:", i));
    if (cuda == 0) devices.assign(config.cpu_workers, "cpu");
    return devices;
  }
  for (const std::string& device : config.devices) {
    int index = 0;
    if (pipeline::ParseDeviceName(device, &index) && index >= cuda) {
      return absl::FailedPreconditionError(
          absl::StrCat("device ", device, " does not exist (", cuda, " CUDA devices found)"));
    }
  }
  return config.devices;
}

// Takes <state-dir>/quantd.lock; the lock is held while the returned FileLock lives.
absl::StatusOr<std::unique_ptr<store::FileLock>> LockStateDir(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "quantd.lock").string();
  bool held_elsewhere = false;
  absl::StatusOr<std::unique_ptr<store::FileLock>> lock =
      store::FileLock::Acquire(path, &held_elsewhere);
  if (!lock.ok() && held_elsewhere) {
    return absl::FailedPreconditionError(
        absl::StrCat("another quantd serves the state dir ", dir, " (", path, " is locked)"));
  }
  return lock;
}

// The settings as one log line.
std::string Describe(const ServeConfig& config, const std::vector<std::string>& devices) {
  return absl::StrCat("state dir ", config.state_dir, ", devices ", absl::StrJoin(devices, ","),
                      ", cpu threads ", config.cpu_threads, ", host memory budget ",
                      config.host_memory_bytes, " bytes, queue limit ", config.queue_limit,
                      ", shutdown grace ", config.shutdown_grace_seconds, " s");
}

int Usage(const absl::Status& status) {
  std::cerr << "quantd serve: " << status.message() << "\n";
  return kUsage;
}

int CannotStart(const absl::Status& status) {
  spdlog::error("quantd serve: {}", std::string(status.message()));
  return kCannotStart;
}

}  // namespace

absl::Status ApplyServeConfigFile(const std::string& path, ServeConfig* config) {
  absl::StatusOr<std::string> text = checkpoint::ReadFile(path);
  if (!text.ok()) return absl::InvalidArgumentError(text.status().message());
  const json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const ConfigReader r(path, key, it.value());
    absl::Status s;
    if (key == "listen") {
      s = r.Strings(&config->listen);
    } else if (key == "metrics_listen") {
      s = r.String(&config->metrics_listen);
    } else if (key == "state_dir") {
      s = r.String(&config->state_dir);
    } else if (key == "devices") {
      std::vector<std::string> devices;
      s = r.Strings(&devices);
      if (s.ok() && it.value().is_string()) {
        if (devices[0] != "auto") s = r.Error("must be \"auto\" or an array of devices");
        devices.clear();
      }
      config->devices = std::move(devices);
    } else if (key == "cpu_workers") {
      s = r.Integer(&config->cpu_workers);
    } else if (key == "cpu_threads") {
      s = r.Integer(&config->cpu_threads);
    } else if (key == "host_memory_bytes") {
      s = r.Integer(&config->host_memory_bytes);
    } else if (key == "queue_limit") {
      s = r.Integer(&config->queue_limit);
    } else if (key == "shutdown_grace_seconds") {
      s = r.Number(&config->shutdown_grace_seconds);
    } else {
      s = r.Error("is not a known setting");
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ValidateServeConfig(const ServeConfig& config) {
  if (config.listen.empty()) return absl::InvalidArgumentError("listen (--listen): none given");
  for (const std::string& address : config.listen) {
    if (address.empty()) return absl::InvalidArgumentError("listen (--listen): an empty address");
  }
  if (config.metrics_listen.empty()) {
    return absl::InvalidArgumentError("metrics_listen (--metrics-listen): empty; use none");
  }
  if (config.state_dir.empty()) {
    return absl::InvalidArgumentError("state_dir (--state-dir): empty");
  }
  for (const std::string& device : config.devices) {
    if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  }
  if (config.cpu_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu_workers (--cpu-workers): must be >= 1, got ", config.cpu_workers));
  }
  if (config.cpu_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu_threads (--cpu-threads): must be >= 0, got ", config.cpu_threads));
  }
  if (config.host_memory_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_memory_bytes (--host-memory-bytes): must be >= 0, got ", config.host_memory_bytes));
  }
  if (config.queue_limit < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_limit (--queue-limit): must be >= 1, got ", config.queue_limit));
  }
  if (!std::isfinite(config.shutdown_grace_seconds) || config.shutdown_grace_seconds < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shutdown_grace_seconds (--shutdown-grace-seconds): must be >= 0, got ",
                     config.shutdown_grace_seconds));
  }
  return absl::OkStatus();
}

int ServeMain(const ServeConfig& config) {
  if (absl::Status s = ValidateServeConfig(config); !s.ok()) return Usage(s);
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(
      "quantd", std::make_shared<spdlog::sinks::stderr_color_sink_mt>()));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");

  // Every thread started from here on inherits the blocked signals; the main thread takes them
  // with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::vector<std::string>> devices = ResolveDevices(config);
  if (!devices.ok()) return CannotStart(devices.status());
  std::error_code ec;
  std::filesystem::create_directories(config.state_dir, ec);
  if (ec) {
    return CannotStart(absl::FailedPreconditionError(
        absl::StrCat("cannot create the state dir ", config.state_dir, ": ", ec.message())));
  }
  absl::StatusOr<std::unique_ptr<store::FileLock>> lock = LockStateDir(config.state_dir);
  if (!lock.ok()) return CannotStart(lock.status());
  const std::filesystem::path state_dir(config.state_dir);
  const std::string serve_json = (state_dir / "serve.json").string();
  std::filesystem::remove(serve_json, ec);  // a crashed daemon's; readers wait for the new one

  const bool cuda = kernels::CudaDeviceCount() > 0;
  std::unique_ptr<metrics::Metrics> metrics;
  if (config.metrics_listen == "none") {
    metrics = metrics::Metrics::Create(QUANTD_VERSION, cuda);
  } else {
    absl::StatusOr<std::unique_ptr<metrics::Metrics>> served =
        metrics::Metrics::Serve(config.metrics_listen, QUANTD_VERSION, cuda);
    if (!served.ok()) {
      if (served.status().code() == absl::StatusCode::kInvalidArgument) {
        return Usage(served.status());
      }
      return CannotStart(served.status());
    }
    metrics = *std::move(served);
  }
  metrics->DeclareStages(pipeline::BuiltinStages().kinds());

  absl::StatusOr<std::unique_ptr<store::JobStore>> store =
      store::JobStore::Open((state_dir / "quantd.db").string());
  if (!store.ok()) return CannotStart(store.status());
  scheduler::SchedulerOptions options;
  options.devices = *devices;
  options.cpu_threads = config.cpu_threads;
  options.queue_limit = config.queue_limit;
  options.host_memory_bytes = config.host_memory_bytes;
  // Kernels saturate the cores; a little lower priority keeps the API responsive under load.
  options.worker_nice = 5;
  options.metrics = metrics.get();
  options.log = [](int64_t job_id, const std::string& kind, const std::string& message) {
    spdlog::info("job {} {}: {}", job_id, kind, message);
  };
  absl::StatusOr<std::unique_ptr<scheduler::Scheduler>> scheduler =
      scheduler::Scheduler::Start(*std::move(store), std::move(options));
  if (!scheduler.ok()) return CannotStart(scheduler.status());

  absl::StatusOr<std::unique_ptr<api::ApiServer>> server =
      api::ApiServer::Start(config.listen, scheduler->get(), metrics.get());
  if (!server.ok()) {
    (*scheduler)->Shutdown(std::chrono::milliseconds(0));
    if (server.status().code() == absl::StatusCode::kInvalidArgument) {
      return Usage(server.status());
    }
    return CannotStart(server.status());
  }

  const json ready = {{"pid", static_cast<int64_t>(getpid())},
                      {"listen", (*server)->bound_addresses()},
                      {"metrics_listen", metrics->listen_address()}};
  if (absl::Status s = checkpoint::WriteFileAtomically(serve_json, ready.dump() + "\n"); !s.ok()) {
    (*server)->Shutdown(std::chrono::milliseconds(0));
    (*scheduler)->Shutdown(std::chrono::milliseconds(0));
    return CannotStart(s);
  }
  spdlog::info("quantd {} serving on {} (metrics: {}); {}", QUANTD_VERSION,
               absl::StrJoin((*server)->bound_addresses(), ", "),
               metrics->listen_address().empty() ? "none" : metrics->listen_address(),
               Describe(config, *devices));

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  const auto grace = std::chrono::milliseconds(
      static_cast<int64_t>(std::llround(config.shutdown_grace_seconds * 1000)));
  spdlog::info("{}: shutting down (grace {} s)", strsignal(signal_number),
               config.shutdown_grace_seconds);
  (*server)->Shutdown(std::min(grace, kRpcDrain));
  (*scheduler)->Shutdown(grace);
  std::filesystem::remove(serve_json, ec);
  spdlog::info("stopped");
  return 0;
}

void AddServeCommand(CLI::App& app, int& rc) {
  // Flags land in `flags`; only those given override the config file (or the defaults).
  struct Parsed {
    std::string config_path;
    ServeConfig flags;
    std::string devices = "auto";
  };
  auto parsed = std::make_shared<Parsed>();
  ServeConfig& f = parsed->flags;
  CLI::App* cmd = app.add_subcommand("serve", "Run the job daemon (gRPC API, scheduler, metrics)");
  cmd->add_option("--config", parsed->config_path,
                  "JSON file with the settings below (snake_case)");
  CLI::Option* listen =
      cmd->add_option("--listen", f.listen, "gRPC address, repeatable (HOST:PORT, unix:PATH)")
          ->capture_default_str();
  CLI::Option* metrics_listen =
      cmd->add_option("--metrics-listen", f.metrics_listen, "Prometheus address, or none")
          ->capture_default_str();
  CLI::Option* state_dir =
      cmd->add_option("--state-dir", f.state_dir, "holds quantd.db, quantd.lock, serve.json")
          ->capture_default_str();
  CLI::Option* devices =
      cmd->add_option("--devices", parsed->devices, "auto, or a list such as cpu,cuda:0")
          ->capture_default_str();
  CLI::Option* cpu_workers =
      cmd->add_option("--cpu-workers", f.cpu_workers, "CPU workers when auto finds no GPU")
          ->capture_default_str();
  CLI::Option* cpu_threads =
      cmd->add_option("--cpu-threads", f.cpu_threads, "threads per CPU kernel call (0 = all)")
          ->capture_default_str();
  CLI::Option* host_memory =
      cmd->add_option("--host-memory-bytes", f.host_memory_bytes, "host-memory budget (0 = none)")
          ->capture_default_str();
  CLI::Option* queue_limit = cmd->add_option("--queue-limit", f.queue_limit, "PENDING jobs at most")
                                 ->capture_default_str();
  CLI::Option* grace = cmd->add_option("--shutdown-grace-seconds", f.shutdown_grace_seconds,
                                       "how long running tasks get to stop at SIGTERM")
                           ->capture_default_str();
  cmd->footer("Exit codes: 0 clean shutdown, 1 could not start, 2 usage or config error.");
  cmd->callback([=, &rc] {
    ServeConfig config;
    if (!parsed->config_path.empty()) {
      if (absl::Status s = ApplyServeConfigFile(parsed->config_path, &config); !s.ok()) {
        rc = Usage(s);
        return;
      }
    }
    const ServeConfig& given = parsed->flags;
    if (listen->count() > 0) config.listen = given.listen;
    if (metrics_listen->count() > 0) config.metrics_listen = given.metrics_listen;
    if (state_dir->count() > 0) config.state_dir = given.state_dir;
    if (devices->count() > 0) config.devices = ParseDeviceList(parsed->devices);
    if (cpu_workers->count() > 0) config.cpu_workers = given.cpu_workers;
    if (cpu_threads->count() > 0) config.cpu_threads = given.cpu_threads;
    if (host_memory->count() > 0) config.host_memory_bytes = given.host_memory_bytes;
    if (queue_limit->count() > 0) config.queue_limit = given.queue_limit;
    if (grace->count() > 0) config.shutdown_grace_seconds = given.shutdown_grace_seconds;
    rc = ServeMain(config);
  });
}

}  // namespace quantd
