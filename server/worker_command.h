// `quantd worker --coordinator ADDR [--token-file F | --tls-ca/--tls-cert/--tls-key]
// [--devices LIST] [--name N] [--exit-when-idle SECONDS] [--cpu-threads N]`: a remote worker of a
// daemon (README "Remote workers"). It connects as quantctl does (api/client_channel.h), registers
// its devices with their memory (quantd.v1.WorkerService), and then, one thread per device, leases
// tasks that fit the device, opens each task's job from its stored spec
// (pipeline::PreparedJob::OpenForWorker, once per job), runs the task with the same Stage code as
// a local worker, renews the lease while the task reports progress (its heartbeat: a silent task
// loses its lease, as a local one does) and completes it with what the stage produced, or fails it
// with the stage's error. A job it cannot open (the source unreadable, the output not the
// coordinator's) fails the task with Unavailable naming the cause, so another worker retries it.
// A coordinator that forgot the worker (it restarted) is registered with again.
//
// Exit codes: 0 stopped by SIGINT/SIGTERM, or idle for --exit-when-idle seconds; 1 could not
// start or the coordinator refused its credentials; 2 usage.
//
// Test hooks (integration tests): QUANTD_TEST_KILL_AT (scheduler/run_job.h's grammar, counted over
// the tasks this worker starts) sends SIGKILL to the worker at that point of a task;
// QUANTD_TEST_STOP_AT, with the same grammar, sends it SIGSTOP there instead (a worker frozen past
// its lease).
#ifndef QUANTD_SERVER_WORKER_COMMAND_H_
#define QUANTD_SERVER_WORKER_COMMAND_H_

#include <string>
#include <vector>

#include "server/api/client_channel.h"

namespace CLI {
class App;
}  // namespace CLI

namespace quantd {

struct WorkerArgs {
  api::ClientOptions connect;        // --coordinator and the credentials
  std::vector<std::string> devices;  // --devices: cpu, cuda:N; default cpu
  std::string name;                  // --name; default <hostname>-<pid>
  double exit_when_idle_s = 0;       // --exit-when-idle: 0 = never
  int cpu_threads = 0;               // --cpu-threads: per CPU kernel call, 0 = all cores
};

// Runs the worker; returns the exit code.
int WorkerMain(const WorkerArgs& args);

// Registers the `worker` subcommand; its callback stores WorkerMain's exit code in `rc`.
void AddWorkerCommand(CLI::App& app, int& rc);

}  // namespace quantd

#endif  // QUANTD_SERVER_WORKER_COMMAND_H_
