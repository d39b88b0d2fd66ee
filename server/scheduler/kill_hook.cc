#include "server/scheduler/kill_hook.h"

#include <signal.h>
#include <unistd.h>

#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace quantd::scheduler {

absl::StatusOr<std::optional<KillHook>> ParseKillHook(const char* value) {
  if (value == nullptr || *value == '\0') return std::optional<KillHook>();
  const std::vector<std::string> parts = absl::StrSplit(value, ':');
  KillHook hook;
  bool ok = (parts.size() == 2 || parts.size() == 3) && !parts[0].empty() &&
            absl::SimpleAtoi(parts[1], &hook.n) && hook.n >= 1;
  hook.stage = ok ? parts[0] : "";
  if (ok && parts.size() == 3) {
    static const std::map<std::string, KillHook::When> kWhen = {
        {"start", KillHook::When::kStart},
        {"mid", KillHook::When::kMid},
        {"written", KillHook::When::kWritten},
        {"done", KillHook::When::kDone}};
    auto it = kWhen.find(parts[2]);
    ok = it != kWhen.end();
    if (ok) hook.when = it->second;
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("QUANTD_TEST_KILL_AT=", value,
                     ": expected <stage>:<n>[:start|:mid|:written|:done] with n >= 1"));
  }
  return std::optional<KillHook>(hook);
}

void KillSelf() {
  kill(getpid(), SIGKILL);
  for (;;) pause();
}

}  // namespace quantd::scheduler
