#include "server/serve_command.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/backends.h"
#include "server/api/access_policy.h"
#include "server/api/history_pruner.h"
#include "server/api/server.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/atomic_file.h"
#include "server/compute/device_name.h"
#include "server/job/job_spec.h"
#include "server/metrics/metrics.h"
#include "server/ops/serve_monitor.h"
#include "server/ops/systemd_notify.h"
#include "server/pipeline/stage_registry.h"
#include "server/scheduler/scheduler.h"
#include "server/store/file_lock.h"
#include "server/store/job_store.h"
#include "server/store/private_files.h"

namespace quantd {
namespace {

constexpr int kCannotStart = 1;
constexpr int kUsage = 2;
// A --listen value that adds no address (it overrides a config file's list).
constexpr char kNoListen[] = "none";
constexpr int kStoreUnusable = 3;
// The longest that RPCs in progress get to finish at shutdown (never more than the grace).
constexpr std::chrono::milliseconds kRpcDrain{5000};
// How often history retention runs (besides once at start).
constexpr std::chrono::milliseconds kPrunePeriod{10 * 60 * 1000};
// The largest --config file read.
constexpr uint64_t kMaxConfigFileBytes = 1 << 20;
// The largest TLS certificate, key or CA file read.
constexpr uint64_t kMaxPemFileBytes = 1 << 20;

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
  absl::Status Bool(bool* out) const {
    if (!value_.is_boolean()) return Error("must be true or false");
    *out = value_.get<bool>();
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
  if (compute::ParseDeviceName(device, &index)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("devices (--devices): \"", device, "\" is not cpu or cuda:N"));
}

// `--devices none`: no local worker, remote workers (`quantd worker`) run every task.
constexpr char kNoDevices[] = "none";

// The workers' devices: none for "none", the explicit list when every CUDA device in it exists,
// else every CUDA device, else cpu_workers CPU workers.
absl::StatusOr<std::vector<std::string>> ResolveDevices(const ServeConfig& config) {
  if (config.devices == std::vector<std::string>{kNoDevices}) return std::vector<std::string>{};
  const int cuda = kernels::CudaDeviceCount();
  if (config.devices.empty()) {
    std::vector<std::string> devices;
    for (int i = 0; i < cuda; ++i) devices.push_back(absl::StrCat("cuda:", i));
    if (cuda == 0) devices.assign(config.cpu_workers, "cpu");
    return devices;
  }
  for (const std::string& device : config.devices) {
    int index = 0;
    if (compute::ParseDeviceName(device, &index) && index >= cuda) {
      return absl::FailedPreconditionError(
          absl::StrCat("device ", device, " does not exist (", cuda, " CUDA devices found)"));
    }
  }
  return config.devices;
}

// The lock file holds the pid of the daemon that holds the lock ("<pid>\n"), so that a second
// daemon can name it; at most this many bytes of it are read.
constexpr uint64_t kMaxLockFileBytes = 64;

// Takes <state-dir>/quantd.lock and writes this process's pid into it; the lock is held while the
// returned FileLock lives. When another daemon holds it, the error names that daemon's pid.
absl::StatusOr<std::unique_ptr<store::FileLock>> LockStateDir(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "quantd.lock").string();
  bool held_elsewhere = false;
  absl::StatusOr<std::unique_ptr<store::FileLock>> lock =
      store::FileLock::Acquire(path, &held_elsewhere);
  if (!lock.ok() && held_elsewhere) {
    absl::StatusOr<std::string> text = checkpoint::ReadFile(path, kMaxLockFileBytes);
    int64_t pid = 0;
    const std::string holder =
        text.ok() && absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &pid) && pid > 0
            ? absl::StrCat("pid ", pid)
            : std::string("its pid is not recorded yet");
    return absl::FailedPreconditionError(
        absl::StrCat("another quantd (", holder, ") serves the state dir ", dir, " (", path,
                     " is locked); stop it first, or give this one another --state-dir"));
  }
  if (!lock.ok()) return lock;
  // Written in place (the lock is on this very file): truncate, then the pid.
  const int fd = open(path.c_str(), O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 || ftruncate(fd, 0) != 0) {
    const int err = errno;
    if (fd >= 0) close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot record this quantd's pid in ", path, ": ", strerror(err)));
  }
  const std::string pid = absl::StrCat(getpid(), "\n");
  absl::Status written = checkpoint::WriteFully(fd, pid.data(), pid.size(), path);
  close(fd);
  if (!written.ok()) return absl::FailedPreconditionError(written.message());
  return lock;
}

