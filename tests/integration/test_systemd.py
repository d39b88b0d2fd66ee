"""systemd integration (issue 14 §1): deploy/systemd/quantd.service passes `systemd-analyze
verify` (and its offline security review), and `quantd serve` speaks the Type=notify protocol to a
notify socket of the test's own, as systemd would listen: READY=1 once it serves (serve.json is
there by then), WATCHDOG=1 repeatedly under WATCHDOG_USEC, STOPPING=1 at SIGTERM and no ping after
it; every datagram carries the daemon's pid (NotifyAccess=main accepts it).

systemd need not be PID 1: `systemd-analyze verify` loads unit files on its own.
"""

import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from daemon import Daemon

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "quantd.service"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
WATCHDOG_USEC = 2_000_000  # the daemon pings every second (half the interval)


def unit_for_binary(tmp_path, binary):
    """The unit with ExecStart's binary replaced by the one under test (verify checks it exists)."""
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/quantd serve " in text
    unit = tmp_path / "quantd.service"
    unit.write_text(text.replace("ExecStart=/usr/local/bin/quantd ", f"ExecStart={binary} "))
    return unit


def run_analyze(*args):
    env = dict(os.environ, SYSTEMD_LOG_TARGET="console", SYSTEMD_LOG_COLOR="0")
    return subprocess.run([SYSTEMD_ANALYZE, *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_unit_passes_systemd_analyze_verify(qd, tmp_path):
    assert Path(SYSTEMD_ANALYZE).is_file(), "systemd-analyze is missing: apt-get install systemd"
    unit = unit_for_binary(tmp_path, qd.binary)
    proc = run_analyze("verify", str(unit))
    # verify prints one line per problem (unknown key, bad value, missing binary).
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", (
        proc.returncode, proc.stdout, proc.stderr)


def test_verify_reports_a_broken_unit(qd, tmp_path):
    """The check above can fail: a typo in a key and a missing binary are reported."""
    unit = unit_for_binary(tmp_path, tmp_path / "no-such-quantd")
    unit.write_text(unit.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilege=yes"))
    proc = run_analyze("verify", str(unit))
    output = proc.stdout + proc.stderr
    assert "Unknown key 'NoNewPrivilege'" in output, output
    assert "no-such-quantd" in output and proc.returncode != 0, (proc.returncode, output)


def test_unit_security_exposure_is_low(qd, tmp_path):
    unit = unit_for_binary(tmp_path, qd.binary)
    # --threshold: fail above this exposure (0 = locked down .. 100 = unprotected).
    proc = run_analyze("security", "--offline=true", "--threshold=40", "--no-pager", str(unit))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)


def test_unit_settings(tmp_path):
    """The settings the Deployment section promises, each present once as written."""
    lines = [line.strip() for line in UNIT.read_text().splitlines()]
    for setting in ("Type=notify", "NotifyAccess=main", "User=quantd", "StateDirectory=quantd",
                    "RuntimeDirectory=quantd", "Restart=on-failure", "NoNewPrivileges=yes",
                    "PrivateTmp=yes", "ProtectSystem=strict", "ReadWritePaths=/srv/models",
                    "DevicePolicy=closed", "DeviceAllow=char-nvidia-frontend rw",
                    "DeviceAllow=char-nvidia-uvm rw"):
        assert lines.count(setting) == 1, setting
    assert any(line.startswith("WatchdogSec=") for line in lines)
    assert any(line.startswith("LimitNOFILE=") for line in lines)
    # The config the unit names listens where RuntimeDirectory= puts the socket.
    config = (REPO / "deploy" / "systemd" / "serve.json").read_text()
    assert '"unix:/run/quantd/quantd.sock"' in config and '"/var/lib/quantd"' in config


class NotifySocket:
    """A unix datagram socket as systemd's notify socket: each message with its sender's pid."""

    def __init__(self):
        # A short directory: unix socket paths are limited to 107 bytes.
        self.dir = tempfile.mkdtemp(prefix="qn", dir="/tmp")
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)

    def receive(self, timeout):
        """(message, sender pid), or None after `timeout` seconds."""
        self.sock.settimeout(timeout)
        try:
            data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except socket.timeout:
            return None
        pid = None
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _, _ = struct.unpack("iII", payload[:12])
        return data.decode(), pid

    def close(self):
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def notify_socket():
    s = NotifySocket()
    yield s
    s.close()


def test_serve_notifies_ready_watchdog_and_stopping(qd, tmp_path, notify_socket):
    daemon = Daemon(qd.binary, tmp_path / "state",
                    env={"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    with daemon:
        first = notify_socket.receive(timeout=60)
        assert first == ("READY=1", daemon.pid), (first, daemon.log())
        assert daemon.ready_file.exists()  # READY comes after serve.json
        pings = []
        deadline = time.monotonic() + 30
        while len(pings) < 3 and time.monotonic() < deadline:
            message = notify_socket.receive(timeout=5)
            assert message is not None, (pings, daemon.log())
            pings.append(message)
        assert pings == [("WATCHDOG=1", daemon.pid)] * 3, (pings, daemon.log())
        daemon.stop()
        rest = []
        while (message := notify_socket.receive(timeout=0.5)) is not None:
            rest.append(message[0])
        # Pings already in flight at SIGTERM may come before it; none after it.
        assert "STOPPING=1" in rest, (rest, daemon.log())
        after = rest[rest.index("STOPPING=1") + 1:]
        assert after == [], (rest, daemon.log())
        assert set(rest) <= {"WATCHDOG=1", "STOPPING=1"}, rest


def test_serve_without_watchdog_sends_ready_and_stopping_only(qd, tmp_path, notify_socket):
    daemon = Daemon(qd.binary, tmp_path / "state", env={"NOTIFY_SOCKET": notify_socket.path})
    with daemon:
        assert notify_socket.receive(timeout=60) == ("READY=1", daemon.pid), daemon.log()
        assert notify_socket.receive(timeout=3) is None, daemon.log()  # no WATCHDOG_USEC
        daemon.stop()
        assert notify_socket.receive(timeout=5) == ("STOPPING=1", daemon.pid), daemon.log()
