"""Issue 19 item 2 ("Planning that cannot take the daemon down") and the config.json part of item
3 against the real daemon. Each attack is reproduced: a config.json claiming 400 000 layers (it
planned 1.2 million tasks for about a minute, took 2.6 GiB and left 614 MiB in the state dir) and
one whose dimensions the tensors contradict now fail fast naming config.json and the field; a plan
over --max-tasks-per-job and a planning over --planning-memory-bytes or
--planning-deadline-seconds fail the job, not the daemon; a daemon killed twice while planning a
job fails it with PLANNING_CRASHED instead of planning it forever; a planning wedged where no
budget sees it (QUANTD_TEST_PLANNING_STALL) neither keeps the next job from being planned once the
wedged one is cancelled, nor SIGTERM from stopping the daemon within its grace period.
"""

import json
import os
import sqlite3
import subprocess
import time

import grpc
import pytest

from conftest import REPO
from daemon import Daemon
from job_client import JobClient as Client

DATA = REPO / "tests" / "data" / "calibration_sample.jsonl"
CALIBRATE = {"weight_format": "nvfp4",
             "calibration": {"dataset": str(DATA), "num_samples": 8, "seq_len": 256}}


def edit_config(model, **fields):
    config = json.loads((model / "config.json").read_text())
    config.update(fields)
    (model / "config.json").write_text(json.dumps(config))


def peak_rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def tree_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def task_count(state_dir, job_id):
    con = sqlite3.connect(str(state_dir / "quantd.db"))
    try:
        return con.execute("SELECT COUNT(*) FROM tasks WHERE job_id = ?", (job_id,)).fetchone()[0]
    finally:
        con.close()


def wait_for_log(d, text, timeout=60):
    deadline = time.monotonic() + timeout
    while text not in d.log():
        assert time.monotonic() < deadline, f"no {text!r} in the log\n{d.log()}"
        time.sleep(0.05)


def test_a_config_claiming_400000_layers_fails_fast_and_stores_nothing(qd, stubs, model,
                                                                       tmp_path):
    edit_config(model, num_hidden_layers=400000, compress_ratios=[0] * 400001)
    state = tmp_path / "state"
    with Daemon(qd.binary, state) as d:
        client = Client(stubs, d.channel())
        start = time.monotonic()
        job = client.finish(client.submit(source=str(model), output=str(tmp_path / "out"),
                                          **CALIBRATE).id)
        took = time.monotonic() - start
        assert job.state == client.pb.FAILED, job
        assert job.last_error == (
            f'{model}/config.json: field "num_hidden_layers" is 400000, but the checkpoint has '
            "tensors of 3 decoder layers (layers.0 to layers.2)"), job
        assert took < 10, took
        assert peak_rss_mib(d.pid) < 300
        assert task_count(state, job.id) == 0
        assert not (state / "quantd.db.work" / f"job-{job.id}").exists()
        assert tree_bytes(state) < 2 << 20
        client.responsive(job.id)
        d.stop()


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 512,
     'field "hidden_size" gives 512 for layers.0.attn.wq_a.weight, which has shape [128, 256]'),
    ("n_routed_experts", 16,
     'field "n_routed_experts" gives 16 for layers.0.ffn.gate.weight, which has shape [8, 256]'),
    ("vocab_size", 2048,
     'field "vocab_size" gives 2048 for layers.0.ffn.gate.tid2eid, which has shape [1024, 2]'),
    ("moe_intermediate_size", 4096,
     'field "moe_intermediate_size" gives 4096 for layers.0.ffn.experts.0.w1.weight, which has '
     "shape [128, 256]"),
    ("hc_mult", 8,
     'field "hc_mult" gives 80 for layers.0.hc_attn_fn, which has shape [24, 1024]'),
])
def test_a_config_dimension_the_tensors_contradict_fails_naming_the_field(
        qd, stubs, model, tmp_path, field, value, message):
    edit_config(model, **{field: value})
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        job = client.finish(client.submit(source=str(model), output=str(tmp_path / "out")).id)
        assert job.state == client.pb.FAILED, job
        assert job.last_error == f"{model}/config.json: {message}", job
        assert not (tmp_path / "out").exists()
        d.stop()


def test_a_plan_over_the_task_cap_fails_the_job(qd, stubs, model, tmp_path):
    # The tiny fixture plans inspect 1, quantize 4, export 1, verify 4.
    with Daemon(qd.binary, tmp_path / "state", "--max-tasks-per-job", 5) as d:
        client = Client(stubs, d.channel())
        job = client.finish(client.submit(source=str(model), output=str(tmp_path / "out")).id)
        assert job.state == client.pb.FAILED, job
        assert job.last_error == (
            f"{model}: the plan holds more than 5 tasks (6 up to its export stage), more than one "
            "job may have (--max-tasks-per-job)"), job
        d.stop()


