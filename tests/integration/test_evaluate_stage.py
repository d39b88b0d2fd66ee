"""The evaluate stage (issue 13): every W4A4 job that calibrates on data evaluates its output
against the source on held-out samples after verify, one task per decoder layer, then the head
and the gate, with the same steps as `quantd evaluate`; the figures are stored in SQLite with
each task's completion and reported by GetJobReport; a broken quality gate fails the job with
reason QUALITY_GATE after the figures were stored, and leaves the output on disk; a daemon killed
inside the stage resumes it to the figures of an uninterrupted run.

The jobs calibrate on 40 of the 44 lines of the built-in text, which leaves 4 held-out samples
(the default of 32 clamped to what the data holds).
"""

import json
import math
import signal
import sqlite3

import pytest

from conftest import REPO
from daemon import Daemon
from job_client import JobClient, RPC_TIMEOUT_S
from run_helpers import job_row, task_rows, write_spec

DATA = REPO / "tests" / "data" / "calibration_sample.jsonl"
CALIBRATION = {"datasets": [{"path": str(DATA), "samples": 40}], "seq_len": 48,
               "min_seq_len": 16}
RUN_FLAGS = ["--workers", 1, "--device", "cpu", "--threads", 1]
EVALUATE_TASKS = ["layer0", "layer1", "layer2", "head", "gate"]
FIGURES = ["samples", "tokens", "numerics", "positions", "mean_kl", "p99_kl", "max_kl",
           "top1_agreement", "source_ppl", "quantized_ppl", "ppl_ratio", "gate_passed",
           "gate_message"]


def spec_for(root, source, checkpoint_seconds=None, **evaluate):
    root.mkdir(parents=True, exist_ok=True)
    fields = {"evaluate": evaluate} if evaluate else {}
    calibration = dict(CALIBRATION)
    if checkpoint_seconds is not None:
        calibration["checkpoint_seconds"] = checkpoint_seconds
    return write_spec(root / "spec.json", source["dir"], root / "out", weight_format="nvfp4",
                      recipe="experts", calibration=calibration, **fields)


def stored(state):
    """The evaluation rows in SQLite: (layers by layer, the job's figures or None)."""
    con = sqlite3.connect(str(state))
    con.row_factory = sqlite3.Row
    try:
        layers = [dict(r) for r in con.execute(
            "SELECT layer, free_running_signal, free_running_noise, teacher_forced_signal, "
            "teacher_forced_noise FROM evaluation_layers ORDER BY layer")]
        figures = con.execute("SELECT * FROM evaluations").fetchone()
    finally:
        con.close()
    return layers, (dict(figures) if figures else None)


def db(signal_sum, noise_sum):
    return math.inf if noise_sum == 0 else 10 * math.log10(signal_sum / noise_sum)


def evaluate_tasks(state):
    return [(row["name"], row["state"]) for (kind, _), row in task_rows(state).items()
            if kind == "evaluate"]


def evaluate_attempts(state):
    return {row["name"]: row["attempt"] for (kind, _), row in task_rows(state).items()
            if kind == "evaluate"}


def work_files(state):
    """Whatever is left in the work directory (the jobs' own directories and their files)."""
    work = state.parent / (state.name + ".work")
    return sorted(str(p.relative_to(work)) for p in work.rglob("*")) if work.exists() else []


def test_calibrated_job_evaluates_by_default_and_succeeds(qd, source, tmp_path):
    state = tmp_path / "state.db"
    proc = qd.run("run", "--state", state, *RUN_FLAGS, spec_for(tmp_path, source))
    assert proc.returncode == 0, proc.stderr
    assert job_row(state) == [("SUCCEEDED", "", "")]
    assert evaluate_tasks(state) == [(name, "DONE") for name in EVALUATE_TASKS]
    layers, figures = stored(state)
    assert [l["layer"] for l in layers] == [0, 1, 2]
    assert figures["samples"] == 4 and figures["gate_passed"] == 1
    assert 0 <= figures["top1_agreement"] <= 1
    assert "evaluate" in proc.stderr  # its progress lines


def test_disabled_job_has_no_evaluate_stage(qd, source, tmp_path):
    state = tmp_path / "state.db"
    qd.run_ok("run", "--state", state, *RUN_FLAGS, spec_for(tmp_path, source, enabled=False))
    assert job_row(state) == [("SUCCEEDED", "", "")]
    assert evaluate_tasks(state) == []


def test_too_many_samples_fail_the_tokens_task_naming_the_file(qd, source, tmp_path):
    state = tmp_path / "state.db"
    proc = qd.run("run", "--state", state, *RUN_FLAGS, spec_for(tmp_path, source, num_samples=5))
    assert proc.returncode != 0
    [(job_state, _, error)] = job_row(state)
    assert job_state == "FAILED"
    assert f"{DATA} has 44 lines; calibration takes 40 of them" in error, error
    assert "set evaluate.enabled to false" in error
    # Planning reads no data: the tokens task, the first after inspect, refuses it before any
    # layer is calibrated (or any shard that waits for one quantized).
    rows = task_rows(state)
    assert rows[("calibrate", 0)]["name"] == "tokens", rows
    assert rows[("calibrate", 0)]["state"] == "FAILED", rows
    ran = {key for key, row in rows.items() if row["attempt"] > 0}
    assert {kind for kind, _ in ran} <= {"inspect", "calibrate", "quantize"}, ran
    assert [key for key in ran if key[0] == "calibrate"] == [("calibrate", 0)], ran


