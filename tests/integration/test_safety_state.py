"""Issue 9 items 4 and 5 against the real daemon: a state store that checks itself (a damaged or
lost database stops the start with a clear message), history retention, ListJobs pages under the
message size limit, and limits that hostile connections cannot exhaust (idle gRPC connections
under a low descriptor limit, half-open metrics connections). Issue 19 item 4: a stored error is
at most 4 KiB however long an older release wrote it, and the state (database, work directory,
calibration tokens) is private to the daemon's user, checked as a second local user (and
`quantd run`'s to its own).
"""

import json
import os
import resource
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO
from daemon import Daemon
from job_client import RPC_TIMEOUT_S, JobClient
from run_helpers import write_spec

SOCKET_GID = 47921  # the socket's group in the tests below
READER = 47922      # a uid in that group: a reader
TENANT = "qd-tenant"  # a second local user (useradd), for the private state test
DATA = REPO / "tests" / "data" / "calibration_sample.jsonl"

class Client(JobClient):
    def list_all(self, page_size=0):
        jobs, pages, token = [], [], ""
        while True:
            page = self.stub.ListJobs(self.pb.ListJobsRequest(page_size=page_size,
                                                              page_token=token),
                                      timeout=RPC_TIMEOUT_S)
            pages.append(page)
            jobs.extend(page.jobs)
            token = page.next_page_token
            if not token:
                return jobs, pages


