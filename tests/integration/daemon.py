"""Helpers of the daemon tests (test_daemon.py): a `quantd serve` process, and the Python gRPC
stubs generated from our proto with grpc_tools.protoc.

The daemon listens on its unix socket (<state-dir>/quantd.sock, or a short path of its own when
that one would be too long for a socket address) and, when the extra arguments ask for it, on
TCP addresses too. It writes <state-dir>/serve.json (atomically) once it is ready:
{"pid": N, "listen": ["unix:/abs/socket", other addresses...], "metrics_listen": ""}. The tests run
as root, which the daemon knows on its socket as an admin. Its stdout and stderr go to a log file
next to the state dir, shown in every assertion message about the process.
"""

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "proto"
READY_TIMEOUT_S = 60  # start to serve.json: opening the database, requeueing, resuming jobs
STOP_TIMEOUT_S = 30   # SIGTERM to exit: the default --shutdown-grace-seconds
MAX_SOCKET_PATH = 100  # bytes; a unix socket address holds 107 (and quantd binds a ".new" first)


class Daemon:
    """One `quantd serve --devices cpu` (one CPU worker; `devices` says otherwise, "none" for a
    coordinator of remote workers) on a state dir; start() may run again after the process ended,
    on the same state dir."""

    def __init__(self, binary, state_dir, *extra, env=None, socket_path=None, devices="cpu",
                 metrics_listen="none"):
        self.binary = str(binary)
        self.devices = devices
        self.metrics_listen = metrics_listen  # "127.0.0.1:0": info["metrics_listen"] has the port
        self.state_dir = Path(state_dir)
        self.extra = [str(a) for a in extra]
        self.env = dict(env or {})  # e.g. {"QUANTD_TEST_KILL_AT": "quantize:2:mid"}
        self.proc = None            # the running (or last) process
        self.info = None            # serve.json of the running process
        self.starts = 0             # processes started so far (names the log files)
        self.channels = []          # channels opened on the running process, closed when it ends
        self.terminated_at = None   # monotonic time of the SIGTERM to the running process
        # The daemon's unix socket: `socket_path`, else in the state dir if that path is short.
        self.socket_path = Path(socket_path or self.state_dir / "quantd.sock")
        self.socket_dir = None  # a short directory made for the socket, removed by close()
        if len(str(self.socket_path.resolve())) > MAX_SOCKET_PATH:
            self.socket_dir = Path(tempfile.mkdtemp(prefix="qd"))
            self.socket_path = self.socket_dir / "quantd.sock"

    def cmd(self):
        # No address but the socket unless the extra arguments name some: a --config file's
        # addresses are overridden.
        listen = [] if "--listen" in self.extra else ["--listen", "none"]
        return [self.binary, "serve", "--state-dir", str(self.state_dir),
                "--socket", str(self.socket_path), *listen, "--metrics-listen", self.metrics_listen,
                "--devices", self.devices, *self.extra]

    @property
    def ready_file(self):
        return self.state_dir / "serve.json"

    @property
    def address(self):
        """The unix socket, "unix:/abs/path": callers there are known by their uid."""
        return self.info["listen"][0]

    @property
    def tcp_address(self):
        """The first TCP address ("127.0.0.1:PORT"), None without one (extra --listen)."""
        return next((a for a in self.info["listen"] if not a.startswith("unix:")), None)

    @property
    def pid(self):
        return self.proc.pid

    def start(self, timeout=READY_TIMEOUT_S):
        assert self.proc is None or self.proc.poll() is not None, "the daemon is still running"
        self.state_dir.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_dir is not None:
            self.socket_dir.mkdir(exist_ok=True)  # again after close()
        self.ready_file.unlink(missing_ok=True)  # left behind by a killed daemon
        env = dict(os.environ)
        env.pop("QUANTD_TEST_KILL_AT", None)
        env.update(self.env)
        self.starts += 1
        self.log_path = self.state_dir.with_name(f"{self.state_dir.name}.serve{self.starts}.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env)
        self.info = None
        self.terminated_at = None
        deadline = time.monotonic() + timeout
        while True:
            if self.ready_file.exists():
                info = json.loads(self.ready_file.read_text())
                if info.get("pid") == self.proc.pid:
                    break
            rc = self.proc.poll()
            assert rc is None, f"quantd serve exited {rc} before it was ready\n{self.log()}"
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"no {self.ready_file} after {timeout} s\n{self.log()}")
            time.sleep(0.05)
        assert set(info) >= {"pid", "listen", "metrics_listen"}, info
        assert info["listen"] and all(not a.endswith(":0") for a in info["listen"]), info
        self.info = info
        return self

    def channel(self, timeout=10):
        """A channel to the daemon, connected."""
        channel = grpc.insecure_channel(self.address)
        grpc.channel_ready_future(channel).result(timeout=timeout)
        self.channels.append(channel)
        return channel

    def wait(self, timeout):
        """The exit status once the process ended by itself (a test hook killed it)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"quantd serve still running after {timeout} s\n{self.log()}")
        self._ended()
        return rc

    def terminate(self):
        """SIGTERM, without waiting; stop() waits."""
        self.terminated_at = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout=STOP_TIMEOUT_S):
        """SIGTERM (unless terminate() sent it); asserts exit status 0 within `timeout` of the
        signal; returns the seconds it took."""
        if self.terminated_at is None:
            self.terminate()
        rc = self.wait(max(0.0, self.terminated_at + timeout - time.monotonic()))
        assert rc == 0, f"quantd serve exited {rc} on SIGTERM\n{self.log()}"
        return time.monotonic() - self.terminated_at

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        rc = self.wait(10)
        assert rc == -signal.SIGKILL, (rc, self.log())

    def close(self):
        """Teardown: ends a process that a failed test left running, without asserting."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._ended()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def log(self):
        return self.log_path.read_text(errors="replace") if self.starts else ""

    def _ended(self):
        for channel in self.channels:
            channel.close()
        self.channels = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


def serving_daemon(binary, state_dir):
    """A module fixture's daemon: started, yielded, then stopped with SIGTERM (asserting exit 0)
    and cleaned up. Use as `yield from serving_daemon(qd.binary, state_dir)`."""
    d = Daemon(binary, state_dir)
    d.start()
    yield d
    try:
        d.stop()
    finally:
        d.close()


def grpc_stubs(out_dir):
    """Generates quantd/v1/quantd_pb2{,_grpc}.py from our proto into `out_dir`, puts it first on
    sys.path and returns the two modules."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/timestamp.proto
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
                      f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                      "quantd/v1/quantd.proto"])
    assert rc == 0, f"grpc_tools.protoc failed on {PROTO_ROOT}/quantd/v1/quantd.proto"
    # Regular packages, so that no other `quantd` directory on sys.path can shadow them.
    for package in (out_dir / "quantd", out_dir / "quantd" / "v1"):
        (package / "__init__.py").touch()
    sys.path.insert(0, str(out_dir))
    return (importlib.import_module("quantd.v1.quantd_pb2"),
            importlib.import_module("quantd.v1.quantd_pb2_grpc"))
