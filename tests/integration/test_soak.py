"""Soak (issue 14 §6): one `quantd serve` (daemon.Daemon, one CPU worker) under 300 pollers
(GetJob / ListJobs), 60 WatchJob streams and a driver that submits, cancels, pauses, resumes and
deletes jobs on the tiny fixture in a loop, for $QUANTD_SOAK_SECONDS (default 60;
tests/soak/run_soak.sh runs 600). Each client has its own channel from the harness; grpcio shares
one connection per target between channels with the same arguments, so these are 360 concurrent
callers over HTTP/2 streams rather than 360 sockets.

Pass: no RPC ends with a code outside the expected ones of its method (below), every job the
driver kept reaches a terminal state, the daemon stops cleanly at SIGTERM, and its resources are
bounded: open descriptors at the end at most FD_SLACK above the warmed-up count (every client
connection is still open at both points), resident memory at most RSS_SLACK above it. The board
and the database only hold the few jobs alive at a time (the driver deletes finished ones), so
neither should grow with the number of jobs run. The figures are printed (pytest -s shows them).
"""

import os
import random
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from daemon import Daemon, grpc_stubs
from ops_helpers import job_spec

SECONDS = float(os.environ.get("QUANTD_SOAK_SECONDS", "60"))
POLLERS = 300
WATCHERS = 60
LIVE_JOBS = 12          # the driver keeps at most this many jobs on the daemon
RPC_TIMEOUT_S = 30      # generous: 360 client threads share the machine with the daemon
WATCH_TIMEOUT_S = 120
FD_SLACK = 16           # descriptors the daemon may open for its own purposes (files of a job)
RSS_SLACK = 96 << 20    # allocator and SQLite page-cache slack over the warmed-up figure
# The codes each method may answer besides OK while jobs come and go under it.
EXPECTED = {
    "GetJob": {grpc.StatusCode.NOT_FOUND},
    "ListJobs": set(),
    "WatchJob": {grpc.StatusCode.NOT_FOUND},
    "SubmitJob": {grpc.StatusCode.RESOURCE_EXHAUSTED},
    "CancelJob": {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION},
    "ResumeJob": {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION},
    "DeleteJob": {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION},
}


def resources(pid):
    """(open descriptors, resident bytes) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return fds, int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class Tally:
    """RPC outcomes by (method, code name), and the unexpected ones with their details."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = Counter()
        self.unexpected = []

    def call(self, method, fn, *args, **kwargs):
        """fn(*args) -> its result, or None when it failed with an expected code."""
        try:
            result = fn(*args, **kwargs)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            result, code = None, e.code()
            if code not in EXPECTED[method]:
                with self.lock:
                    self.unexpected.append((method, code.name, e.details()))
        with self.lock:
            self.counts[(method, code.name)] += 1
        return result