def start_fails(d):
    """Runs the daemon's command line, which must exit 1 before serving; returns its output."""
    proc = subprocess.run(d.cmd(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert not d.ready_file.exists()
    return proc.stdout + proc.stderr


def run_one_job(qd, stubs, d, source, out):
    d.start()
    client = Client(stubs, d.channel())
    job = client.finish(client.submit(source=str(source["dir"]), output=str(out)).id)
    assert job.state == client.pb.SUCCEEDED, job
    d.stop()


def test_damaged_database_stops_the_start_naming_file_and_backup(qd, stubs, source, tmp_path):
    d = Daemon(qd.binary, tmp_path / "state")
    run_one_job(qd, stubs, d, source, tmp_path / "out")
    d.start()  # a start that passes the check backs up the database, the finished job with it
    d.stop()
    db = d.state_dir / "quantd.db"
    backup = d.state_dir / "quantd.db.bak"
    assert backup.is_file()
    # Garbage over every page but the first (the file header): the "garbage in pages".
    size = db.stat().st_size
    with open(db, "r+b") as f:
        f.seek(4096)
        f.write(bytes([0xA5]) * (size - 4096))
    message = start_fails(d)
    assert str(db) in message and "quantd will not run on a damaged database" in message, message
    assert f"restore the backup {backup}" in message, message
    # Restoring the backup brings the history back.
    shutil.copyfile(backup, db)
    d.start()
    client = Client(stubs, d.channel())
    jobs, _ = client.list_all()
    assert [j.state for j in jobs] == [client.pb.SUCCEEDED]
    d.stop()


def test_empty_or_missing_database_needs_init(qd, stubs, source, tmp_path):
    d = Daemon(qd.binary, tmp_path / "state")
    run_one_job(qd, stubs, d, source, tmp_path / "out")
    db = d.state_dir / "quantd.db"
    os.truncate(db, 0)
    message = start_fails(d)
    assert f"state database {db} is empty (0 bytes) but its state dir holds other files" in \
        message, message
    db.unlink()
    message = start_fails(d)
    assert f"state database {db} is missing" in message, message
    d.extra = ["--init"]
    d.start()
    jobs, _ = Client(stubs, d.channel()).list_all()
    assert jobs == []
    d.stop()


def test_first_start_on_an_empty_state_dir_needs_no_init(qd, tmp_path):
    with Daemon(qd.binary, tmp_path / "state") as d:
        d.stop()


def test_retention_prunes_finished_jobs_only(qd, stubs, source, tmp_path):
    d = Daemon(qd.binary, tmp_path / "state")
    d.start()
    client = Client(stubs, d.channel())
    ids = []
    for i in range(3):
        job = client.finish(client.submit(source=str(source["dir"]),
                                          output=str(tmp_path / f"out{i}")).id)
        assert job.state == client.pb.SUCCEEDED, job
        ids.append(job.id)
    d.stop()
    d.extra = ["--retain-jobs", "1"]
    d.start()
    client = Client(stubs, d.channel())
    deadline = time.monotonic() + 30
    while True:
        jobs, _ = client.list_all()
        if len(jobs) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # The newest finished job (unfinished ones are never pruned: history_pruner_test).
    assert [j.id for j in jobs] == [ids[-1]], jobs
    assert "history retention: deleted 2 finished job(s)" in d.log()
    d.stop()


def test_list_jobs_pages_stay_under_the_message_limit(qd, stubs, source, tmp_path):
    """Jobs whose specs are near the spec limit: one page of them all would be above 4 MiB.
    (Their source is missing, so they fail at once: only their specs matter here.)"""
    globs = [f"layers.{i}.never_{'x' * 40}" for i in range(3000)]  # ~190 KB of JSON
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        ids = [client.submit(source=str(tmp_path / "missing"),
                             output=str(tmp_path / f"out{i}"), exclude=globs).id
               for i in range(24)]
        jobs, pages = client.list_all(page_size=1000)
        assert [j.id for j in jobs] == ids
        assert len(pages) > 1
        assert all(p.ByteSize() < 4 << 20 for p in pages), [p.ByteSize() for p in pages]
        d.stop()


def connect_raw(address):
    if address.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(address[len("unix:"):])
    else:
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
    return s


def test_idle_connection_flood_does_not_stop_new_clients(qd, stubs, source, tmp_path):
    """The daemon starts with a soft descriptor limit of 256; 400 idle connections (no HTTP/2
    preface) would exhaust it if quantd did not raise it to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"hard RLIMIT_NOFILE is {hard}: nothing to raise to")

    class LowLimitDaemon(Daemon):
        def cmd(self):
            return ["prlimit", f"--nofile=256:{hard}", "--", *super().cmd()]

    d = LowLimitDaemon(qd.binary, tmp_path / "state")
    d.start()
    flood = []
    try:
        for _ in range(400):
            flood.append(connect_raw(d.address))
        client = Client(stubs, d.channel())
        job = client.finish(client.submit(source=str(source["dir"]),
                                          output=str(tmp_path / "out")).id)
        assert job.state == client.pb.SUCCEEDED, job
        assert "raised the open-file limit from 256" in d.log()
    finally:
        for s in flood:
            s.close()
    d.stop()


def test_half_open_metrics_connections_do_not_block_scrapes(qd, tmp_path):
    class MetricsDaemon(Daemon):
        def cmd(self):
            cmd = super().cmd()
            cmd[cmd.index("--metrics-listen") + 1] = "127.0.0.1:0"
            return cmd

    d = MetricsDaemon(qd.binary, tmp_path / "state")
    d.start()
    metrics = d.info["metrics_listen"]
    host, port = metrics.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(6)]
    try:
        for s in idle[:3]:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request that never ends
        started = time.monotonic()
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
            assert r.status == 200 and b"quantd_" in r.read()
        assert time.monotonic() - started < 5
    finally:
        for s in idle:
            s.close()
    d.stop()


def test_a_second_daemon_on_the_same_state_dir_names_the_first(qd, tmp_path):
    """The state dir's lock refuses a second daemon, which names the first one's pid and leaves
    its serve.json alone."""
    with Daemon(qd.binary, tmp_path / "state") as first:
        served = first.ready_file.read_text()
        second = Daemon(qd.binary, tmp_path / "state", socket_path=tmp_path / "second.sock")
        proc = subprocess.run(second.cmd(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
        lock = tmp_path / "state" / "quantd.lock"
        assert (f"another quantd (pid {first.pid}) serves the state dir {tmp_path / 'state'} "
                f"({lock} is locked)") in proc.stderr, proc.stderr
        assert first.ready_file.read_text() == served
        first.channel()  # still serving
        first.stop()


def test_a_stale_serve_json_is_replaced_not_trusted(qd, tmp_path):
    """serve.json of a daemon that died (its pid gone, its socket gone) is never read as the new
    daemon's: it is replaced once the new one serves."""
    state = tmp_path / "state"
    state.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = {"pid": dead.pid, "listen": [f"unix:{tmp_path}/gone.sock"], "metrics_listen": ""}
    d = Daemon(qd.binary, state)
    (state / "serve.json").write_text(json.dumps(stale))
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(d.cmd(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                info = json.loads((state / "serve.json").read_text())
            except FileNotFoundError:
                info = None
            if info is not None and info["pid"] == proc.pid:
                break
            assert info in (None, stale), info  # the stale file, gone, then the new one only
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "serve.log").read_text()
            time.sleep(0.02)
        assert info["listen"] == [f"unix:{d.socket_path}"], info
        assert (state / "quantd.lock").read_text() == f"{proc.pid}\n"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, (tmp_path / "serve.log").read_text()
        d.close()
    assert not (state / "serve.json").exists()


@pytest.fixture
def public_dir():
    """A new directory every user may enter (pytest's own are root's only), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="qd-state-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def quantctl_as(uid, gid, daemon, *args):
    """quantctl on the daemon's socket as `uid`, in group `gid` only (setpriv)."""
    quantctl = Path(daemon.binary).parents[1] / "client" / "quantctl"
    return subprocess.run(
        ["setpriv", "--reuid", str(uid), "--regid", str(gid), "--groups", str(gid),
         str(quantctl), "--server", daemon.address, "--timeout", "10", *map(str, args)],
        capture_output=True, text=True, timeout=60, cwd="/")


def test_a_huge_error_an_older_release_stored_hides_no_job(qd, stubs, source, tmp_path,
                                                           public_dir, request):
    """The issue's 5 MB tokenizer component name quoted into a job's error: rows an older release
    wrote that way (put there with sqlite here) are cut to 4 KiB when read, so GetJob, ListJobs
    and WatchJob answer the admin (root) and a reader (a second uid) alike."""
    assert os.geteuid() == 0, "the reader is a second uid (setpriv): run as root"
    d = Daemon(qd.binary, tmp_path / "state", "--socket-group", SOCKET_GID,
               socket_path=public_dir / "quantd.sock")
    request.addfinalizer(d.close)  # however the test ends
    d.start()
    client = Client(stubs, d.channel())
    failed = client.finish(client.submit(source=str(tmp_path / "missing"),
                                         output=str(tmp_path / "out")).id)
    assert failed.state == client.pb.FAILED, failed
    later = client.submit(source=str(tmp_path / "missing"), output=str(tmp_path / "out2"))
    client.finish(later.id)
    d.stop()
    huge = "unknown normalizer " + "a" * 5_000_000
    con = sqlite3.connect(d.state_dir / "quantd.db")
    con.execute("UPDATE jobs SET error = ? WHERE id = ?", (huge, failed.id))
    con.execute("UPDATE events SET message = ? WHERE job_id = ?", (huge, failed.id))
    con.commit()
    con.close()
    note = f"... ({len(huge)} bytes in all)"

    d.start()
    client = Client(stubs, d.channel())
    job = client.stub.GetJob(client.pb.GetJobRequest(id=failed.id), timeout=RPC_TIMEOUT_S)
    assert len(job.last_error.encode()) == 4096 and job.last_error.endswith(note), \
        job.last_error[-100:]
    assert job.last_error.startswith("unknown normalizer aaa")
    jobs, pages = client.list_all()
    assert [j.id for j in jobs] == [failed.id, later.id]
    assert all(p.ByteSize() < 64 << 10 for p in pages), [p.ByteSize() for p in pages]
    watched = client.finish(failed.id)
    assert watched.last_error == job.last_error
    for args in (("list",), ("get", failed.id), ("-o", "json", "get", failed.id)):
        proc = quantctl_as(READER, SOCKET_GID, d, *args)
        assert proc.returncode == 0, (args, proc.stderr[-500:])
    as_json = json.loads(quantctl_as(READER, SOCKET_GID, d, "-o", "json", "get", failed.id).stdout)
    assert as_json["lastError"] == job.last_error
    d.stop()


@pytest.fixture(scope="module")
def tenant():
    """(uid, gid) of a second local user, made with useradd and removed after the module."""
    assert os.geteuid() == 0, "useradd needs root"
    made = subprocess.run(["id", "-u", TENANT], capture_output=True).returncode != 0
    if made:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", TENANT],
                       check=True, capture_output=True)
    ids = (int(subprocess.check_output(["id", "-u", TENANT])),
           int(subprocess.check_output(["id", "-g", TENANT])))
    yield ids
    if made:
        subprocess.run(["userdel", TENANT], capture_output=True)


def tenant_reads(tenant, *command):
    """`command` run as the tenant: (exit status, stderr)."""
    uid, gid = tenant
    proc = subprocess.run(["setpriv", "--reuid", str(uid), "--regid", str(gid), "--clear-groups",
                           *map(str, command)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=60, cwd="/")
    return proc.returncode, proc.stderr


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_state_files_are_private_to_the_daemons_user(qd, stubs, source, public_dir, tenant,
                                                     request):
    """The issue's leak: with umask 022 the state dir, quantd.db and a job's tokens.bin were
    world-readable, and another local user decoded a tenant's calibration text. Now the daemon
    creates its state private (0700 / 0600), and on a state dir an older release left readable it
    makes its files private and warns about the directory."""
    state = public_dir / "state"
    d = Daemon(qd.binary, state, env={"QUANTD_TEST_KILL_AT": "calibrate:1:done"},
               socket_path=public_dir / "quantd.sock")
    request.addfinalizer(d.close)  # however the test ends
    old_umask = os.umask(0o022)  # what an operator's shell gives the daemon
    try:
        d.start()
    finally:
        os.umask(old_umask)
    pb = stubs[0]
    client = Client(stubs, d.channel())
    job = client.submit(source=str(source["dir"]), output=str(public_dir / "out"),
                        weight_format="nvfp4",
                        calibration=pb.CalibrationSpec(dataset=str(DATA), num_samples=8,
                                                       seq_len=256),
                        evaluate=pb.EvaluateSpec(enabled=False))
    assert d.wait(120) == -signal.SIGKILL, d.log()  # right after the tokens task was recorded
    db = state / "quantd.db"
    work = state / "quantd.db.work"
    tokens = work / f"job-{job.id}" / "tokens.bin"
    assert tokens.is_file()
    assert {p.name: mode(p) for p in (state, db, state / "quantd.lock", work)} == {
        "state": 0o700, "quantd.db": 0o600, "quantd.lock": 0o600, "quantd.db.work": 0o700}
    for command in (["cat", db], ["ls", work / f"job-{job.id}"], ["cat", tokens]):
        rc, err = tenant_reads(tenant, *command)
        assert rc != 0 and "Permission denied" in err, (command, rc, err)

    # A state dir as an older release left it under umask 022: every user may read everything.
    for path in [state, *state.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    assert tenant_reads(tenant, "cat", tokens)[0] == 0
    d.env = {}
    d.start()
    assert mode(state) == 0o755  # the operator's directory keeps its mode, with a warning
    assert (f"the state dir {state} can be entered or listed by other users (mode 0755)"
            in d.log()), d.log()
    for name in ("quantd.db", "quantd.lock", "serve.json", "quantd.db.bak"):
        assert mode(state / name) == 0o600, name
    assert mode(work) == 0o700
    for command in (["cat", db], ["ls", work], ["cat", tokens]):
        rc, err = tenant_reads(tenant, *command)
        assert rc != 0 and "Permission denied" in err, (command, rc, err)
    d.stop()


def test_quantd_runs_state_file_is_private(qd, source, tmp_path):
    """`quantd run` under umask 022: its state file, lock and work directory are private; a state
    file an older release left readable is made so on the next run."""
    spec = write_spec(tmp_path / "spec.json", source["dir"], tmp_path / "out",
                      weight_format="w4a16_nvfp4")
    state = tmp_path / "state.db"
    old_umask = os.umask(0o022)
    try:
        qd.run_ok("run", "--state", state, "--device", "cpu", spec)
        assert {p.name: mode(p) for p in (state, tmp_path / "state.db.lock",
                                         tmp_path / "state.db.work")} == {
            "state.db": 0o600, "state.db.lock": 0o600, "state.db.work": 0o700}
        state.chmod(0o644)
        qd.run_ok("run", "--state", state, "--device", "cpu", spec)  # done already: a no-op
        assert mode(state) == 0o600
    finally:
        os.umask(old_umask)


def test_a_socket_in_the_state_dir_is_reachable_by_its_group_only(qd, stubs, public_dir):
    """--socket-group with the socket inside the state dir: the group may pass through the dir
    (0710) to the socket; listing the dir or reading the database stays the daemon's."""
    state = public_dir / "state"
    d = Daemon(qd.binary, state, "--socket-group", SOCKET_GID, socket_path=state / "quantd.sock")
    with d:
        st = os.stat(state)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o710, SOCKET_GID)
        proc = quantctl_as(READER, SOCKET_GID, d, "list")
        assert proc.returncode == 0, proc.stderr
        rc, err = tenant_reads((READER, SOCKET_GID), "ls", state)
        assert rc != 0 and "Permission denied" in err, err
        rc, err = tenant_reads((READER, SOCKET_GID), "cat", state / "quantd.db")
        assert rc != 0 and "Permission denied" in err, err
        d.stop()