def test_planning_over_its_memory_budget_fails_the_job_not_the_daemon(qd, stubs, model,
                                                                      tmp_path):
    with Daemon(qd.binary, tmp_path / "state", "--planning-memory-bytes", 65536) as d:
        client = Client(stubs, d.channel())
        job = client.finish(client.submit(source=str(model), output=str(tmp_path / "out")).id)
        assert job.state == client.pb.FAILED, job
        assert job.reason == "PLANNING_LIMIT", job
        assert job.last_error.startswith(f"planning ran out of memory reading {model}"), job
        assert job.last_error.endswith(
            "(a job's planning may hold 65536 bytes: --planning-memory-bytes)"), job
        client.responsive(job.id)
        assert d.proc.poll() is None
        d.stop()


def test_planning_past_its_deadline_fails_the_job_and_the_next_one_runs(qd, stubs, model,
                                                                        tmp_path):
    with Daemon(qd.binary, tmp_path / "state", "--planning-deadline-seconds", 1,
                env={"QUANTD_TEST_PLANNING_STALL": "1:busy"}) as d:
        client = Client(stubs, d.channel())
        start = time.monotonic()
        job = client.finish(client.submit(source=str(model), output=str(tmp_path / "out")).id)
        assert time.monotonic() - start < 10
        assert job.state == client.pb.FAILED, job
        assert job.reason == "PLANNING_LIMIT", job
        assert job.last_error == (
            f"planning took longer than 1 s reading the source {model} or the job's inputs "
            "(--planning-deadline-seconds)"), job
        nxt = client.finish(client.submit(source=str(model), output=str(tmp_path / "out2")).id)
        assert nxt.state == client.pb.SUCCEEDED, nxt
        d.stop()


def test_a_daemon_killed_twice_while_planning_fails_the_job_planning_crashed(qd, stubs, model,
                                                                             tmp_path):
    d = Daemon(qd.binary, tmp_path / "state", env={"QUANTD_TEST_KILL_AT": "planning:1"})
    try:
        d.start()
        client = Client(stubs, d.channel())
        # The daemon plans the job (and kills itself) before it answers the submit.
        with pytest.raises(grpc.RpcError):
            client.submit(source=str(model), output=str(tmp_path / "out"))
        job_id = 1
        assert d.wait(60) == -9
        # The next start resumes the RUNNING job: planning it kills the process again, before it
        # serves.
        again = subprocess.run(d.cmd(), env={**os.environ, **d.env}, capture_output=True,
                               timeout=60)
        assert again.returncode == -9, again
        d.env = {}
        d.start()
        client = Client(stubs, d.channel())
        job = client.finish(job_id)
        assert job.state == client.pb.FAILED, job
        assert job.reason == "PLANNING_CRASHED", job
        assert job.last_error == (
            "planning this job was interrupted 2 times by a crash or a hang of quantd; it is not "
            "planned again (resume it to try once more)"), job
        # A resume plans it once more, and it runs.
        client.stub.ResumeJob(client.pb.ResumeJobRequest(id=job_id), timeout=10)
        job = client.finish(job_id)
        assert job.state == client.pb.SUCCEEDED, job
        d.stop()
    finally:
        d.close()


def test_cancel_frees_a_wedged_planning_and_sigterm_stops_the_daemon_within_its_grace(
        qd, stubs, model, tmp_path):
    with Daemon(qd.binary, tmp_path / "state", "--shutdown-grace-seconds", 2,
                env={"QUANTD_TEST_PLANNING_STALL": "1:stuck"}) as d:
        client = Client(stubs, d.channel())
        wedged = client.submit(source=str(model), output=str(tmp_path / "out")).id
        wait_for_log(d, f"job {wedged} state: RUNNING")
        client.stub.CancelJob(client.pb.CancelJobRequest(id=wedged), timeout=10)
        job = client.finish(wedged)
        assert job.state == client.pb.CANCELLED, job
        # Its planning thread is still wedged; the next job is planned on another one.
        nxt = client.finish(client.submit(source=str(model), output=str(tmp_path / "out2")).id)
        assert nxt.state == client.pb.SUCCEEDED, nxt
        third = client.submit(source=str(model), output=str(tmp_path / "out3")).id
        assert d.stop() < 2 + 3
        assert "job planning(s) did not stop within the grace period" in d.log()
        del third


def test_sigterm_stops_a_busy_planning_and_the_job_resumes_uncounted(qd, stubs, model, tmp_path):
    d = Daemon(qd.binary, tmp_path / "state", env={"QUANTD_TEST_PLANNING_STALL": "1:busy"})
    try:
        d.start()
        client = Client(stubs, d.channel())
        job_id = client.submit(source=str(model), output=str(tmp_path / "out")).id
        wait_for_log(d, f"job {job_id} state: RUNNING")
        assert d.stop() < 5
        assert "did not stop within the grace period" not in d.log()
        for _ in range(2):  # two more stops while planning would be a crash loop if counted
            d.start()
            wait_for_log(d, f"job {job_id} state: RUNNING")
            assert d.stop() < 10
        d.env = {}
        d.start()
        client = Client(stubs, d.channel())
        job = client.finish(job_id)
        assert job.state == client.pb.SUCCEEDED, job
        d.stop()
    finally:
        d.close()