def test_broken_gate_fails_after_storing_the_figures_of_quantd_evaluate(qd, source, tmp_path):
    state = tmp_path / "state.db"
    spec = spec_for(tmp_path, source, gate={"max_mean_kl": 0})
    proc = qd.run("run", "--state", state, *RUN_FLAGS, spec)
    assert proc.returncode != 0
    [(job_state, reason, error)] = job_row(state)
    assert (job_state, reason) == ("FAILED", "QUALITY_GATE")
    assert "quality gate: mean_kl " in error and "> max_mean_kl 0" in error
    assert "; lowest teacher-forced SQNR at layer " in error
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))  # output kept
    # The head recorded the figures (the gate's verdict among them), then the gate failed.
    assert evaluate_tasks(state) == [(n, "DONE") for n in EVALUATE_TASKS[:-1]] + \
        [("gate", "FAILED")]
    layers, figures = stored(state)
    assert figures["gate_passed"] == 0 and error.endswith(figures["gate_message"])

    # The same figures as `quantd evaluate` on the same spec and output (the same steps).
    direct = tmp_path / "direct.json"
    cli = qd.run("evaluate", spec, "--out", direct, "--threads", 1)
    assert cli.returncode == 3, cli.stderr
    import json
    report = json.loads(direct.read_text())
    n = report["next_token"]
    assert (figures["samples"], figures["tokens"], figures["positions"]) == \
        (report["samples"], report["tokens"], n["positions"])
    for key in ["mean_kl", "p99_kl", "max_kl", "top1_agreement", "source_ppl", "quantized_ppl",
                "ppl_ratio"]:
        assert figures[key] == n[key], key
    for row, layer in zip(layers, report["layers"]):
        for kind in ["free_running", "teacher_forced"]:
            assert db(row[f"{kind}_signal"], row[f"{kind}_noise"]) == \
                pytest.approx(layer[f"{kind}_sqnr_db"], rel=1e-12), (row, layer)


def daemon_job(client, out, source, **calibration):
    return client.submit(source=str(source["dir"]), output=str(out), recipe="experts",
                         weight_format="nvfp4",
                         calibration={"datasets": [client.pb.CalibrationDataset(
                             path=str(DATA), samples=40)], "seq_len": 48, "min_seq_len": 16,
                             **calibration})


def report_of(client, job_id):
    return client.stub.GetJobReport(client.pb.GetJobReportRequest(id=job_id),
                                    timeout=RPC_TIMEOUT_S)


def figures_of(report):
    """What must not depend on how the job ran: every figure but the wall times."""
    e = report.evaluation
    return ({k: getattr(e, k) for k in FIGURES}, list(e.worst_layers),
            [(l.layer, l.evaluated, l.free_running_sqnr_db, l.teacher_forced_sqnr_db)
             for l in report.layers])


def run_in_daemon(qd, stubs, source, root, kill_at=None, **calibration):
    """A calibrating W4A4 job (its `calibration` fields added) through the daemon, killed with
    SIGKILL at `kill_at` and restarted when given; returns all snapshots watched after the restart
    and the report."""
    d = Daemon(qd.binary, root / "state", env={"QUANTD_TEST_KILL_AT": kill_at or ""})
    try:
        d.start()
        job = daemon_job(JobClient(stubs, d.channel()), root / "out", source, **calibration)
        if kill_at:
            assert d.wait(180) == -signal.SIGKILL, d.log()
            d.env = {}
            d.start()
        client = JobClient(stubs, d.channel())
        seen = list(client.stub.WatchJob(client.pb.WatchJobRequest(id=job.id), timeout=300))
        report = report_of(client, job.id)
        d.stop()
    finally:
        d.close()
    return seen, report


@pytest.fixture(scope="module")
def daemon_reference(qd, stubs, source, tmp_path_factory):
    return run_in_daemon(qd, stubs, source, tmp_path_factory.mktemp("evalstage-daemon"))