// The settings as one log line.
std::string Describe(const ServeConfig& config, const std::vector<std::string>& devices) {
  return absl::StrCat("state dir ", config.state_dir, ", devices ",
                      devices.empty() ? std::string(kNoDevices) : absl::StrJoin(devices, ","),
                      ", cpu threads ", config.cpu_threads, ", host memory budget ",
                      config.host_memory_bytes, " bytes, queue limit ", config.queue_limit,
                      ", shutdown grace ", config.shutdown_grace_seconds, " s, planning ",
                      config.planning_threads, " at once, each within ",
                      config.planning_memory_bytes, " bytes and ",
                      config.planning_deadline_seconds, " s");
}

// Logs a failed systemd notification; the daemon serves on regardless.
void Notify(const std::string& state) {
  if (absl::Status s = ops::SystemdNotify(state); !s.ok()) {
    spdlog::warn("{}", std::string(s.message()));
  }
}

// The housekeeping thread: disk-space samples and, under systemd's WatchdogSec=, the watchdog
// pings that stop when the scheduler stops refreshing its metrics.
std::unique_ptr<ops::ServeMonitor> StartMonitor(const ServeConfig& config,
                                                const scheduler::Scheduler& scheduler,
                                                metrics::Metrics* metrics) {
  ops::ServeMonitorOptions options;
  std::error_code ec;
  options.state_dir = std::filesystem::absolute(config.state_dir, ec).string();
  options.board = &scheduler.board();
  options.metrics = metrics;
  if (std::optional<std::chrono::microseconds> interval = ops::SystemdWatchdogInterval()) {
    using std::chrono::duration_cast;
    using std::chrono::milliseconds;
    // Two pings per interval, as sd_watchdog_enabled(3) advises.
    options.period = std::clamp(duration_cast<milliseconds>(*interval / 2), milliseconds(100),
                                options.period);
    options.max_heartbeat_age = duration_cast<milliseconds>(*interval);
    options.watchdog = [] { Notify("WATCHDOG=1"); };
  }
  return ops::ServeMonitor::Start(std::move(options));
}

// The access policy, TLS files and socket options of the API server; InvalidArgument naming the
// file or setting that is wrong. Warns about a non-loopback address served with --insecure.
absl::StatusOr<api::ApiServerOptions> ApiOptions(const ServeConfig& config) {
  api::ApiServerOptions options;
  const std::string socket = config.socket.empty()
                                 ? (std::filesystem::path(config.state_dir) / api::kSocketFileName)
                                       .string()
                                 : config.socket;
  options.listen.push_back(absl::StrCat("unix:", socket));
  for (const std::string& address : config.listen) {
    if (address != kNoListen) options.listen.push_back(address);
  }
  if (!config.socket_group.empty()) {
    uint32_t gid = 0;
    if (absl::SimpleAtoi(config.socket_group, &gid)) {
      options.unix_socket.group = gid;
    } else if (const struct group* group = getgrnam(config.socket_group.c_str())) {
      options.unix_socket.group = group->gr_gid;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "socket_group (--socket-group): no group named \"", config.socket_group, "\""));
    }
  }
  ASSIGN_OR_RETURN(options.policy,
                   api::AccessPolicy::Load(config.access_config, config.token_file, geteuid()));
  const std::pair<const std::string*, std::string*> pem_files[] = {
      {&config.tls_cert, &options.tls.cert},
      {&config.tls_key, &options.tls.key},
      {&config.tls_client_ca, &options.tls.client_ca}};
  for (const auto& [path, pem] : pem_files) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> text = checkpoint::ReadFile(*path, kMaxPemFileBytes);
    if (!text.ok()) return absl::InvalidArgumentError(text.status().message());
    *pem = *std::move(text);
  }
  for (const std::string& address : config.listen) {
    if (address == kNoListen || absl::StartsWith(address, "unix:")) continue;
    if (!options.policy.has_tokens() && config.tls_client_ca.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "listen (--listen) ", address,
          ": no TCP caller could authenticate; give --token-file, token_file entries in "
          "--access-config, or --tls-client-ca"));
    }
    if (api::IsLoopbackAddress(address) || options.tls.enabled()) continue;
    if (!config.insecure) {
      return absl::InvalidArgumentError(absl::StrCat(
          "listen (--listen) ", address,
          ": not a loopback address, and without TLS its tokens and jobs cross the network in "
          "clear text; give --tls-cert/--tls-key (or --insecure to accept that)"));
    }
    spdlog::warn("--insecure: serving {} without TLS; tokens and job data cross the network in "
                 "clear text",
                 address);
  }
  return options;
}

