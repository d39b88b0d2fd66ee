"""The daemon (issue 4 §5) driven by a Python grpcio client with stubs generated from our proto:
submit / watch / get / cancel / pause / resume end to end, the error paths with their status codes
and "quantd-reason" trailers, health checking and reflection, idempotent submits, and resumption
after SIGKILL (at a test-hook point and at random progress) and after SIGTERM: the job finishes by
itself once the daemon is back, byte-identical to an uninterrupted `quantd run` of the same spec.

Every daemon runs with one CPU worker (daemon.Daemon). Jobs on the tiny fixture take well under a
second; those that must be caught while they run use the small fixture (3 shards, 336 MB: seconds).
"""

import json
import random
import re
import signal
import time

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from daemon import Daemon, serving_daemon
from run_helpers import job_row, task_rows, tree_hashes, write_spec

RPC_TIMEOUT_S = 10     # every unary call
WATCH_TIMEOUT_S = 180  # one WatchJob stream, to the end of a job
# The job of every test: weights-only NVFP4 of the routed experts (no amax needed); its stages.
SPEC = {"recipe": "experts", "weight_format": "w4a16_nvfp4", "expert_cast": "lossless",
        "export_format": "modelopt"}
STAGES = ["inspect", "quantize", "export", "verify"]
METHODS = {"SubmitJob", "GetJob", "ListJobs", "WatchJob", "CancelJob", "ResumeJob", "DeleteJob",
           "GetJobReport", "ListWorkers"}


@pytest.fixture(scope="session")
def pb(stubs):
    return stubs[0]


def shard_count(src):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return len(set(index["weight_map"].values()))


@pytest.fixture(scope="session")
def small(qd, tmp_path_factory):
    """The small DeepSeek-V4 fixture: a job on it runs long enough to be caught while it runs."""
    src = tmp_path_factory.mktemp("small") / "small-v4"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "small", "--seed", 7, src)
    return {"dir": src, "shards": shard_count(src)}


@pytest.fixture(scope="session")
def reference(request, qd, tmp_path_factory):
    """reference(name) -> file hashes of an uninterrupted `quantd run` of SPEC on the "tiny"
    (conftest `source`) or "small" fixture; computed once per session."""
    hashes = {}

    def get(name):
        if name not in hashes:
            src = request.getfixturevalue({"tiny": "source", "small": "small"}[name])
            root = tmp_path_factory.mktemp(f"reference-{name}")
            spec = write_spec(root / "spec.json", src["dir"], root / "out", **SPEC)
            qd.run_ok("run", "--state", root / "state.db", "--device", "cpu", spec)
            hashes[name] = tree_hashes(root / "out")
        return hashes[name]

    return get


def job_spec(pb, src, out, **fields):
    return pb.JobSpec(source=str(src["dir"]), output=str(out), **{**SPEC, **fields})


class Client:
    """QuantService calls with a deadline on every one."""

    def __init__(self, stubs, channel):
        self.pb, pb_grpc = stubs
        self.channel = channel
        self.stub = pb_grpc.QuantServiceStub(channel)

    def spec(self, src, out, **fields):
        return job_spec(self.pb, src, out, **fields)

    def submit(self, spec, request_id=""):
        return self.stub.SubmitJob(self.pb.SubmitJobRequest(request_id=request_id, spec=spec),
                                   timeout=RPC_TIMEOUT_S)

    def get(self, job_id):
        return self.stub.GetJob(self.pb.GetJobRequest(id=job_id), timeout=RPC_TIMEOUT_S)

    def list(self, state=0):
        return self.stub.ListJobs(self.pb.ListJobsRequest(state=state), timeout=RPC_TIMEOUT_S)

    def cancel(self, job_id, pause=False):
        return self.stub.CancelJob(self.pb.CancelJobRequest(id=job_id, pause=pause),
                                   timeout=RPC_TIMEOUT_S)

    def resume(self, job_id):
        return self.stub.ResumeJob(self.pb.ResumeJobRequest(id=job_id), timeout=RPC_TIMEOUT_S)

    def delete(self, job_id):
        return self.stub.DeleteJob(self.pb.DeleteJobRequest(id=job_id), timeout=RPC_TIMEOUT_S)

    def report(self, job_id, worst=0):
        return self.stub.GetJobReport(self.pb.GetJobReportRequest(id=job_id, worst=worst),
                                      timeout=RPC_TIMEOUT_S)

    def watch(self, job_id, each=None):
        """The messages of one WatchJob stream. `each(message)` sees every message as it comes
        and returns True to stop reading (the stream is cancelled); otherwise the stream must end
        by itself after a terminal or PAUSED state."""
        call = self.stub.WatchJob(self.pb.WatchJobRequest(id=job_id), timeout=WATCH_TIMEOUT_S)
        seen = []
        for message in call:
            seen.append(message)
            if each is not None and each(message):
                call.cancel()
                return seen
        pb = self.pb
        assert seen and seen[-1].state in (pb.SUCCEEDED, pb.FAILED, pb.CANCELLED, pb.PAUSED), seen
        return seen

    def state_name(self, job):
        return self.pb.JobState.Name(job.state)