def test_daemon_reports_the_figures_of_a_calibrated_w4a4_job(stubs, daemon_reference):
    pb = stubs[0]
    seen, report = daemon_reference
    assert seen[-1].state == pb.SUCCEEDED, seen[-1]
    assert [s.kind for s in seen[-1].stages][-2:] == ["verify", "evaluate"]
    evaluate = [s for m in seen for s in m.stages if s.kind == "evaluate"]
    assert {s.unit for s in evaluate} == {"tokens"}
    assert {s.step for s in evaluate} <= {"", "layer 1 of 3", "layer 2 of 3", "layer 3 of 3",
                                          "head: next-token figures", "quality gate"}
    e = report.evaluation
    assert report.HasField("evaluation")
    assert (e.samples, e.numerics, e.gate_passed, e.gate_message) == (4, "official", True, "")
    assert e.tokens == e.positions > 4 * 16
    for figure in [e.mean_kl, e.p99_kl, e.max_kl, e.source_ppl, e.quantized_ppl, e.ppl_ratio]:
        assert math.isfinite(figure) and figure >= 0
    assert e.mean_kl <= e.p99_kl <= e.max_kl
    assert 0 <= e.top1_agreement <= 1
    assert 1 <= len(e.worst_layers) <= 3 and set(e.worst_layers) <= {0, 1, 2}
    assert e.seconds > 0 and e.calibration_seconds > 0
    assert [l.layer for l in report.layers] == [0, 1, 2]
    for layer in report.layers:
        assert layer.evaluated and layer.calibrated_tokens > 0  # calibration's fields kept
        assert math.isfinite(layer.free_running_sqnr_db)
        assert math.isfinite(layer.teacher_forced_sqnr_db)
    worst = report.layers[e.worst_layers[0]].teacher_forced_sqnr_db
    assert worst == min(l.teacher_forced_sqnr_db for l in report.layers)


# One worker runs the evaluate tasks in order (layer0, layer1, layer2, head, gate): killed right
# after layer 1 was recorded, and half way through layer 2's tokens. Every layer is checkpointed:
# the restart resumes after layer 1.
@pytest.mark.parametrize("kill_at", ["evaluate:2:done", "evaluate:3:mid"])
def test_daemon_killed_inside_the_stage_resumes_to_the_same_figures(qd, stubs, source,
                                                                    daemon_reference, tmp_path,
                                                                    kill_at):
    pb = stubs[0]
    seen, report = run_in_daemon(qd, stubs, source, tmp_path, kill_at, checkpoint_seconds=0)
    assert seen[-1].state == pb.SUCCEEDED, seen[-1]
    assert figures_of(report) == figures_of(daemon_reference[1])
    state = tmp_path / "state" / "quantd.db"
    attempts = evaluate_attempts(state)
    assert (attempts["layer0"], attempts["layer1"]) == (1, 1), attempts
    assert work_files(state) == []


def without_times(rows):
    layers, figures = rows
    return layers, {k: v for k, v in figures.items() if k not in ("seconds", "task_id")}


@pytest.fixture(scope="module")
def run_reference(qd, source, tmp_path_factory):
    reference = tmp_path_factory.mktemp("evalstage-run") / "state.db"
    qd.run_ok("run", "--state", reference, *RUN_FLAGS, spec_for(reference.parent, source))
    return stored(reference)


# Killed right after layer 1 was recorded. Every layer checkpointed (0): the restart resumes after
# layer 1, whose tasks up to it keep their first attempt. The default 300 s in a run this short
# checkpoints nothing: the stage runs again from layer 0.
@pytest.mark.parametrize("checkpoint_seconds,resumed,kept", [
    (0, "evaluation resumes after layer 1: the checkpointed outputs of both models", 1),
    (None, "to evaluate from layer 0", 2),
])
def test_run_killed_inside_the_stage_resumes_to_the_same_figures(qd, source, tmp_path,
                                                                 run_reference,
                                                                 checkpoint_seconds, resumed,
                                                                 kept):
    state = tmp_path / "killed" / "state.db"
    spec = spec_for(state.parent, source, checkpoint_seconds)
    proc = qd.run("run", "--state", state, *RUN_FLAGS, spec,
                  env_extra={"QUANTD_TEST_KILL_AT": "evaluate:2:done"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if checkpoint_seconds == 0:
        assert work_files(state) != []  # layer 1's checkpoint, at least
    proc = qd.run("run", "--state", state, *RUN_FLAGS, spec)
    assert proc.returncode == 0, proc.stderr
    assert resumed in proc.stderr
    attempts = evaluate_attempts(state)
    assert (attempts["layer0"], attempts["layer1"]) == (kept, kept), attempts
    assert without_times(stored(state)) == without_times(run_reference)
    assert work_files(state) == []


def test_a_job_planned_without_the_stage_resumes_on_its_plan(qd, source, tmp_path):
    """A calibrating job stored by a release without the evaluate stage (no "evaluate" in its
    spec, no evaluate task in its plan) resumes on that plan instead of being refused as a
    changed source."""
    state = tmp_path / "state.db"
    proc = qd.run("run", "--state", state, *RUN_FLAGS, spec_for(tmp_path, source, enabled=False),
                  env_extra={"QUANTD_TEST_KILL_AT": "calibrate:2:done"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    con = sqlite3.connect(str(state))  # what the earlier release stored
    spec = json.loads(con.execute("SELECT spec_json FROM jobs").fetchone()[0])
    spec.pop("evaluate")
    con.execute("UPDATE jobs SET spec_json = ?", (json.dumps(spec),))
    con.commit()
    con.close()
    proc = qd.run("run", "--state", state, *RUN_FLAGS, spec_for(tmp_path, source))
    assert proc.returncode == 0, proc.stderr
    assert job_row(state) == [("SUCCEEDED", "", "")]
    assert evaluate_tasks(state) == []