// Creates the state dir, private (store/private_files.h): mode 0700, or 0710 with the socket's
// group when a unix socket lies in it and --socket-group names that group, so that the group's
// members reach the socket (mode 0660) but can neither list the dir nor open what is in it. An
// existing state dir keeps its mode (the files quantd keeps in it are private either way); a
// warning names one that other users may enter or list.
absl::Status PrepareStateDir(const std::string& dir, const api::ApiServerOptions& api) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path path = fs::absolute(dir, ec).lexically_normal();
  if (!path.has_filename()) path = path.parent_path();  // "state/" names "state"
  struct stat st;
  if (stat(path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the state dir ", dir, " exists and is not a directory"));
    }
    if ((st.st_mode & S_IRWXO) != 0) {
      spdlog::warn(
          "the state dir {} can be entered or listed by other users (mode {:04o}); the "
          "files quantd keeps there are private, chmod o-rwx it to hide their names too",
          dir, st.st_mode & 07777);
    }
    return absl::OkStatus();
  }
  fs::create_directories(path.parent_path(), ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the state dir ", dir, ": ", ec.message()));
  }
  if (absl::StatusOr<bool> made = store::CreatePrivateDir(path.string()); !made.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the state dir ", dir, ": ", made.status().message()));
  }
  if (!api.unix_socket.group.has_value()) return absl::OkStatus();
  for (const std::string& address : api.listen) {
    if (!absl::StartsWith(address, "unix:")) continue;
    const fs::path socket = fs::absolute(address.substr(5), ec).lexically_normal();
    if (socket.parent_path() != path) continue;
    if (chown(path.c_str(), -1, *api.unix_socket.group) != 0 ||
        chmod(path.c_str(), store::kPrivateDirMode | S_IXGRP) != 0) {
      return absl::FailedPreconditionError(absl::StrCat("cannot let group ", *api.unix_socket.group,
                                                        " reach the socket in the "
                                                        "state dir ",
                                                        dir, ": ", strerror(errno)));
    }
    break;
  }
  return absl::OkStatus();
}

// Writes serve.json atomically (its .tmp, fsync, rename), private from the start: the .tmp is
// created 0600 (store/private_files.h) before anything is written to it.
absl::Status WriteServeJson(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  unlink(tmp.c_str());  // a crashed daemon's
  RETURN_IF_ERROR(store::CreatePrivateFile(tmp));
  const int fd = open(tmp.c_str(), O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
  absl::Status status = fd >= 0 ? checkpoint::WriteFully(fd, text.data(), text.size(), tmp)
                                : absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", tmp));
  if (fd >= 0) {
    absl::Status closed = checkpoint::SyncAndClose(fd, tmp);
    if (status.ok()) status = closed;
  }
  if (status.ok()) status = checkpoint::CommitTmpFile(tmp, path);
  if (!status.ok()) unlink(tmp.c_str());
  return status;
}

// Raises the soft RLIMIT_NOFILE to the hard limit: a low soft limit (often 1024) lets a flood of
// idle connections take every descriptor, and gRPC 1.51 then stops accepting for good.
void RaiseDescriptorLimit() {
  struct rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == limit.rlim_max) return;
  const rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
    spdlog::info("raised the open-file limit from {} to {}", before, limit.rlim_max);
  }
}

// Whether the state dir holds anything besides the lock: then a missing or 0-byte quantd.db is a
// lost database, not a first start.
bool HoldsOtherStateFiles(const std::filesystem::path& dir) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name != "quantd.lock") return true;
  }
  return false;
}

// A log line carries at most this much of a message (paths and errors can be long).
constexpr size_t kMaxLoggedMessage = 4096;

