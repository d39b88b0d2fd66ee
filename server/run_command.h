// `quantd run --state FILE [--workers N] [--device cpu|cuda:N|auto] [--threads N] SPEC.json`:
// runs one conversion job (scheduler/run_job.h) against a SQLite state file. Running the same
// command again after a crash, a kill or Ctrl-C continues where the job stopped.
//
// Exit codes: 0 the job SUCCEEDED (now or earlier), 1 it failed (the message names the shard and
// tensor; fix the input and run the same command again to continue), 2 usage (bad options, an
// unreadable or invalid spec file), 130 interrupted by SIGINT/SIGTERM (the job is PAUSED; a second
// signal exits at once, which is as safe as a crash).
#ifndef QUANTD_SERVER_RUN_COMMAND_H_
#define QUANTD_SERVER_RUN_COMMAND_H_

#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace quantd {

struct RunArgs {
  std::string state_path;  // --state
  std::string spec_path;   // SPEC.json
  int workers = 2;         // --workers: tasks in flight
  std::string device;      // --device: "" = the spec's devices
  int threads = 0;         // --threads: per CPU kernel call, 0 = all cores
};

// Runs the job; returns the exit code.
int RunMain(const RunArgs& args);

// Registers the `run` subcommand; its callback stores RunMain's exit code in `rc`.
void AddRunCommand(CLI::App& app, int& rc);

}  // namespace quantd

#endif  // QUANTD_SERVER_RUN_COMMAND_H_
