"""Helpers of the operations tests (test_dashboard.py, test_soak.py): a daemon from the shared
harness (daemon.Daemon) that also serves metrics, a Prometheus server scraping it, job specs and a
small PromQL reader that names the metrics and labels an expression uses.
"""

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from daemon import Daemon

PROMETHEUS = Path("/usr/bin/prometheus")
# The job of the operations tests: weights-only NVFP4 of the routed experts (no amax needed).
SPEC = {"recipe": "experts", "weight_format": "w4a16_nvfp4", "expert_cast": "lossless",
        "export_format": "modelopt"}


class MetricsDaemon(Daemon):
    """daemon.Daemon with its metrics served on a loopback port the system picks (serve.json's
    metrics_listen)."""

    def cmd(self):
        cmd = super().cmd()
        if "--metrics-listen" in cmd:
            cmd[cmd.index("--metrics-listen") + 1] = "127.0.0.1:0"
        else:
            cmd += ["--metrics-listen", "127.0.0.1:0"]
        return cmd

    @property
    def metrics_address(self):
        return self.info["metrics_listen"]

    def scrape(self):
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            return r.read().decode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(poll, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        value = poll()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)


class Prometheus:
    """A Prometheus server scraping `targets` every second (the Debian `prometheus` package)."""

    def __init__(self, work_dir, targets):
        assert PROMETHEUS.is_file(), f"{PROMETHEUS} is missing: apt-get install prometheus"
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        config = work_dir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "quantd", "static_configs": [{"targets": targets}]}],
        }))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = work_dir / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={config}",
                 f"--storage.tsdb.path={work_dir / 'tsdb'}",
                 f"--web.listen-address={self.url[len('http://'):]}"],
                stdout=log, stderr=subprocess.STDOUT)

    def query(self, expr):
        """(status, data or error) of an instant query at the current time."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422: a bad expression
            reply = json.loads(e.read())
        return reply["status"], reply.get("data", reply.get("error"))

    def ready(self):
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            assert self.proc.poll() is None, self.log.read_text()
            return False

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def exposed_families(exposition):
    """{metric name: set of label names} over the samples of a text exposition."""
    families = {}
    for line in exposition.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s", line)
        assert m, line
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""))
        families.setdefault(m.group(1), set()).update(labels)
    return families


_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"')


def promql_names(expr):
    """(selectors, grouping labels) of a PromQL expression: selectors as [(metric, {matcher
    label names})], grouping labels from by/without/on/ignoring/group_left/group_right."""
    grouping = set()
    for _, labels in _GROUPING.findall(expr):
        grouping.update(l.strip() for l in labels.split(",") if l.strip())
    rest = _GROUPING.sub(" ", expr)
    selectors = []

    def selector(m):
        selectors.append((m.group(1), set(_MATCHER.findall(m.group(2)))))
        return " "

    rest = _SELECTOR.sub(selector, rest)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)          # range and subquery durations
    rest = re.sub(r'"(?:[^"\\]|\\.)*"', " ", rest)    # string arguments
    # Numbers and durations ("0.9", "1e9", "15m") are tokens of their own, so that their letters
    # are never taken for names.
    for m in re.finditer(r"[0-9][0-9a-zA-Z_.+]*|[a-zA-Z_:][a-zA-Z0-9_:]*", rest):
        name = m.group(0)
        if name[0].isdigit() or name.lower() in _KEYWORDS:
            continue
        if re.match(r"\s*\(", rest[m.end():]):
            continue  # a function or aggregation called here
        selectors.append((name, set()))
    return selectors, grouping


def job_spec(pb, source, output, **fields):
    return pb.JobSpec(source=str(source), output=str(output), **{**SPEC, **fields})