std::string ForLog(const std::string& message) {
  if (message.size() <= kMaxLoggedMessage) return message;
  return absl::StrCat(message.substr(0, kMaxLoggedMessage), "... (", message.size(), " bytes)");
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
  absl::StatusOr<std::string> text = checkpoint::ReadFile(path, kMaxConfigFileBytes);
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
        if (devices[0] != "auto" && devices[0] != "none") {
          s = r.Error("must be \"auto\", \"none\" or an array of devices");
        }
        if (devices[0] == "auto") devices.clear();
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
    } else if (key == "lease_seconds") {
      s = r.Number(&config->lease_seconds);
    } else if (key == "lease_expiry_limit") {
      s = r.Integer(&config->lease_expiry_limit);
    } else if (key == "shutdown_grace_seconds") {
      s = r.Number(&config->shutdown_grace_seconds);
    } else if (key == "socket") {
      s = r.String(&config->socket);
    } else if (key == "socket_group") {
      s = r.String(&config->socket_group);
    } else if (key == "access_config") {
      s = r.String(&config->access_config);
    } else if (key == "token_file") {
      s = r.String(&config->token_file);
    } else if (key == "tls_cert") {
      s = r.String(&config->tls_cert);
    } else if (key == "tls_key") {
      s = r.String(&config->tls_key);
    } else if (key == "tls_client_ca") {
      s = r.String(&config->tls_client_ca);
    } else if (key == "insecure") {
      s = r.Bool(&config->insecure);
    } else if (key == "store_retry_seconds") {
      s = r.Number(&config->store_retry_seconds);
    } else if (key == "retain_jobs") {
      s = r.Integer(&config->retain_jobs);
    } else if (key == "retain_days") {
      s = r.Number(&config->retain_days);
    } else if (key == "planning_threads") {
      s = r.Integer(&config->planning_threads);
    } else if (key == "planning_memory_bytes") {
      s = r.Integer(&config->planning_memory_bytes);
    } else if (key == "planning_deadline_seconds") {
      s = r.Number(&config->planning_deadline_seconds);
    } else if (key == "max_tasks_per_job") {
      s = r.Integer(&config->max_tasks_per_job);
    } else {
      s = r.Error("is not a known setting");
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ValidateServeConfig(const ServeConfig& config) {
  for (const std::string& address : config.listen) {
    if (address.empty()) return absl::InvalidArgumentError("listen (--listen): an empty address");
  }
  if (config.metrics_listen.empty()) {
    return absl::InvalidArgumentError("metrics_listen (--metrics-listen): empty; use none");
  }
  if (config.state_dir.empty()) {
    return absl::InvalidArgumentError("state_dir (--state-dir): empty");
  }
  if (config.devices != std::vector<std::string>{kNoDevices}) {
    for (const std::string& device : config.devices) {
      if (absl::Status s = CheckDevice(device); !s.ok()) return s;
    }
  }
  if (config.lease_seconds < 0.1 || config.lease_seconds > 3600) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_seconds (--lease-seconds): must be in [0.1, 3600], got ", config.lease_seconds));
  }
  if (config.tls_cert.empty() != config.tls_key.empty()) {
    return absl::InvalidArgumentError("tls_cert and tls_key (--tls-cert, --tls-key): give both");
  }
  if (!config.tls_client_ca.empty() && config.tls_cert.empty()) {
    return absl::InvalidArgumentError(
        "tls_client_ca (--tls-client-ca): needs --tls-cert and --tls-key");
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
  if (config.lease_expiry_limit < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_expiry_limit (--lease-expiry-limit): must be >= 1, got ",
        config.lease_expiry_limit));
  }
  if (!std::isfinite(config.shutdown_grace_seconds) || config.shutdown_grace_seconds < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shutdown_grace_seconds (--shutdown-grace-seconds): must be >= 0, got ",
                     config.shutdown_grace_seconds));
  }
  if (!std::isfinite(config.store_retry_seconds) || config.store_retry_seconds < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("store_retry_seconds (--store-retry-seconds): must be >= 1, got ",
                     config.store_retry_seconds));
  }
  if (config.planning_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "planning_threads (--planning-threads): must be >= 1, got ", config.planning_threads));
  }
  if (config.planning_memory_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("planning_memory_bytes (--planning-memory-bytes): must be >= 0, got ",
                     config.planning_memory_bytes));
  }
  if (!std::isfinite(config.planning_deadline_seconds) || config.planning_deadline_seconds < 0 ||
      config.planning_deadline_seconds > 1e9) {
    return absl::InvalidArgumentError(
        absl::StrCat("planning_deadline_seconds (--planning-deadline-seconds): must be in "
                     "[0, 1e9], got ", config.planning_deadline_seconds));
  }
  if (config.max_tasks_per_job < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tasks_per_job (--max-tasks-per-job): must be >= 1, got ", config.max_tasks_per_job));
  }
  if (config.retain_jobs < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("retain_jobs (--retain-jobs): must be >= 0, got ", config.retain_jobs));
  }
  if (!std::isfinite(config.retain_days) || config.retain_days < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("retain_days (--retain-days): must be >= 0, got ", config.retain_days));
  }
  return absl::OkStatus();
}