def test_soak(qd, source, tmp_path):
    pb, pb_grpc = grpc_stubs(tmp_path / "stubs")
    out_root = tmp_path / "out"
    daemon = Daemon(qd.binary, tmp_path / "state", "--queue-limit", str(LIVE_JOBS))
    tally = Tally()
    stop = threading.Event()
    known = []                    # job ids the driver created and has not deleted
    known_lock = threading.Lock()
    with daemon:
        rng = random.Random(14)

        def any_job_id():
            with known_lock:
                return rng.choice(known) if known else 1

        def poller(stub, seed):
            r = random.Random(seed)
            while not stop.is_set():
                if r.random() < 0.8:
                    tally.call("GetJob", stub.GetJob, pb.GetJobRequest(id=any_job_id()),
                               timeout=RPC_TIMEOUT_S)
                else:
                    tally.call("ListJobs", stub.ListJobs, pb.ListJobsRequest(page_size=50),
                               timeout=RPC_TIMEOUT_S)
                stop.wait(r.uniform(0.5, 1.5))

        def watcher(stub):
            while not stop.is_set():
                def read():
                    for _ in stub.WatchJob(pb.WatchJobRequest(id=any_job_id()),
                                           timeout=WATCH_TIMEOUT_S):
                        if stop.is_set():
                            break
                    return True

                if tally.call("WatchJob", read) is None:
                    stop.wait(0.2)  # a deleted job: pick another one shortly

        driver_stub = pb_grpc.QuantServiceStub(daemon.channel())
        jobs_run = Counter()

        def submit(n):
            spec = job_spec(pb, source["dir"], out_root / f"job{n}")
            job = tally.call("SubmitJob", driver_stub.SubmitJob,
                             pb.SubmitJobRequest(request_id=f"soak-{n}", spec=spec),
                             timeout=RPC_TIMEOUT_S)
            if job is not None:
                with known_lock:
                    known.append(job.id)
                jobs_run["submitted"] += 1
            return job

        def delete_finished():
            with known_lock:
                ids = list(known)
            for job_id in ids:
                job = tally.call("GetJob", driver_stub.GetJob, pb.GetJobRequest(id=job_id),
                                 timeout=RPC_TIMEOUT_S)
                if job is None or job.state not in (pb.SUCCEEDED, pb.FAILED, pb.CANCELLED):
                    continue
                if tally.call("DeleteJob", driver_stub.DeleteJob,
                              pb.DeleteJobRequest(id=job_id), timeout=RPC_TIMEOUT_S) is not None:
                    with known_lock:
                        known.remove(job_id)
                    shutil.rmtree(job.spec.output, ignore_errors=True)
                    jobs_run[pb.JobState.Name(job.state)] += 1

        def pause_and_resume(job_id):
            """Pauses the job once it runs (a tiny job runs for a fraction of a second, so the
            pause may come too late), then resumes it once PAUSED."""
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                job = tally.call("GetJob", driver_stub.GetJob, pb.GetJobRequest(id=job_id),
                                 timeout=RPC_TIMEOUT_S)
                if job is None or job.state != pb.PENDING:
                    break
                time.sleep(0.02)
            tally.call("CancelJob", driver_stub.CancelJob,
                       pb.CancelJobRequest(id=job_id, pause=True), timeout=RPC_TIMEOUT_S)
            while time.monotonic() < deadline:
                job = tally.call("GetJob", driver_stub.GetJob, pb.GetJobRequest(id=job_id),
                                 timeout=RPC_TIMEOUT_S)
                if job is None or job.state != pb.RUNNING:
                    break
                time.sleep(0.02)
            if job is not None and job.state == pb.PAUSED:
                jobs_run["paused"] += 1
                tally.call("ResumeJob", driver_stub.ResumeJob, pb.ResumeJobRequest(id=job_id),
                           timeout=RPC_TIMEOUT_S)

        def driver():
            n = 0
            while not stop.is_set():
                n += 1
                job = submit(n)
                action = rng.random()
                if job is not None and action < 0.25:
                    tally.call("CancelJob", driver_stub.CancelJob,
                               pb.CancelJobRequest(id=job.id), timeout=RPC_TIMEOUT_S)
                elif job is not None and action < 0.5:
                    pause_and_resume(job.id)
                delete_finished()
                stop.wait(0.1)

        threads = []
        for i in range(POLLERS):
            stub = pb_grpc.QuantServiceStub(daemon.channel())
            threads.append(threading.Thread(target=poller, args=(stub, i), daemon=True))
        for _ in range(WATCHERS):
            stub = pb_grpc.QuantServiceStub(daemon.channel())
            threads.append(threading.Thread(target=watcher, args=(stub,), daemon=True))
        threads.append(threading.Thread(target=driver, daemon=True))
        idle = resources(daemon.pid)
        for t in threads:
            t.start()
        # Warmed up: every connection open and a tenth of the run (at least 5 s) behind us.
        time.sleep(max(5.0, SECONDS / 10))
        warm = resources(daemon.pid)
        time.sleep(max(0.0, SECONDS - max(5.0, SECONDS / 10)))
        end = resources(daemon.pid)
        stop.set()
        for t in threads:
            t.join(timeout=WATCH_TIMEOUT_S + RPC_TIMEOUT_S)
            assert not t.is_alive(), "a client thread did not stop"
        # The jobs left reach a terminal state (a paused one is cancelled), then go.
        deadline = time.monotonic() + 120
        while known and time.monotonic() < deadline:
            with known_lock:
                ids = list(known)
            for job_id in ids:
                job = tally.call("GetJob", driver_stub.GetJob, pb.GetJobRequest(id=job_id),
                                 timeout=RPC_TIMEOUT_S)
                if job is not None and job.state == pb.PAUSED:
                    tally.call("CancelJob", driver_stub.CancelJob,
                               pb.CancelJobRequest(id=job_id), timeout=RPC_TIMEOUT_S)
            delete_finished()
            time.sleep(0.2)
        assert not known, f"jobs not finished 120 s after the soak: {known}"
        stop_seconds = daemon.stop()

    summary = {f"{m} {c}": n for (m, c), n in sorted(tally.counts.items())}
    print(f"\nsoak {SECONDS:.0f} s: {POLLERS} pollers, {WATCHERS} watchers; jobs {dict(jobs_run)}")
    print(f"RPCs: {summary}")
    print(f"daemon fds / RSS: idle {idle[0]} / {idle[1] >> 20} MiB, warm {warm[0]} / "
          f"{warm[1] >> 20} MiB, end {end[0]} / {end[1] >> 20} MiB; stop {stop_seconds:.2f} s")
    assert not tally.unexpected, tally.unexpected[:20]
    assert jobs_run["submitted"] >= 3 and jobs_run["SUCCEEDED"] >= 1, jobs_run
    assert sum(n for (m, c), n in tally.counts.items() if m == "GetJob") >= POLLERS, summary
    assert end[0] <= warm[0] + FD_SLACK, (idle, warm, end)
    assert end[1] <= warm[1] + RSS_SLACK, (idle, warm, end)