@pytest.fixture(scope="module")
def daemon(qd, tmp_path_factory):
    """One daemon shared by the tests that do not stop it (SIGTERM at the end: exit 0)."""
    yield from serving_daemon(qd.binary, tmp_path_factory.mktemp("daemon") / "state")


@pytest.fixture(scope="module")
def client(daemon, stubs):
    return Client(stubs, daemon.channel())


def stage(job, kind):
    found = [s for s in job.stages if s.kind == kind]
    assert len(found) == 1, (kind, job)
    return found[0]


def quantizing(pb, job):
    """RUNNING with quantize output half way or so: cancel, pause and kills land mid-task."""
    return job.state == pb.RUNNING and any(
        s.kind == "quantize" and s.bytes_done > 0 for s in job.stages)


def byte_fraction(job):
    """Source bytes processed over all stages with a byte count, 0..1."""
    total = sum(s.bytes_total for s in job.stages)
    return sum(s.bytes_done for s in job.stages) / total if total else 0.0


def rpc_error(code, fn, *args):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    err = info.value
    assert err.code() == code, (err.code(), err.details())
    return err


def reason(err):
    return dict(err.trailing_metadata() or ()).get("quantd-reason")


def verify_ok(qd, out):
    proc = qd.run("verify", out)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)


def assert_no_tmp(out):
    assert not sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp"))


def assert_succeeded(pb, job, shards):
    assert job.state == pb.SUCCEEDED and job.last_error == "", job
    assert [s.kind for s in job.stages] == STAGES, job.stages
    for s in job.stages:
        assert s.state == pb.StageProgress.SUCCEEDED and s.tasks_done == s.tasks_total, s
        assert s.bytes_done == s.bytes_total, s
    assert [s.tasks_total for s in job.stages] == [1, shards, 1, shards], job.stages


# --- the grpcio client on one daemon ---------------------------------------------------------


def test_submit_watch_get_report_and_verify(client, pb, qd, source, reference, tmp_path):
    out = tmp_path / "out"
    job = client.submit(client.spec(source, out), request_id="grpcio-1")
    assert job.id > 0 and job.state == pb.PENDING and job.request_id == "grpcio-1", job
    # The spec as validated, defaults spelled out.
    assert (job.spec.source, job.spec.output) == (str(source["dir"]), str(out))
    assert (job.spec.recipe, job.spec.weight_format, job.spec.expert_cast,
            job.spec.export_format, job.spec.kv_cache) == (
        "experts", "w4a16_nvfp4", "lossless", "modelopt", "none"), job.spec

    seen = client.watch(job.id)
    assert all(m.id == job.id for m in seen)
    rank = {pb.PENDING: 0, pb.RUNNING: 1, pb.SUCCEEDED: 2}
    states = [client.state_name(m) for m in seen]
    assert all(m.state in rank for m in seen), states
    assert [rank[m.state] for m in seen] == sorted(rank[m.state] for m in seen), states
    assert all(a != b for a, b in zip(seen, seen[1:])), "a message without a change"
    for kind in STAGES:  # progress never goes back
        done = [s.tasks_done for m in seen for s in m.stages if s.kind == kind]
        assert done == sorted(done), (kind, done)
    final = seen[-1]
    assert_succeeded(pb, final, source["shards"])
    assert final.task_attempts == 2 + 2 * source["shards"], final
    assert final.create_time.ToNanoseconds() <= final.start_time.ToNanoseconds() \
        <= final.end_time.ToNanoseconds(), final
    assert client.get(job.id) == final
    assert job.id in [j.id for j in client.list().jobs]
    assert job.id in [j.id for j in client.list(pb.SUCCEEDED).jobs]
    assert job.id not in [j.id for j in client.list(pb.RUNNING).jobs]

    report = client.report(job.id, worst=3)
    assert (report.job_id, report.state, report.tensors_total) == (job.id, pb.SUCCEEDED, 72)
    sqnr = [t.sqnr_db for t in report.tensors]
    assert len(sqnr) == 3 and sqnr == sorted(sqnr) and report.min_sqnr_db == sqnr[0], report
    assert report.min_sqnr_db <= report.mean_sqnr_db
    assert len(report.rules) == source["shards"] and all(r.passed for r in report.rules), report
    assert len(client.report(job.id).tensors) == 72

    verify_ok(qd, out)
    assert tree_hashes(out) == reference("tiny")


