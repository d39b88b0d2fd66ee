"""Remote workers (issue 22 items 1, 2, 5): a coordinator with `--devices none` (no local worker)
and `quantd worker` processes on loopback TCP with a worker token.

- two or three workers run the tiny fixture's W4A16 job and an NVFP4 job with an amax file to
  SUCCEEDED, output bytes equal to `quantd run` of the same spec; `quantctl workers` lists them,
  `quantctl report` names the worker that ran each task and `quantctl get` each stage's workers;
- a worker killed (SIGKILL) in the middle of a quantize task: the job finishes on the other one,
  byte-identical, no .tmp left, and the report names the other as the runner of the retry;
- a worker frozen (SIGSTOP) after writing its output, past its lease, while another one finishes
  the task: its late completion is refused (logged, counted), the output is the other's;
- a job whose stages keep state between tasks (calibration) fails with reason NO_WORKER on a
  coordinator without local workers; a job submitted before any worker registered waits for one;
- only the worker role may call WorkerService, and it may call nothing else; a `quantd worker`
  with a reader, admin, wrong or no token stops with exit code 1.
"""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from daemon import Daemon

RPC_TIMEOUT_S = 10
JOB_TIMEOUT_S = 180
LEASE_SECONDS = "1"
SPEC = {"recipe": "experts", "weight_format": "w4a16_nvfp4", "expert_cast": "lossless",
        "export_format": "modelopt"}
WORKER_TOKEN = "worker-token-0123456789abcdef"
READER_TOKEN = "reader-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_file(path, text):
    path.write_text(text)
    path.chmod(0o600)
    return path


def tree(out):
    """{relative name: bytes} of every file of an output directory but quantd's marker."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != ".quantd-job"}


@pytest.fixture(scope="module")
def quantctl(qd):
    binary = Path(qd.binary).parents[1] / "client" / "quantctl"
    assert binary.is_file(), f"{binary} is missing: build quantctl first"
    return binary


@pytest.fixture(scope="module")
def reference(qd, source, tmp_path_factory):
    """reference(**fields) -> the files of `quantd run` of SPEC (updated by fields) on the tiny
    fixture."""
    made = {}

    def get(**fields):
        key = json.dumps(fields, sort_keys=True)
        if key not in made:
            root = tmp_path_factory.mktemp("reference")
            spec = {"source": str(source["dir"]), "output": str(root / "out"), **SPEC, **fields}
            (root / "spec.json").write_text(json.dumps(spec))
            qd.run_ok("run", "--state", root / "state.db", "--device", "cpu", root / "spec.json")
            made[key] = tree(root / "out")
        return made[key]

    return get


@pytest.fixture
def cluster(qd, tmp_path):
    """A coordinator (--devices none, loopback TCP, an admin, a reader and a worker token) and
    worker processes started with cluster["worker"](name, env=...)."""
    root = tmp_path
    tokens = {"admin": private_file(root / "admin.token", ADMIN_TOKEN),
              "reader": private_file(root / "reader.token", READER_TOKEN),
              "worker": private_file(root / "worker.token", WORKER_TOKEN),
              "wrong": private_file(root / "wrong.token", "not-a-token-quantd-knows-0123")}
    (root / "access.json").write_text(json.dumps({"callers": [
        {"token_file": str(tokens["reader"]), "role": "reader"},
        {"token_file": str(tokens["worker"]), "role": "worker"}]}))
    # A fixed port: workers find a restarted coordinator at the same address.
    d = Daemon(qd.binary, root / "state", "--listen", f"127.0.0.1:{free_port()}", "--token-file",
               tokens["admin"], "--access-config", root / "access.json", "--lease-seconds",
               LEASE_SECONDS, devices="none", metrics_listen="127.0.0.1:0")
    d.start()
    workers = []

    def worker(name, env=None, token="worker"):
        full_env = dict(os.environ)
        full_env.pop("QUANTD_TEST_KILL_AT", None)
        full_env.update(env or {})
        args = [qd.binary, "worker", "--coordinator", d.tcp_address, "--name", name,
                "--cpu-threads", "1"]
        if token is not None:
            args += ["--token-file", tokens[token]]
        log = open(root / f"{name}.log", "wb")
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=full_env)
        proc.log_path = root / f"{name}.log"
        workers.append(proc)
        return proc

    yield {"daemon": d, "worker": worker, "tokens": tokens, "root": root}
    for proc in workers:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    d.close()


def bearer(path):
    return (("authorization", "Bearer " + Path(path).read_text().strip()),)


def worker_log(proc):
    return proc.log_path.read_text(errors="replace")


def wait_registered(stubs, cluster, names):
    pb, pb_grpc = stubs
    channel = cluster["daemon"].channel()
    stub = pb_grpc.QuantServiceStub(channel)
    deadline = time.monotonic() + 30
    while True:
        listed = stub.ListWorkers(pb.ListWorkersRequest(), timeout=RPC_TIMEOUT_S)
        if sorted(w.name for w in listed.workers) == sorted(names):
            return listed
        assert time.monotonic() < deadline, (listed, cluster["daemon"].log())
        time.sleep(0.05)


def submit(stubs, cluster, out, **fields):
    pb, pb_grpc = stubs
    stub = pb_grpc.QuantServiceStub(cluster["daemon"].channel())
    spec = pb.JobSpec(output=str(out), **{**SPEC, **fields})
    return stub, stub.SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=RPC_TIMEOUT_S)


def wait_job(stubs, stub, job_id, states=("SUCCEEDED", "FAILED", "CANCELLED")):
    pb, _ = stubs
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        job = stub.GetJob(pb.GetJobRequest(id=job_id), timeout=RPC_TIMEOUT_S)
        if pb.JobState.Name(job.state) in states:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def metric(daemon, line_start):
    text = urllib.request.urlopen(f"http://{daemon.info['metrics_listen']}/metrics",
                                  timeout=RPC_TIMEOUT_S).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(line_start + " ")]
    return values[0] if values else None


def stopped(pid):
    """Whether the process is stopped (SIGSTOP): its /proc stat state is T."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


