// The QUANTD_TEST_KILL_AT test hook (documented in run_job.h): where the process kills itself, so
// that integration tests can stop it at an exact point of a task.
#ifndef QUANTD_SERVER_SCHEDULER_KILL_HOOK_H_
#define QUANTD_SERVER_SCHEDULER_KILL_HOOK_H_

#include <stdint.h>

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace quantd::scheduler {

struct KillHook {
  enum class When { kStart, kMid, kWritten, kDone };
  std::string stage;          // the stage kind whose task it counts
  int64_t n = 0;              // the n-th task of that stage this process starts, from 1
  When when = When::kStart;   // where in that task
};

// "<stage>:<n>[:start|:mid|:written|:done]"; nullopt for nullptr or "". InvalidArgument otherwise.
absl::StatusOr<std::optional<KillHook>> ParseKillHook(const char* value);

// SIGKILL to this process; does not return.
[[noreturn]] void KillSelf();

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_KILL_HOOK_H_