def test_cancel_while_running(client, pb, small, tmp_path):
    out = tmp_path / "out"
    job = client.submit(client.spec(small, out))
    answers = []

    def cancel_once(message):
        if not answers and quantizing(pb, message):
            answers.append(client.cancel(job.id))
        return False

    seen = client.watch(job.id, cancel_once)
    assert answers, [client.state_name(m) for m in seen]
    assert answers[0].state in (pb.RUNNING, pb.CANCELLED), answers[0]
    if answers[0].state == pb.RUNNING:
        assert answers[0].reason == "cancelling", answers[0]
    assert seen[-1].state == pb.CANCELLED, seen[-1]
    assert client.get(job.id).state == pb.CANCELLED
    assert stage(seen[-1], "quantize").tasks_done < small["shards"], seen[-1]
    assert_no_tmp(out)  # the stopped task's partial file is removed
    # CANCELLED is final.
    err = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, client.resume, job.id)
    assert reason(err) == "TRANSITION_FORBIDDEN", err.trailing_metadata()


def test_pause_then_resume_succeeds(client, pb, qd, small, reference, tmp_path):
    out = tmp_path / "out"
    job = client.submit(client.spec(small, out))
    answers = []

    def pause_once(message):
        if not answers and quantizing(pb, message):
            answers.append(client.cancel(job.id, pause=True))
        return False

    seen = client.watch(job.id, pause_once)
    assert answers and answers[0].state in (pb.RUNNING, pb.PAUSED), answers
    if answers[0].state == pb.RUNNING:
        assert answers[0].reason == "pausing", answers[0]
    paused = seen[-1]
    assert paused.state == pb.PAUSED, paused
    assert stage(paused, "quantize").tasks_done < small["shards"], paused
    assert_no_tmp(out)
    assert client.cancel(job.id, pause=True).state == pb.PAUSED  # unchanged

    resumed = client.resume(job.id)
    assert resumed.state == pb.PENDING, resumed
    final = client.watch(job.id)[-1]
    assert_succeeded(pb, final, small["shards"])
    verify_ok(qd, out)
    assert tree_hashes(out) == reference("small")


def test_health_and_reflection(client):
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "quantd.v1.QuantService"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
    rpc_error(grpc.StatusCode.NOT_FOUND, health.Check,
              health_pb2.HealthCheckRequest(service="no.such.Service"))

    database = ProtoReflectionDescriptorDatabase(client.channel)
    assert "quantd.v1.QuantService" in database.get_services()
    service = DescriptorPool(database).FindServiceByName("quantd.v1.QuantService")
    assert {m.name for m in service.methods} == METHODS
    assert [m.name for m in service.methods if m.server_streaming] == ["WatchJob"]