@pytest.mark.parametrize("workers,fields", [
    (3, {}),
    (2, {"weight_format": "nvfp4", "calibration": {"amax_file": "AMAX"}}),
], ids=["w4a16-3-workers", "nvfp4-amax-file-2-workers"])
def test_workers_run_a_job_byte_identical_to_quantd_run(cluster, stubs, source, reference,
                                                        tmp_path, quantctl, workers, fields):
    pb, _ = stubs
    if "calibration" in fields:
        fields = {**fields, "calibration": {"amax_file": str(source["amax"])}}
    names = [f"w{i}" for i in range(workers)]
    procs = [cluster["worker"](name) for name in names]
    wait_registered(stubs, cluster, names)
    proto_fields = dict(fields)
    calibration = proto_fields.pop("calibration", None)
    if calibration is not None:
        proto_fields["calibration"] = pb.CalibrationSpec(**calibration)
    stub, job = submit(stubs, cluster, tmp_path / "out", source=str(source["dir"]),
                       **proto_fields)
    done = wait_job(stubs, stub, job.id)
    assert pb.JobState.Name(done.state) == "SUCCEEDED", (done, cluster["daemon"].log())
    assert tree(tmp_path / "out") == reference(**fields)
    assert not list((tmp_path / "out").glob("*.tmp"))
    listed = wait_registered(stubs, cluster, names)
    assert sum(w.tasks_leased for w in listed.workers) == done.task_attempts
    assert all(len(w.devices) == 1 and w.devices[0].name == "cpu" for w in listed.workers)
    table = subprocess.run([quantctl, "--server", cluster["daemon"].address, "workers"],
                           capture_output=True, text=True, timeout=30)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ADDRESS", "DEVICES", "TASK", "LEASED", "LAST", "SEEN"]
    assert sorted(line.split()[0] for line in lines[1:]) == names
    assert metric(cluster["daemon"], "quantd_workers_connected") == workers
    for proc in procs:
        assert proc.poll() is None, worker_log(proc)
        # Each worker opened the job once, however many of its tasks it ran.
        assert worker_log(proc).count("opened job") <= 1, worker_log(proc)
    runs = ran_by(quantctl, cluster, job.id)
    assert len(runs) == sum(s.tasks_total for s in done.stages)
    assert {worker for _, _, _, worker in runs} <= set(names)
    assert per_stage_workers(quantctl, cluster, job.id) == {
        stage: counted([worker for s, _, _, worker in runs if s == stage])
        for stage in {s for s, _, _, _ in runs}}


