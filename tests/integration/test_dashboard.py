"""Grafana dashboard (issue 14 §3): deploy/grafana/quantd.json is a dashboard whose every PromQL
expression names only metrics and labels that a live `quantd serve` exposes after real work (a
job that succeeds, one that fails, RPCs of every kind), and a real Prometheus server scraping that
daemon evaluates each expression without error and with a non-empty result.

quantd_task_retries_total has no series until a transient task error happens, which no portable
test can force; its labels are checked against the documented list in server/metrics/metrics.h
instead, whose other entries must match the live scrape exactly.
"""

import json
import re
from pathlib import Path

import grpc
import pytest

from ops_helpers import (MetricsDaemon, Prometheus, exposed_families, job_spec, promql_names,
                         wait_until)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "quantd.json"
METRICS_H = REPO / "server" / "metrics" / "metrics.h"
# Added by Prometheus to every scraped series; `up` is Prometheus' own per-target series.
TARGET_LABELS = {"job", "instance"}
PROMETHEUS_SERIES = {"up": TARGET_LABELS}
# Families with no series until an event that a test cannot force portably.
# (worker_tasks_leased: its series are per remote worker; the scenario runs none.)
EVENT_ONLY = {"quantd_task_retries_total", "quantd_worker_tasks_leased_total"}
# Grafana's variables, as the test evaluates them.
VARIABLES = {"$instance": ".*", "$__rate_interval": "1m"}
RPC_TIMEOUT_S = 10


def documented_families():
    """{family: label names} from the metric list in metrics.h's header comment."""
    out = {}
    for m in re.finditer(r"^//   (quantd_[a-z_]+)(\{([a-z_,]*)\})?\s", METRICS_H.read_text(),
                         re.MULTILINE):
        out[m.group(1)] = set(filter(None, (m.group(3) or "").split(",")))
    return out


def dashboard_expressions():
    """[(panel title, expression, legend format)] of every panel target."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"], target.get("legendFormat", "")))
    return out


def test_dashboard_structure():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "quantd" and board["title"] == "quantd"
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "instance"], names
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), ids
    titles = " | ".join(p["title"] for p in board["panels"])
    # The views issue 14 asks for.
    for wanted in ("Jobs by state", "Queue depth", "Stage progress", "Throughput", "ETA",
                   "Stage duration", "Task retries by reason", "Job failures by reason",
                   "Device busy ratio", "Device memory used", "RPC rate", "RPC error ratio",
                   "Calibration", "Evaluation tokens/s", "Disk free", "Workers connected",
                   "Tasks leased by worker", "Lease expiries", "Refused stale calls"):
        assert wanted in titles, wanted
    for title, expr, _ in dashboard_expressions():
        # Every query follows the instance picker (`up` and time() included).
        assert 'instance=~"$instance"' in expr, (title, expr)
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                assert target["datasource"]["uid"] == "${datasource}", panel["title"]


@pytest.fixture(scope="module")
def worked_daemon(qd, source, stubs, tmp_path_factory):
    """A daemon after a job that succeeded, one that failed and every kind of RPC, with a
    Prometheus server scraping it; yields (daemon, prometheus, scrape)."""
    pb, pb_grpc = stubs
    root = tmp_path_factory.mktemp("dashboard")
    daemon = MetricsDaemon(qd.binary, root / "state")
    daemon.start()
    prometheus = Prometheus(root / "prometheus", [daemon.metrics_address])
    try:
        stub = pb_grpc.QuantServiceStub(daemon.channel())
        ok = stub.SubmitJob(pb.SubmitJobRequest(spec=job_spec(pb, source["dir"], root / "out")),
                            timeout=RPC_TIMEOUT_S)
        last = list(stub.WatchJob(pb.WatchJobRequest(id=ok.id), timeout=120))[-1]
        assert last.state == pb.SUCCEEDED, last
        # An existing directory that holds no checkpoint: the job fails when it starts.
        (root / "empty").mkdir()
        bad = stub.SubmitJob(pb.SubmitJobRequest(spec=job_spec(pb, root / "empty", root / "o2")),
                             timeout=RPC_TIMEOUT_S)
        last = list(stub.WatchJob(pb.WatchJobRequest(id=bad.id), timeout=120))[-1]
        assert last.state == pb.FAILED, last
        stub.GetJob(pb.GetJobRequest(id=ok.id), timeout=RPC_TIMEOUT_S)
        stub.ListJobs(pb.ListJobsRequest(), timeout=RPC_TIMEOUT_S)
        stub.GetJobReport(pb.GetJobReportRequest(id=ok.id), timeout=RPC_TIMEOUT_S)
        with pytest.raises(grpc.RpcError):
            stub.GetJob(pb.GetJobRequest(id=10**9), timeout=RPC_TIMEOUT_S)
        stub.ResumeJob(pb.ResumeJobRequest(id=bad.id), timeout=RPC_TIMEOUT_S)
        stub.CancelJob(pb.CancelJobRequest(id=bad.id), timeout=RPC_TIMEOUT_S)
        stub.DeleteJob(pb.DeleteJobRequest(id=bad.id), timeout=RPC_TIMEOUT_S)
        wait_until(prometheus.ready, 60, "Prometheus ready")
        # The device gauges come with the scheduler's first per-second refresh.
        scrape = wait_until(lambda: (lambda s: "quantd_device_busy_ratio{" in s and s)(
            daemon.scrape()), 30, "device gauges in the scrape")
        yield daemon, prometheus, scrape
    finally:
        prometheus.close()
        daemon.close()


def test_expressions_name_only_exposed_metrics_and_labels(worked_daemon):
    _, _, scrape = worked_daemon
    live = exposed_families(scrape)
    documented = documented_families()
    # The documented list matches the live daemon for every family that has series.
    for family, labels in documented.items():
        series = {k: v for k, v in live.items()
                  if k == family or k in (f"{family}_bucket", f"{family}_sum", f"{family}_count")}
        if family in EVENT_ONLY:
            assert not series, f"{family} has series now: move it out of EVENT_ONLY"
            continue
        assert series, f"{family} (metrics.h) is not exposed after the scenario"
        exposed = set().union(*series.values()) - {"le"}
        assert exposed == labels, (family, exposed, labels)
    known = dict(PROMETHEUS_SERIES)
    known.update(live)
    for family in EVENT_ONLY:
        known[family] = documented[family]
    for title, expr, legend in dashboard_expressions():
        selectors, grouping = promql_names(expr)
        assert selectors, (title, expr)
        used_labels = set(TARGET_LABELS)
        for metric, matchers in selectors:
            assert metric in known, f"{title}: {metric} is not exposed by quantd"
            labels = known[metric] | TARGET_LABELS
            assert matchers <= labels, (title, metric, matchers - labels)
            used_labels |= labels
        assert grouping <= used_labels, (title, grouping - used_labels)
        legend_labels = set(re.findall(r"\{\{\s*([a-zA-Z_]+)\s*\}\}", legend))
        assert legend_labels <= used_labels, (title, legend_labels - used_labels)


def test_prometheus_evaluates_every_expression(worked_daemon):
    _, prometheus, _ = worked_daemon
    for title, expr, _ in dashboard_expressions():
        query = expr
        for name, value in VARIABLES.items():
            query = query.replace(name, value)
        assert "$" not in query, (title, query)

        def evaluated():
            status, data = prometheus.query(query)
            assert status == "success", (title, query, data)
            return data["result"]

        # Rates need two scrapes in their window; event-only families may stay empty.
        if any(f in query for f in EVENT_ONLY):
            evaluated()
        else:
            wait_until(evaluated, 60, f"a result for {title}: {query}")