def test_error_paths(client, pb, source, small, tmp_path):
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    not_found = grpc.StatusCode.NOT_FOUND
    forbidden = grpc.StatusCode.FAILED_PRECONDITION

    # Bad spec fields: INVALID_ARGUMENT naming the field.
    bad_specs = [
        ("weight_format", client.spec(source, tmp_path / "a", weight_format="fp3")),
        ("recipe", client.spec(source, tmp_path / "b", recipe="most")),
        ("source", client.spec({"dir": ""}, tmp_path / "c")),
        ("output", client.spec(source, "")),
    ]
    for field, spec in bad_specs:
        err = rpc_error(invalid, client.submit, spec)
        # "spec.<field>: ..." or "SubmitJobRequest.spec: field '<field>' ...".
        assert re.search(rf"\bspec\b.*\b{field}\b", err.details()), (field, err.details())
        assert reason(err) == "INVALID_SPEC", (field, err.trailing_metadata())

    # Unknown job, on every RPC that takes an id.
    unknown = 987654321
    calls = [client.get, client.cancel, client.resume, client.delete, client.report,
             lambda i: next(iter(client.stub.WatchJob(pb.WatchJobRequest(id=i),
                                                      timeout=RPC_TIMEOUT_S)))]
    for call in calls:
        err = rpc_error(not_found, call, unknown)
        assert reason(err) == "JOB_NOT_FOUND", err.trailing_metadata()
        assert str(unknown) in err.details(), err.details()

    # DeleteJob of a RUNNING job.
    running = client.submit(client.spec(small, tmp_path / "running"))
    client.watch(running.id, lambda m: m.state == pb.RUNNING)
    err = rpc_error(forbidden, client.delete, running.id)
    assert reason(err) == "JOB_RUNNING", err.trailing_metadata()
    client.cancel(running.id)
    assert client.watch(running.id)[-1].state == pb.CANCELLED
    assert client.delete(running.id) == pb.DeleteJobResponse()
    err = rpc_error(not_found, client.get, running.id)
    assert reason(err) == "JOB_NOT_FOUND"

    # Forbidden transitions of a SUCCEEDED job.
    done = client.submit(client.spec(source, tmp_path / "done"), request_id="errors-done")
    assert client.watch(done.id)[-1].state == pb.SUCCEEDED
    for call in (client.resume, client.cancel, lambda i: client.cancel(i, pause=True)):
        err = rpc_error(forbidden, call, done.id)
        assert reason(err) == "TRANSITION_FORBIDDEN", err.trailing_metadata()
    assert client.get(done.id).state == pb.SUCCEEDED

    # A request_id reused with another spec.
    err = rpc_error(grpc.StatusCode.ALREADY_EXISTS, client.submit,
                    client.spec(source, tmp_path / "other"), "errors-done")
    assert reason(err) == "REQUEST_ID_REUSED", err.trailing_metadata()


def test_duplicate_request_id_returns_the_same_job(client, pb, source, tmp_path):
    spec = client.spec(source, tmp_path / "out")
    first = client.submit(spec, request_id="dup-1")
    second = client.submit(spec, request_id="dup-1")
    assert second.id == first.id
    assert client.watch(first.id)[-1].state == pb.SUCCEEDED
    again = client.submit(spec, request_id="dup-1")  # the original job, not a new one
    assert (again.id, again.state) == (first.id, pb.SUCCEEDED)
    assert [j.id for j in client.list().jobs if j.request_id == "dup-1"] == [first.id]


# --- daemons that die or stop mid-job ---------------------------------------------------------


@pytest.fixture
def own_daemon(qd, tmp_path):
    d = Daemon(qd.binary, tmp_path / "state")
    yield d
    d.close()


def test_sigkill_at_hook_point_then_restart_finishes_by_itself(own_daemon, stubs, pb, qd, source,
                                                               reference, tmp_path):
    d = own_daemon
    d.env = {"QUANTD_TEST_KILL_AT": "quantize:2:mid"}
    d.start()
    out = tmp_path / "out"
    job = Client(stubs, d.channel()).submit(job_spec(pb, source, out), "kill-hook")
    assert d.wait(60) == -signal.SIGKILL, d.log()
    # Killed with the 2nd quantize task half written (one worker: shards in plan order).
    assert sorted(p.name for p in out.iterdir()) == [
        ".quantd-job", "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors.tmp"]

    d.env = {}
    d.start()
    client = Client(stubs, d.channel())
    final = client.watch(job.id)[-1]  # nobody resubmits: the daemon resumes it by itself
    assert_succeeded(pb, final, source["shards"])
    # The interrupted task ran twice, every other task once.
    assert stage(final, "quantize").task_attempts == source["shards"] + 1, final
    assert final.task_attempts == 2 + 2 * source["shards"] + 1, final
    assert [j.id for j in client.list().jobs] == [job.id]
    assert_no_tmp(out)
    assert tree_hashes(out) == reference("tiny")
    verify_ok(qd, out)
    d.stop()


def test_sigkill_at_random_progress_then_restart_finishes_by_itself(own_daemon, stubs, pb, small,
                                                                    reference, tmp_path):
    d = own_daemon
    d.start()
    out = tmp_path / "out"
    client = Client(stubs, d.channel())
    job = client.submit(client.spec(small, out), "kill-random")
    # Two kills: one during quantize (under half the bytes), one during verify.
    rng = random.Random(20241129)
    for fraction in (rng.uniform(0.1, 0.4), rng.uniform(0.55, 0.8)):
        seen = client.watch(job.id,
                            lambda m: m.state == pb.RUNNING and byte_fraction(m) >= fraction)
        assert seen[-1].state == pb.RUNNING, (fraction, seen[-1])
        d.kill()
        d.start()
        client = Client(stubs, d.channel())
    final = client.watch(job.id)[-1]
    assert_succeeded(pb, final, small["shards"])
    assert [j.id for j in client.list().jobs] == [job.id]
    assert_no_tmp(out)
    assert tree_hashes(out) == reference("small")
    d.stop()


