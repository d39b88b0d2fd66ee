"""Metrics of a live daemon (issue 4 §4-§5): a scrape of `quantd serve` passes
`promtool check metrics` without a lint warning, and a real Prometheus server (Debian `prometheus`)
scrapes the daemon so that a query for `quantd_` series returns data. Issue 19 item 6: slow, idle
and oversized clients of the metrics endpoint neither keep scrapes out nor grow the daemon.

The daemon listens on port 0 for gRPC and metrics; the ports it bound are in <state-dir>/serve.json.
"""

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

PROMTOOL = Path("/usr/bin/promtool")
PROMETHEUS = Path("/usr/bin/prometheus")


def wait_until(poll, timeout, what, proc, log):
    """Calls poll() until it returns a true value; fails when `proc` exits or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = poll()
        if value:
            return value
        assert proc.poll() is None, f"{what}: exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s:\n{log.read_text()}"
        time.sleep(0.2)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.headers.get("Content-Type"), response.read().decode()


def samples(exposition):
    """The exposition's samples: {'name{labels}': value}."""
    out = {}
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


@pytest.fixture
def daemon(qd, tmp_path):
    """A `quantd serve` (its unix socket, metrics on loopback port 0) with CPU workers; yields its
    serve.json."""
    state = tmp_path / "state"
    log = tmp_path / "quantd.log"
    env = dict(os.environ)
    env.pop("QUANTD_TEST_KILL_AT", None)
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            qd.cmd("serve", "--state-dir", state, "--metrics-listen", "127.0.0.1:0",
                   "--devices", "cpu"),
            stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        serve_json = state / "serve.json"
        wait_until(serve_json.is_file, 60, "serve.json", proc, log)
        info = json.loads(serve_json.read_text())
        assert info["pid"] == proc.pid, info
        assert info["metrics_listen"].startswith("127.0.0.1:"), info
        assert int(info["metrics_listen"].rsplit(":", 1)[1]) > 0, info
        yield info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"quantd did not exit within 60 s of SIGTERM:\n{log.read_text()}")
    assert rc == 0, f"quantd exited {rc} after SIGTERM:\n{log.read_text()}"


def test_scrape_passes_promtool(daemon):
    assert PROMTOOL.is_file(), f"{PROMTOOL} is missing: apt-get install prometheus"
    status, content_type, body = http_get(f"http://{daemon['metrics_listen']}/metrics")
    assert status == 200
    assert content_type.startswith("text/plain"), content_type

    check = subprocess.run([str(PROMTOOL), "check", "metrics"], input=body, capture_output=True,
                           text=True, timeout=60)
    # promtool prints one line per lint problem and nothing for a clean exposition.
    assert check.returncode == 0, (check.stdout, check.stderr)
    assert check.stdout == "" and check.stderr == "", (check.stdout, check.stderr)

    values = samples(body)
    build_info = [s for s in values if s.startswith("quantd_build_info{")]
    assert len(build_info) == 1, build_info
    assert 'cuda="false"' in build_info[0] or 'cuda="true"' in build_info[0], build_info
    assert 'version="' in build_info[0], build_info
    assert values[build_info[0]] == 1
    # A fresh state dir: no jobs in any state, nothing queued.
    for state in ("PENDING", "RUNNING", "PAUSED", "SUCCEEDED", "FAILED", "CANCELLED"):
        assert values[f'quantd_jobs{{state="{state}"}}'] == 0, state
    assert values["quantd_queue_depth"] == 0
    assert values['quantd_task_attempts_total{outcome="done",stage="quantize"}'] == 0
    assert values['quantd_tasks{stage="quantize",state="PENDING"}'] == 0