def ran_by(quantctl, cluster, job_id):
    """[(stage, task, attempt, worker)] of `quantctl report`'s table of who ran the tasks."""
    proc = subprocess.run([quantctl, "--server", cluster["daemon"].address, "report",
                           str(job_id)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = lines.index("tasks: who ran them (local: this quantd)")
    assert lines[start + 1].split() == ["STAGE", "TASK", "ATTEMPT", "RESULT", "RAN", "BY"]
    runs = []
    for line in lines[start + 2:]:
        if not line:
            break
        words = line.split()  # a task's label may hold spaces; stages and workers do not
        stage, task, (attempt, result, worker) = words[0], " ".join(words[1:-3]), words[-3:]
        assert result == "done", line
        runs.append((stage, task, int(attempt), worker))
    return runs


def counted(workers):
    """"a (3), b (2)": each worker with how many of the tasks it ran, by name."""
    return ", ".join(f"{w} ({workers.count(w)})" for w in sorted(set(workers)))


def per_stage_workers(quantctl, cluster, job_id):
    """{stage: "a (3), b (2)"} of `quantctl get`: the workers line under each stage line."""
    proc = subprocess.run([quantctl, "--server", cluster["daemon"].address, "get", str(job_id)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    out = {}
    for above, line in zip(lines, lines[1:]):
        if line.startswith("           workers: "):
            out[above.split()[0]] = line[len("           workers: "):]
    return out


def test_a_killed_worker_s_task_finishes_on_another_byte_identical(cluster, stubs, source,
                                                                    reference, tmp_path,
                                                                    quantctl):
    pb, _ = stubs
    doomed = cluster["worker"]("doomed", env={"QUANTD_TEST_KILL_AT": "quantize:1:mid"})
    wait_registered(stubs, cluster, ["doomed"])
    stub, job = submit(stubs, cluster, tmp_path / "out", source=str(source["dir"]))
    assert doomed.wait(timeout=60) == -signal.SIGKILL, worker_log(doomed)
    cluster["worker"]("survivor")
    done = wait_job(stubs, stub, job.id)
    assert pb.JobState.Name(done.state) == "SUCCEEDED", (done, cluster["daemon"].log())
    assert tree(tmp_path / "out") == reference()
    assert not list((tmp_path / "out").glob("*.tmp"))
    # The killed attempt lost its lease and was tried again: one attempt more than tasks.
    tasks = sum(s.tasks_total for s in done.stages)
    assert done.task_attempts == tasks + 1, done
    # `quantctl report` names the survivor as the runner of the task's second attempt.
    runs = ran_by(quantctl, cluster, job.id)
    assert len(runs) == tasks
    assert [(stage, worker) for stage, _, attempt, worker in runs if attempt == 2] == [
        ("quantize", "survivor")], runs
    assert {worker for _, _, _, worker in runs} <= {"doomed", "survivor"}
    assert metric(cluster["daemon"], "quantd_lease_expiries_total") == 1


def test_workers_outlive_a_coordinator_killed_and_restarted(cluster, stubs, source, reference,
                                                            tmp_path):
    pb, _ = stubs
    d = cluster["daemon"]
    d.close()  # started by the fixture; again with the hook below
    d.env = {"QUANTD_TEST_KILL_AT": "quantize:2:done"}
    d.start()
    procs = [cluster["worker"](name) for name in ("w0", "w1")]
    wait_registered(stubs, cluster, ["w0", "w1"])
    stub, job = submit(stubs, cluster, tmp_path / "out", source=str(source["dir"]))
    assert d.wait(60) == -signal.SIGKILL, d.log()
    d.env = {}
    d.start()
    wait_registered(stubs, cluster, ["w0", "w1"])  # they registered again
    stub = stubs[1].QuantServiceStub(d.channel())
    done = wait_job(stubs, stub, job.id)
    assert pb.JobState.Name(done.state) == "SUCCEEDED", (done, d.log())
    assert tree(tmp_path / "out") == reference()
    assert not list((tmp_path / "out").glob("*.tmp"))
    for proc in procs:
        assert proc.poll() is None, worker_log(proc)
        assert "registered as" in worker_log(proc)


def test_a_late_completion_of_a_lost_lease_is_refused(cluster, stubs, source, reference,
                                                      tmp_path):
    pb, _ = stubs
    frozen = cluster["worker"]("frozen", env={"QUANTD_TEST_STOP_AT": "quantize:1:written"})
    wait_registered(stubs, cluster, ["frozen"])
    stub, job = submit(stubs, cluster, tmp_path / "out", source=str(source["dir"]))
    deadline = time.monotonic() + 60
    while not stopped(frozen.pid):
        assert frozen.poll() is None and time.monotonic() < deadline, worker_log(frozen)
        time.sleep(0.05)
    cluster["worker"]("finisher")
    done = wait_job(stubs, stub, job.id)
    assert pb.JobState.Name(done.state) == "SUCCEEDED", (done, cluster["daemon"].log())
    os.kill(frozen.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while metric(cluster["daemon"], 'quantd_worker_stale_calls_total{call="complete"}') != 1:
        assert time.monotonic() < deadline, (worker_log(frozen), cluster["daemon"].log())
        time.sleep(0.05)
    assert "refused: the attempt lost its lease" in cluster["daemon"].log()
    assert "the coordinator refused it" in worker_log(frozen)
    assert tree(tmp_path / "out") == reference()
    tasks = sum(s.tasks_total for s in done.stages)
    assert done.task_attempts == tasks + 1, done
    # The finishing worker's attempt is the one recorded.
    report = stub.GetJob(pb.GetJobRequest(id=job.id), timeout=RPC_TIMEOUT_S)
    assert pb.JobState.Name(report.state) == "SUCCEEDED"


def test_a_calibrating_job_fails_no_worker_without_local_devices(cluster, stubs, source,
                                                                 tmp_path):
    pb, _ = stubs
    cluster["worker"]("w0")
    wait_registered(stubs, cluster, ["w0"])
    data = Path(__file__).resolve().parents[1] / "data" / "calibration_sample.jsonl"
    stub, job = submit(stubs, cluster, tmp_path / "out", source=str(source["dir"]),
                       weight_format="nvfp4",
                       calibration=pb.CalibrationSpec(dataset=str(data), num_samples=8,
                                                      seq_len=256, min_seq_len=16))
    done = wait_job(stubs, stub, job.id)
    assert pb.JobState.Name(done.state) == "FAILED", done
    assert (done.reason, done.last_error) == (
        "NO_WORKER",
        "this quantd runs no local worker (--devices none), and remote workers run only jobs "
        "whose stages keep no state between tasks; run this job on a quantd with devices"), done


def test_a_job_waits_for_its_first_worker_however_long(cluster, stubs, source, reference,
                                                       tmp_path):
    # Issue 22 item 1: with no worker registered a job waits (the "jobs queued, no worker
    # connected" alert is for that); it fails NO_WORKER only when registered workers cannot run
    # a runnable task (tests/unit/scheduler_fake_clock_test.cc: no stage that runs remotely
    # needs more than a worker's device yet).
    pb, _ = stubs
    stub, job = submit(stubs, cluster, tmp_path / "out", source=str(source["dir"]))
    time.sleep(4 * float(LEASE_SECONDS))  # past the leases after which a rule could judge it
    waiting = stub.GetJob(pb.GetJobRequest(id=job.id), timeout=RPC_TIMEOUT_S)
    assert pb.JobState.Name(waiting.state) == "RUNNING", waiting
    assert waiting.task_attempts == 0, waiting
    assert metric(cluster["daemon"], "quantd_workers_connected") == 0
    cluster["worker"]("late")
    done = wait_job(stubs, stub, job.id)
    assert pb.JobState.Name(done.state) == "SUCCEEDED", (done, cluster["daemon"].log())
    assert tree(tmp_path / "out") == reference()


def test_only_the_worker_role_calls_worker_service(cluster, stubs):
    pb, pb_grpc = stubs
    d = cluster["daemon"]
    channel = grpc.insecure_channel(d.tcp_address)
    workers = pb_grpc.WorkerServiceStub(channel)
    quant = pb_grpc.QuantServiceStub(channel)
    request = pb.RegisterWorkerRequest(
        name="probe", devices=[pb.WorkerDevice(name="cpu", gpu=False, memory_bytes=1 << 30)])
    tokens = cluster["tokens"]

    def refused(call, metadata):
        with pytest.raises(grpc.RpcError) as info:
            call(metadata=metadata, timeout=RPC_TIMEOUT_S)
        return (info.value.code(), dict(info.value.trailing_metadata() or ()).get("quantd-reason"),
                info.value.details())

    register = lambda **kw: workers.Register(request, **kw)  # noqa: E731
    assert refused(register, ()) [:2] == (grpc.StatusCode.UNAUTHENTICATED, "NOT_AUTHENTICATED")
    assert refused(register, bearer(tokens["wrong"]))[:2] == (
        grpc.StatusCode.UNAUTHENTICATED, "NOT_AUTHENTICATED")
    assert refused(register, bearer(tokens["reader"])) == (
        grpc.StatusCode.PERMISSION_DENIED, "WORKER_ONLY",
        f"WorkerService.Register needs the worker role; the token of {tokens['reader']} is a "
        "reader")
    assert refused(register, bearer(tokens["admin"])) == (
        grpc.StatusCode.PERMISSION_DENIED, "WORKER_ONLY",
        f"WorkerService.Register needs the worker role; the token of {tokens['admin']} is an "
        "admin")
    # The admin on the unix socket cannot either.
    unix = pb_grpc.WorkerServiceStub(d.channel())
    code, why, _ = refused(lambda **kw: unix.Register(request, **kw), ())
    assert (code, why) == (grpc.StatusCode.PERMISSION_DENIED, "WORKER_ONLY")
    # A worker may register, and call nothing of QuantService.
    answer = workers.Register(request, metadata=bearer(tokens["worker"]), timeout=RPC_TIMEOUT_S)
    assert answer.worker_id and answer.lease_ms == 1000
    list_jobs = lambda **kw: quant.ListJobs(pb.ListJobsRequest(), **kw)  # noqa: E731
    assert refused(list_jobs, bearer(tokens["worker"])) == (
        grpc.StatusCode.PERMISSION_DENIED, "WORKER_ROLE",
        f"ListJobs: the token of {tokens['worker']} has the worker role, which may call "
        "quantd.v1.WorkerService only")
    # Hostile fields are refused naming the field, never quoting it.
    bad = pb.RegisterWorkerRequest(name="x" * 129, devices=request.devices)
    assert refused(lambda **kw: workers.Register(bad, **kw), bearer(tokens["worker"])) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "name: must be 1 to 128 bytes, got 129")
    # "local" is quantctl's name for the daemon's own tasks: no worker can pass for it.
    local = pb.RegisterWorkerRequest(name="local", devices=request.devices)
    assert refused(lambda **kw: workers.Register(local, **kw), bearer(tokens["worker"])) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST",
        "name: \"local\" is how quantctl names the daemon's own work; choose another")
    lease = pb.LeaseTaskRequest(worker_id=answer.worker_id, device=0, wait_ms=30001)
    assert refused(lambda **kw: workers.Lease(lease, **kw), bearer(tokens["worker"])) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST",
        "wait_ms: must be in [0, 30000], got 30001")
    sha = "ab" * 32
    for fields, message in [
            ({"output_path": "out/x.safetensors", "output_sha256": sha},
             "output_path: must be absolute"),
            ({"output_path": "/o/x", "output_sha256": sha[:-2]},
             "output_sha256: must be 64 hex digits, got 62 bytes"),
            ({"output_path": "/o/x", "output_sha256": sha.upper()},
             "output_sha256: must be lowercase hex digits"),
            ({"output_path": "/o/x", "output_sha256": sha, "output_bytes": -1},
             "output_bytes: must be >= 0, got -1"),
            ({"stats": [pb.TensorStats(tensor="w", rel_rmse=float("nan"))]},
             "stats[0]: rel_rmse and max_abs_err must be >= 0, and nothing NaN")]:
        complete = pb.CompleteTaskRequest(worker_id=answer.worker_id, task_id=5, attempt=1,
                                          **fields)
        assert refused(lambda **kw: workers.Complete(complete, **kw), bearer(tokens["worker"])) == (
            grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", message), fields
    renew = pb.RenewLeaseRequest(worker_id=answer.worker_id, task_id=5, attempt=1)
    assert refused(lambda **kw: workers.Renew(renew, **kw), bearer(tokens["worker"]))[:2] == (
        grpc.StatusCode.FAILED_PRECONDITION, "LEASE_LOST")
    channel.close()


@pytest.mark.parametrize("token,message", [
    ("reader", "needs the worker role"),
    ("admin", "needs the worker role"),
    ("wrong", "the bearer token is not one quantd knows"),
    (None, "no credentials"),
])
def test_a_worker_without_the_worker_role_stops(cluster, token, message):
    proc = cluster["worker"]("intruder", token=token)
    assert proc.wait(timeout=30) == 1, worker_log(proc)
    assert message in worker_log(proc)