int ServeMain(const ServeConfig& config) {
  if (absl::Status s = ValidateServeConfig(config); !s.ok()) return Usage(s);
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(
      "quantd", std::make_shared<spdlog::sinks::stderr_color_sink_mt>()));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");

  // The main thread waits here for what ends the daemon: SIGTERM, SIGINT or SIGHUP (a closed
  // terminal), or a job store that became unusable. From now on those signals only wake it.
  boost::asio::io_context main_io;
  boost::asio::signal_set signals(main_io, SIGTERM, SIGINT, SIGHUP);
  std::string stop_cause;  // main thread: why the daemon stops
  int exit_code = 0;       // main thread
  signals.async_wait([&](const boost::system::error_code& ec, int signal_number) {
    if (!ec) stop_cause = strsignal(signal_number);
  });

  if (geteuid() == 0) {
    spdlog::warn("running as root: every admin's job reads and writes with root's rights; "
                 "deploy/systemd/quantd.service runs quantd as its own user instead");
  }
  absl::StatusOr<api::ApiServerOptions> api_options = ApiOptions(config);
  if (!api_options.ok()) return Usage(api_options.status());

  RaiseDescriptorLimit();
  absl::StatusOr<std::vector<std::string>> devices = ResolveDevices(config);
  if (!devices.ok()) return CannotStart(devices.status());
  std::error_code ec;
  if (absl::Status s = PrepareStateDir(config.state_dir, *api_options); !s.ok()) {
    return CannotStart(s);
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

  store::StoreOpenOptions store_options;
  store_options.must_exist = !config.init && HoldsOtherStateFiles(state_dir);
  store_options.check_integrity = true;
  store_options.backup_path = (state_dir / "quantd.db.bak").string();
  absl::StatusOr<std::unique_ptr<store::JobStore>> store =
      store::JobStore::Open((state_dir / "quantd.db").string(), store_options);
  if (!store.ok()) return CannotStart(store.status());
  scheduler::SchedulerOptions options;
  options.devices = *devices;
  options.cpu_threads = config.cpu_threads;
  options.queue_limit = config.queue_limit;
  options.lease_expiry_limit = config.lease_expiry_limit;
  options.lease_ms = static_cast<int64_t>(config.lease_seconds * 1000);
  options.host_memory_bytes = config.host_memory_bytes;
  options.planning.threads = config.planning_threads;
  options.planning.memory_bytes = config.planning_memory_bytes;
  options.planning.deadline_ms =
      static_cast<int64_t>(std::llround(config.planning_deadline_seconds * 1000));
  options.max_tasks_per_job = config.max_tasks_per_job;
  // Kernels saturate the cores; a little lower priority keeps the API responsive under load.
  options.worker_nice = 5;
  options.store_retry_limit_ms =
      static_cast<int64_t>(std::llround(config.store_retry_seconds * 1000));
  options.metrics = metrics.get();
  options.log = [](int64_t job_id, const std::string& kind, const std::string& message) {
    spdlog::info("job {} {}: {}", job_id, kind, ForLog(message));
  };
  // A supervisor restarts a daemon that exits non-zero; a daemon without its store cannot work.
  options.on_store_unusable = [&](const absl::Status& error) {
    boost::asio::post(main_io, [&, message = std::string(error.message())] {
      stop_cause = message;
      exit_code = kStoreUnusable;
      signals.cancel();
    });
  };
  absl::StatusOr<std::unique_ptr<scheduler::Scheduler>> scheduler =
      scheduler::Scheduler::Start(*std::move(store), std::move(options));
  if (!scheduler.ok()) return CannotStart(scheduler.status());

  absl::StatusOr<std::unique_ptr<api::ApiServer>> server =
      api::ApiServer::Start(*std::move(api_options), scheduler->get(), metrics.get());
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
  if (absl::Status written = WriteServeJson(serve_json, ready.dump() + "\n"); !written.ok()) {
    (*server)->Shutdown(std::chrono::milliseconds(0));
    (*scheduler)->Shutdown(std::chrono::milliseconds(0));
    return CannotStart(written);
  }
  spdlog::info("quantd {} serving on {} (metrics: {}); {}", QUANTD_VERSION,
               absl::StrJoin((*server)->bound_addresses(), ", "),
               metrics->listen_address().empty() ? "none" : metrics->listen_address(),
               Describe(config, *devices));
  Notify("READY=1");
  std::unique_ptr<ops::ServeMonitor> monitor = StartMonitor(config, **scheduler, metrics.get());

  std::unique_ptr<api::HistoryPruner> pruner;
  const api::RetentionPolicy retention{config.retain_jobs, config.retain_days};
  if (retention.enabled()) {
    pruner = api::HistoryPruner::Start(scheduler->get(), retention, kPrunePeriod,
                                       [](const std::string& m) { spdlog::info("{}", m); });
  }

  main_io.run();
  Notify("STOPPING=1");
  monitor->Stop();
  pruner.reset();
  const auto grace = std::chrono::milliseconds(
      static_cast<int64_t>(std::llround(config.shutdown_grace_seconds * 1000)));
  if (exit_code != 0) {
    spdlog::error("{}: health is NOT_SERVING; exiting with code {} for a restart", stop_cause,
                  exit_code);
  } else {
    spdlog::info("{}: shutting down (grace {} s)", stop_cause, config.shutdown_grace_seconds);
  }
  (*server)->Shutdown(std::min(grace, kRpcDrain));
  (*scheduler)->Shutdown(grace);
  std::filesystem::remove(serve_json, ec);
  if (const int abandoned = (*scheduler)->abandoned_planning(); abandoned > 0) {
    // Their threads may still use what the static destructors of a normal exit destroy.
    spdlog::warn("{} job planning(s) did not stop within the grace period; they resume when "
                 "quantd starts again", abandoned);
    spdlog::info("stopped");
    spdlog::shutdown();
    _exit(exit_code);
  }
  spdlog::info("stopped");
  return exit_code;
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
      cmd->add_option("--listen", f.listen,
                      "more gRPC addresses besides --socket, repeatable (HOST:PORT, unix:PATH; "
                      "none: no more)")
          ->capture_default_str();
  CLI::Option* metrics_listen =
      cmd->add_option("--metrics-listen", f.metrics_listen, "Prometheus address, or none")
          ->capture_default_str();
  CLI::Option* state_dir =
      cmd->add_option("--state-dir", f.state_dir,
                      "holds quantd.db, quantd.lock, serve.json, quantd.sock")
          ->capture_default_str();
  CLI::Option* devices =
      cmd->add_option("--devices", parsed->devices,
                      "auto, none (remote workers only), or a list such as cpu,cuda:0")
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
  CLI::Option* lease_seconds =
      cmd->add_option("--lease-seconds", f.lease_seconds,
                      "how long a task (local or remote) may report nothing before it loses its "
                      "lease")
          ->capture_default_str();
  CLI::Option* lease_expiry_limit =
      cmd->add_option("--lease-expiry-limit", f.lease_expiry_limit,
                      "leases a silent task may lose before its job fails")
          ->capture_default_str();
  CLI::Option* grace = cmd->add_option("--shutdown-grace-seconds", f.shutdown_grace_seconds,
                                       "how long running tasks get to stop at SIGTERM")
                           ->capture_default_str();
  CLI::Option* socket =
      cmd->add_option("--socket", f.socket, "unix socket (default: STATE_DIR/quantd.sock)");
  CLI::Option* socket_group =
      cmd->add_option("--socket-group", f.socket_group, "group (name or gid) of the unix socket");
  CLI::Option* access_config = cmd->add_option(
      "--access-config", f.access_config, "JSON file: callers by uid/token/certificate, roles, "
                                          "allowed roots (README \"Security model\")");
  CLI::Option* token_file =
      cmd->add_option("--token-file", f.token_file, "file with the admin token for TCP callers");
  CLI::Option* tls_cert =
      cmd->add_option("--tls-cert", f.tls_cert, "PEM certificate chain: TLS on the TCP addresses");
  CLI::Option* tls_key = cmd->add_option("--tls-key", f.tls_key, "PEM private key of --tls-cert");
  CLI::Option* tls_client_ca = cmd->add_option(
      "--tls-client-ca", f.tls_client_ca, "PEM CA: TCP clients must present a certificate it signed");
  CLI::Option* insecure = cmd->add_flag(
      "--insecure", f.insecure, "allow a non-loopback --listen address without TLS");
  CLI::Option* store_retry =
      cmd->add_option("--store-retry-seconds", f.store_retry_seconds,
                      "how long a failing job store is retried before the daemon exits 3")
          ->capture_default_str();
  cmd->footer(
      "Exit codes: 0 clean shutdown (SIGTERM, SIGINT, SIGHUP), 1 could not start, 2 usage or "
      "config error, 3 the job store became unusable.");
  cmd->add_flag("--init", f.init,
                "create quantd.db even though the state dir holds other files (a lost database)");
  CLI::Option* retain_jobs =
      cmd->add_option("--retain-jobs", f.retain_jobs, "finished jobs kept at most (0 = all)")
          ->capture_default_str();
  CLI::Option* retain_days =
      cmd->add_option("--retain-days", f.retain_days, "prune finished jobs after D days (0 = never)")
          ->capture_default_str();
  CLI::Option* planning_threads =
      cmd->add_option("--planning-threads", f.planning_threads, "jobs planned at once")
          ->capture_default_str();
  CLI::Option* planning_memory =
      cmd->add_option("--planning-memory-bytes", f.planning_memory_bytes,
                      "memory one job's planning may hold (0 = no limit)")
          ->capture_default_str();
  CLI::Option* planning_deadline =
      cmd->add_option("--planning-deadline-seconds", f.planning_deadline_seconds,
                      "how long one job's planning may take (0 = no limit)")
          ->capture_default_str();
  CLI::Option* max_tasks = cmd->add_option("--max-tasks-per-job", f.max_tasks_per_job,
                                           "tasks one job's plan may hold")
                               ->capture_default_str();
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
    if (lease_seconds->count() > 0) config.lease_seconds = given.lease_seconds;
    if (lease_expiry_limit->count() > 0) config.lease_expiry_limit = given.lease_expiry_limit;
    if (grace->count() > 0) config.shutdown_grace_seconds = given.shutdown_grace_seconds;
    if (socket->count() > 0) config.socket = given.socket;
    if (socket_group->count() > 0) config.socket_group = given.socket_group;
    if (access_config->count() > 0) config.access_config = given.access_config;
    if (token_file->count() > 0) config.token_file = given.token_file;
    if (tls_cert->count() > 0) config.tls_cert = given.tls_cert;
    if (tls_key->count() > 0) config.tls_key = given.tls_key;
    if (tls_client_ca->count() > 0) config.tls_client_ca = given.tls_client_ca;
    if (insecure->count() > 0) config.insecure = given.insecure;
    if (store_retry->count() > 0) config.store_retry_seconds = given.store_retry_seconds;
    config.init = given.init;
    if (retain_jobs->count() > 0) config.retain_jobs = given.retain_jobs;
    if (retain_days->count() > 0) config.retain_days = given.retain_days;
    if (planning_threads->count() > 0) config.planning_threads = given.planning_threads;
    if (planning_memory->count() > 0) {
      config.planning_memory_bytes = given.planning_memory_bytes;
    }
    if (planning_deadline->count() > 0) {
      config.planning_deadline_seconds = given.planning_deadline_seconds;
    }
    if (max_tasks->count() > 0) config.max_tasks_per_job = given.max_tasks_per_job;
    rc = ServeMain(config);
  });
}

}  // namespace quantd
