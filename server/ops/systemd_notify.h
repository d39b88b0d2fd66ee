// The service manager's notification protocol (sd_notify(3)) for `quantd serve` as a systemd
// Type=notify service (deploy/systemd/quantd.service): "READY=1" once the daemon serves,
// "STOPPING=1" when SIGTERM arrives, "WATCHDOG=1" while the scheduler is alive (WatchdogSec=).
// Outside systemd ($NOTIFY_SOCKET unset) nothing is sent and nothing fails.
#ifndef QUANTD_SERVER_OPS_SYSTEMD_NOTIFY_H_
#define QUANTD_SERVER_OPS_SYSTEMD_NOTIFY_H_

#include <chrono>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace quantd::ops {

// Sends `state` (newline-separated assignments such as "READY=1\nSTATUS=serving") to
// $NOTIFY_SOCKET. OK when sent or when there is no socket; Unavailable naming the socket when the
// send failed.
absl::Status SystemdNotify(const std::string& state);

// The interval within which the service manager expects "WATCHDOG=1" from this process
// ($WATCHDOG_USEC, when $WATCHDOG_PID is unset or this process), nullopt when the watchdog is off.
std::optional<std::chrono::microseconds> SystemdWatchdogInterval();

}  // namespace quantd::ops

#endif  // QUANTD_SERVER_OPS_SYSTEMD_NOTIFY_H_
