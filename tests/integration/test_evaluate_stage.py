"""The evaluate stage (issue 13): a calibrated W4A4 job evaluates its output against the source on
held-out samples after verify, with the same code as `quantd evaluate`; a broken quality gate
fails the job with reason QUALITY_GATE and leaves the output on disk.

The daemon removes a SUCCEEDED job's work directory, so the figures are compared on a FAILED job,
whose work directory (job-<id>/evaluation.json, the task's output file) stays: they must equal
what `quantd evaluate --out` writes for the same spec, timings aside.
"""

import hashlib
import json

from conftest import REPO
from run_helpers import job_row, task_rows, write_spec

DATA = REPO / "tests" / "data" / "calibration_sample.jsonl"
CALIBRATION = {"datasets": [{"path": str(DATA), "samples": 8}], "seq_len": 48,
               "min_seq_len": 16}
RUN_FLAGS = ["--workers", 1, "--device", "cpu", "--threads", 1]


def spec_for(root, source, gate):
    root.mkdir(parents=True, exist_ok=True)
    return write_spec(root / "spec.json", source["dir"], root / "out", weight_format="nvfp4",
                      recipe="experts", calibration=CALIBRATION,
                      evaluate={"num_samples": 4, "gate": gate})


def without_timings(report):
    report = dict(report)
    report.pop("seconds", None)
    report["layers"] = [{k: v for k, v in layer.items() if not k.endswith("_seconds")}
                        for layer in report["layers"]]
    return report


def evaluate_task(state):
    return [row for (kind, _), row in task_rows(state).items() if kind == "evaluate"]


def test_calibrated_job_evaluates_and_succeeds(qd, source, tmp_path):
    spec = spec_for(tmp_path, source, {"max_mean_kl": 10})
    proc = qd.run("run", "--state", tmp_path / "state.db", *RUN_FLAGS, spec)
    assert proc.returncode == 0, proc.stderr
    assert job_row(tmp_path / "state.db") == [("SUCCEEDED", "", "")]
    [task] = evaluate_task(tmp_path / "state.db")
    assert task["state"] == "DONE"


def test_broken_gate_fails_with_quality_gate(qd, source, tmp_path):
    state = tmp_path / "state.db"
    spec = spec_for(tmp_path, source, {"max_mean_kl": 0})
    proc = qd.run("run", "--state", state, *RUN_FLAGS, spec)
    assert proc.returncode != 0
    [(job_state, reason, error)] = job_row(state)
    assert (job_state, reason) == ("FAILED", "QUALITY_GATE")
    assert "quality gate: mean_kl " in error and "> max_mean_kl 0" in error
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))  # output kept

    # The figures the stage wrote equal `quantd evaluate` on the same spec.
    [stored] = list((tmp_path / "state.db.work").glob("job-*/evaluation.json"))
    direct = tmp_path / "direct.json"
    cli = qd.run("evaluate", spec, "--out", direct, "--threads", 1)
    assert cli.returncode == 3, cli.stderr
    assert cli.stderr.strip().endswith(error.split("evaluate: ", 1)[-1])
    assert without_timings(json.loads(stored.read_text())) == \
        without_timings(json.loads(direct.read_text()))