def test_sigterm_while_running_exits_cleanly_and_the_job_resumes(own_daemon, stubs, pb, qd, small,
                                                                 reference, tmp_path):
    d = own_daemon
    d.start()
    out = tmp_path / "out"
    client = Client(stubs, d.channel())
    job = client.submit(client.spec(small, out), "sigterm")
    # A client still watching does not hold the shutdown up: its stream ends without a final state.
    stream = client.stub.WatchJob(pb.WatchJobRequest(id=job.id), timeout=WATCH_TIMEOUT_S)
    assert any(quantizing(pb, m) for m in stream)
    d.terminate()
    with pytest.raises(grpc.RpcError) as ended:
        for m in stream:
            assert m.state == pb.RUNNING, m
    assert ended.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), (
        ended.value)
    d.stop()  # exit 0 within the grace period
    # Left RUNNING for the next start, its tasks requeued.
    db = d.state_dir / "quantd.db"
    assert job_row(db)[0][0] == "RUNNING", job_row(db)
    assert not [k for k, t in task_rows(db).items() if t["state"] == "LEASED"], task_rows(db)

    d.start()
    client = Client(stubs, d.channel())
    final = client.watch(job.id)[-1]
    assert_succeeded(pb, final, small["shards"])
    assert_no_tmp(out)
    assert tree_hashes(out) == reference("small")
    verify_ok(qd, out)
    d.stop()


# --- a job store that refuses writes (issue 8 §4, issue 9) ------------------------------------


def hold_write_lock(state_dir):
    """Another connection's write transaction on quantd.db: the daemon's writes wait for its busy
    timeout (5 s) and fail while it lasts. Returns the connection; rollback() releases it."""
    import sqlite3
    con = sqlite3.connect(str(state_dir / "quantd.db"), isolation_level=None, timeout=30)
    con.execute("BEGIN IMMEDIATE")
    return con


def test_a_write_lock_held_8s_on_the_database_loses_no_completion(own_daemon, stubs, pb, qd,
                                                                  small, reference, tmp_path):
    d = own_daemon
    d.start()
    out = tmp_path / "out"
    client = Client(stubs, d.channel())
    job = client.submit(client.spec(small, out), "locked")
    client.watch(job.id, lambda m: quantizing(pb, m))
    lock = hold_write_lock(d.state_dir)
    time.sleep(8)  # the lock itself is what is tested: tasks finish and cannot be recorded
    lock.rollback()
    lock.close()
    final = client.watch(job.id)[-1]
    assert_succeeded(pb, final, small["shards"])
    assert "store_error" in d.log(), d.log()  # a completion was refused, then recorded
    health = health_pb2_grpc.HealthStub(d.channel())
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert tree_hashes(out) == reference("small")
    d.stop()


def test_a_store_that_stays_locked_ends_serve_with_code_3_and_a_restart_finishes(
        own_daemon, stubs, pb, small, reference, tmp_path):
    d = own_daemon
    d.extra = ["--store-retry-seconds", "2"]
    d.start()
    out = tmp_path / "out"
    client = Client(stubs, d.channel())
    job = client.submit(client.spec(small, out), "unusable")
    client.watch(job.id, lambda m: quantizing(pb, m))
    lock = hold_write_lock(d.state_dir)
    rc = d.wait(120)
    log = d.log()
    lock.rollback()
    lock.close()
    assert rc == 3, log
    assert "health is NOT_SERVING; exiting with code 3" in log, log
    assert "the job store failed for " in log, log
    d.extra = []
    d.start()  # what its supervisor does
    final = Client(stubs, d.channel()).watch(job.id)[-1]
    assert_succeeded(pb, final, small["shards"])
    assert tree_hashes(out) == reference("small")
    d.stop()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP])
def test_sigint_and_sighup_stop_the_daemon_like_sigterm(own_daemon, signum):
    d = own_daemon
    d.start()
    d.proc.send_signal(signum)
    d.terminated_at = time.monotonic()
    d.stop()  # exit 0
    assert f"{signal.strsignal(signum)}: shutting down" in d.log(), d.log()
