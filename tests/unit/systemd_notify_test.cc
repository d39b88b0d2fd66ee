// SystemdNotify and SystemdWatchdogInterval against a notify socket of the test's own (what
// systemd listens on for a Type=notify service): the exact datagrams, nothing without
// $NOTIFY_SOCKET, an error naming a socket nobody listens on, and the watchdog environment.
#include "server/ops/systemd_notify.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace quantd::ops {
namespace {

// A unix datagram socket bound at a fresh path, as the service manager's.
class NotifySocket {
 public:
  NotifySocket() {
    path_ = absl::StrCat("/tmp/quantd-notify-test-", getpid(), ".sock");
    unlink(path_.c_str());
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    path_.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << path_;
    timeval timeout{.tv_sec = 5, .tv_usec = 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  }
  ~NotifySocket() {
    close(fd_);
    unlink(path_.c_str());
  }

  const std::string& path() const { return path_; }

  // The next datagram; "" after the 5 s receive timeout.
  std::string Receive() {
    char buf[4096];
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    return n < 0 ? "" : std::string(buf, n);
  }

  // A datagram already queued, without waiting; "" when none.
  std::string Pending() {
    char buf[4096];
    const ssize_t n = recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
    return n < 0 ? "" : std::string(buf, n);
  }

 private:
  std::string path_;  // where the socket is bound
  int fd_ = -1;       // the bound socket
};

class SystemdNotifyTest : public testing::Test {
 protected:
  void TearDown() override {
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
  }
};

TEST_F(SystemdNotifyTest, SendsEachStateAsOneDatagram) {
  NotifySocket socket;
  setenv("NOTIFY_SOCKET", socket.path().c_str(), 1);
  ASSERT_TRUE(SystemdNotify("READY=1").ok());
  EXPECT_EQ(socket.Receive(), "READY=1");
  ASSERT_TRUE(SystemdNotify("WATCHDOG=1").ok());
  ASSERT_TRUE(SystemdNotify("STOPPING=1").ok());
  EXPECT_EQ(socket.Receive(), "WATCHDOG=1");
  EXPECT_EQ(socket.Receive(), "STOPPING=1");
  // The environment stays, so later notifications reach the same socket.
  EXPECT_STREQ(getenv("NOTIFY_SOCKET"), socket.path().c_str());
}

TEST_F(SystemdNotifyTest, WithoutNotifySocketNothingIsSentAndNothingFails) {
  NotifySocket socket;
  unsetenv("NOTIFY_SOCKET");
  EXPECT_TRUE(SystemdNotify("READY=1").ok());
  EXPECT_EQ(socket.Pending(), "");
}

TEST_F(SystemdNotifyTest, UnreachableSocketIsUnavailableNamingIt) {
  const std::string path = absl::StrCat("/tmp/quantd-notify-test-absent-", getpid(), ".sock");
  setenv("NOTIFY_SOCKET", path.c_str(), 1);
  const absl::Status s = SystemdNotify("READY=1");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find(path), std::string::npos) << s;
}

TEST_F(SystemdNotifyTest, WatchdogIntervalComesFromTheEnvironmentForThisProcess) {
  EXPECT_EQ(SystemdWatchdogInterval(), std::nullopt);
  setenv("WATCHDOG_USEC", "2500000", 1);
  EXPECT_EQ(SystemdWatchdogInterval(), std::chrono::microseconds(2'500'000));
  setenv("WATCHDOG_PID", std::to_string(getpid()).c_str(), 1);
  EXPECT_EQ(SystemdWatchdogInterval(), std::chrono::microseconds(2'500'000));
  // Meant for another process (a child that inherited the environment): off.
  setenv("WATCHDOG_PID", std::to_string(getpid() + 1).c_str(), 1);
  EXPECT_EQ(SystemdWatchdogInterval(), std::nullopt);
}

}  // namespace
}  // namespace quantd::ops
