// `quantd serve`: the job daemon. A gRPC API (api/server.h) over a scheduler (scheduler/
// scheduler.h) that runs jobs from the SQLite database <state-dir>/quantd.db on one worker per
// device, with Prometheus metrics on their own address.
//
//   quantd serve [--config FILE] [--listen ADDR]... [--metrics-listen ADDR] [--state-dir DIR]
//                [--devices auto|LIST] [--cpu-workers N] [--cpu-threads N]
//                [--host-memory-bytes N] [--queue-limit N] [--shutdown-grace-seconds S]
//                [--socket PATH] [--socket-group GROUP] [--access-config FILE] [--token-file FILE]
//                [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--insecure]
//                [--store-retry-seconds S]
//                [--init] [--retain-jobs N] [--retain-days D]
//
// At start: RLIMIT_NOFILE is raised to its hard limit (idle connections must not exhaust the
// descriptors); quantd.db gets PRAGMA quick_check and, when that passes, a copy in
// quantd.db.bak: a damaged database stops the start naming the file and the backup. A missing or
// 0-byte quantd.db next to other state files is an error unless --init (a lost database must
// not silently become an empty history).
//
// --config FILE is a JSON object with the same settings in snake_case (listen: a string or an
// array); flags override it. The daemon always listens on the unix socket --socket (default
// <state-dir>/quantd.sock, mode 0660, group --socket-group), and on the --listen addresses too
// ("none" adds none, overriding a config file's list):
// TCP ones need a token (--token-file, --access-config) or TLS client certificates
// (--tls-client-ca), and a non-loopback one needs TLS unless --insecure (README "Security model",
// api/access_policy.h for the access config). Once serving, <state-dir>/serve.json holds
// {"pid": N, "listen": ["unix:/abs/socket", bound --listen addresses...], "metrics_listen":
// "host:port" or ""}; it is removed on a clean exit. <state-dir>/quantd.lock (flock) keeps a second daemon off the same state dir.
// SIGTERM/SIGINT/SIGHUP: stop accepting RPCs, give running tasks the shutdown grace to stop, exit
// 0; jobs that were RUNNING resume by themselves at the next start. A job store that refuses every
// write for --store-retry-seconds (a held lock, a full file system) turns health NOT_SERVING and
// ends the daemon with exit code 3, for its supervisor to restart it. Worker threads (and the kernel threads
// they start) run at nice +5, so RPCs are answered promptly while the kernels saturate the cores.
// Under systemd (Type=notify, deploy/systemd/quantd.service) it sends READY=1 once serving,
// STOPPING=1 at SIGTERM and, with WatchdogSec=, WATCHDOG=1 while the scheduler ticks
// (ops/serve_monitor.h, which also samples the free disk space of the state and output dirs).
//
// Exit codes: 0 clean shutdown; 1 could not start (address in use, state dir unusable, database
// newer than this binary, another daemon holds the state dir); 2 usage or config error; 3 the job
// store became unusable.
#ifndef QUANTD_SERVER_SERVE_COMMAND_H_
#define QUANTD_SERVER_SERVE_COMMAND_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/api/default_socket.h"

namespace CLI {
class App;
}  // namespace CLI

namespace quantd {

struct ServeConfig {
  std::vector<std::string> listen;                // gRPC addresses besides the socket; "unix:" too
  std::string metrics_listen = "127.0.0.1:9464";  // "none": no metrics endpoint
  std::string state_dir = api::kDefaultStateDir;
  std::vector<std::string> devices;  // "cpu" / "cuda:N" entries; empty = auto; {"none"}: no
                                     // local worker (remote workers run every task)
  int cpu_workers = 2;               // CPU workers when auto finds no CUDA device
  int cpu_threads = 0;               // threads per CPU kernel call; 0 = all cores
  int64_t host_memory_bytes = 0;     // host-memory budget; 0 = none
  int queue_limit = 64;              // PENDING jobs at most
  double lease_seconds = 60;         // a task silent this long loses its lease
  int lease_expiry_limit = 3;        // leases a silent task may lose before its job fails
  double shutdown_grace_seconds = 30;
  std::string socket;         // the unix socket; empty: <state_dir>/quantd.sock
  std::string socket_group;   // group of the unix sockets; empty: the daemon's
  std::string access_config;  // JSON file of callers, roles and allowed roots; empty: none
  std::string token_file;     // the admin token for TCP callers; empty: none
  std::string tls_cert;       // PEM certificate chain for the TCP addresses; empty: no TLS
  std::string tls_key;        // its PEM private key
  std::string tls_client_ca;  // PEM CA that TCP clients' certificates must be signed by
  bool insecure = false;      // allow a non-loopback TCP address without TLS
  double store_retry_seconds = 60;  // a store failing this long is unusable: exit 3
  bool init = false;        // a missing or empty quantd.db next to other state files is created
  int64_t retain_jobs = 0;  // finished jobs kept at most (api/history_pruner.h); 0 = all
  double retain_days = 0;   // finished jobs pruned after this many days; 0 = never
  // A job's planning (scheduler/planning_pool.h): jobs planned at once, the memory and time one
  // may take (0 = no limit), and the tasks its plan may hold.
  int planning_threads = 2;
  int64_t planning_memory_bytes = int64_t{8} << 30;
  double planning_deadline_seconds = 7200;
  int64_t max_tasks_per_job = 100'000;
};

// Applies the settings of the JSON config file at `path` to `config`. InvalidArgument naming the
// file and the key for unknown keys and wrong types; an unreadable file names the path.
absl::Status ApplyServeConfigFile(const std::string& path, ServeConfig* config);
// Range checks of the merged settings; InvalidArgument naming the setting.
absl::Status ValidateServeConfig(const ServeConfig& config);

// Runs the daemon until SIGTERM/SIGINT/SIGHUP or an unusable store; returns the exit code.
int ServeMain(const ServeConfig& config);

// Registers the `serve` subcommand; its callback stores the exit code in `rc`.
void AddServeCommand(CLI::App& app, int& rc);

}  // namespace quantd

#endif  // QUANTD_SERVER_SERVE_COMMAND_H_
