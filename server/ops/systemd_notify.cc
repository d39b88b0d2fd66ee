#include "server/ops/systemd_notify.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>

#include "absl/strings/str_cat.h"

namespace quantd::ops {

absl::Status SystemdNotify(const std::string& state) {
  // unset_environment = 0: every later notification goes to the same socket.
  const int rc = sd_notify(0, state.c_str());
  if (rc >= 0) return absl::OkStatus();  // 0: no $NOTIFY_SOCKET, nothing to do
  const char* socket = getenv("NOTIFY_SOCKET");
  return absl::UnavailableError(absl::StrCat("sd_notify to $NOTIFY_SOCKET ",
                                             socket == nullptr ? "" : socket, " failed: ",
                                             strerror(-rc)));
}

std::optional<std::chrono::microseconds> SystemdWatchdogInterval() {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) return std::nullopt;
  return std::chrono::microseconds(usec);
}

}  // namespace quantd::ops