@pytest.fixture
def prometheus(daemon, tmp_path):
    """A Prometheus server scraping the daemon every second; yields its base URL."""
    assert PROMETHEUS.is_file(), f"{PROMETHEUS} is missing: apt-get install prometheus"
    config = tmp_path / "prometheus.yml"
    # JSON is YAML.
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "quantd",
                            "static_configs": [{"targets": [daemon["metrics_listen"]]}]}],
    }))
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "prometheus.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={config}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address={address}"],
            stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield {"url": f"http://{address}", "proc": proc, "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_prometheus_scrapes_daemon(daemon, prometheus):
    query = urllib.parse.urlencode({"query": '{__name__=~"quantd_.+"}'})
    url = f"{prometheus['url']}/api/v1/query?{query}"

    def result():
        try:
            status, _, body = http_get(url, timeout=5)
        except OSError:  # not listening yet
            return None
        reply = json.loads(body)
        assert status == 200 and reply["status"] == "success", body
        return reply["data"]["result"]

    series = wait_until(result, 60, "Prometheus query for quantd_ series", prometheus["proc"],
                        prometheus["log"])
    by_name = {}
    for s in series:
        by_name.setdefault(s["metric"]["__name__"], []).append(s)
    for s in series:
        assert s["metric"]["job"] == "quantd", s
        assert s["metric"]["instance"] == daemon["metrics_listen"], s
    assert [s["value"][1] for s in by_name["quantd_build_info"]] == ["1"], by_name
    assert "quantd_queue_depth" in by_name, sorted(by_name)
    assert {s["metric"]["state"] for s in by_name["quantd_jobs"]} == {
        "PENDING", "RUNNING", "PAUSED", "SUCCEEDED", "FAILED", "CANCELLED"}, by_name["quantd_jobs"]


def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_descriptors(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def flood(host, port, head, total_bytes):
    """Sends `head`, then up to `total_bytes` of filler, until the server stops taking them."""
    with socket.create_connection((host, port), timeout=30) as s:
        try:
            s.sendall(head)
            chunk = b"a" * (1 << 20)
            for _ in range(total_bytes >> 20):
                s.sendall(chunk)
        except OSError:  # refused and closed: what the server should do
            pass


def test_slow_idle_and_huge_clients_neither_keep_scrapes_out_nor_grow_the_daemon(daemon, stubs):
    """300 connections that send their request header a byte at a time (slowloris), 300 that send
    nothing, a 64 MiB header and a request announcing a 1 TB body (64 MiB of it sent), all at
    once: every scrape is answered meanwhile, the gRPC API answers, and the daemon's memory and
    descriptors stay bounded (at most 256 metrics connections are kept open)."""
    pb, pb_grpc = stubs
    pid = daemon["pid"]
    host, port = daemon["metrics_listen"].rsplit(":", 1)
    port = int(port)
    url = f"http://{daemon['metrics_listen']}/metrics"
    channel = grpc.insecure_channel(daemon["listen"][0])
    stub = pb_grpc.QuantServiceStub(channel)
    assert http_get(url)[0] == 200
    rss_before, fds_before = rss_mib(pid), open_descriptors(pid)

    slow, idle = [], []
    floods = [threading.Thread(target=flood, args=(host, port, head, 64 << 20))
              for head in (b"GET /metrics HTTP/1.1\r\nX-Big: ",
                           b"GET /metrics HTTP/1.1\r\nContent-Length: 1000000000000\r\n\r\n")]
    try:
        for _ in range(300):
            slow.append(socket.create_connection((host, port), timeout=30))
            slow[-1].sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            idle.append(socket.create_connection((host, port), timeout=30))
        for t in floods:
            t.start()
        for _ in range(5):
            for s in slow:
                try:
                    s.send(b"a")
                except OSError:  # closed by the daemon to make room: fine
                    pass
            status, _, body = http_get(url, timeout=10)
            assert status == 200 and "quantd_jobs{" in body
            assert stub.ListJobs(pb.ListJobsRequest(), timeout=10) is not None
            time.sleep(1)
        for t in floods:
            t.join(timeout=120)
            assert not t.is_alive()
        assert open_descriptors(pid) <= fds_before + 256 + 8, (fds_before,
                                                               open_descriptors(pid))
        assert rss_mib(pid) - rss_before < 64, (rss_before, rss_mib(pid))
    finally:
        for s in slow + idle:
            s.close()
        channel.close()
    assert http_get(url)[0] == 200
