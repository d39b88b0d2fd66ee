"""The calibrate stage (issue 12): a W4A4 job with calibration data calibrates layer by layer
inside the engine (`quantd run` and the daemon), then quantizes with input_scale = amax / 2688.

The tiny DeepSeek-V4 fixture ships a byte-level tokenizer (one token per byte, ids within its
vocabulary), so the jobs tokenize the built-in calibration text without folding ids. Every run is
compared with `quantd calibrate` (the same code path outside the engine) and with the amax rows the
tasks recorded in SQLite (table task_amax, merged as JobStore::ListAmax merges them).
"""

import json
import re
import signal
import sqlite3
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors import safe_open

from conftest import REPO
from daemon import Daemon
from run_helpers import job_row, task_rows, tree_hashes, write_spec

DATA = REPO / "tests" / "data" / "calibration_sample.jsonl"
# seq_len 256 leaves the samples at different lengths: several batches, so both slices work.
CALIBRATION = {"datasets": [{"path": str(DATA), "samples": 8}], "seq_len": 256,
               "min_seq_len": 16}
RUN_FLAGS = ["--device", "cpu", "--threads", "1"]
W2_BOUND = 10 * 10 / (1 + np.exp(-10.0)) * (1 + 1 / 256)


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def input_scales(out):
    """module -> input_scale of every NVFP4 module of the output."""
    scales = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if name.endswith(".input_scale"):
                    scales[name[: -len(".input_scale")]] = f.get_tensor(name).item()
    return scales


def stored_amax(state):
    """module -> (amax, tokens) as JobStore::ListAmax merges the task rows."""
    con = sqlite3.connect(str(state))
    try:
        rows = con.execute("SELECT module, MAX(value), SUM(samples) FROM task_amax "
                           "GROUP BY module ORDER BY module").fetchall()
    finally:
        con.close()
    return {m: (v, n) for m, v, n in rows}


def job_dirs(state):
    """The jobs' own directories (job-<id>) in the work directory: only a job that can still
    resume (PAUSED, FAILED) keeps one."""
    work = state.parent / (state.name + ".work")
    return sorted(p.name for p in work.glob("job-*")) if work.exists() else []


def leftovers(state):
    """Files left in the job's work directory besides the stored tokens."""
    work = state.parent / (state.name + ".work")
    return sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.name != "tokens.bin"
                  and not (p.is_dir() and p.name.startswith("job-")))


CHECKPOINT = re.compile(r"job-\d+/calibrate-layers/layer(\d+)\.slice\d+\.(json|batch\d+\.safetensors)")


def checkpointed_layers(state):
    """The layers whose checkpoint files (calibration/layer_checkpoint.h) are in the work
    directory; asserts that nothing else but spill directories and files is there."""
    layers = set()
    for p in leftovers(state):
        m = CHECKPOINT.fullmatch(p)
        if m:
            layers.add(int(m.group(1)))
        else:
            assert re.fullmatch(r"job-\d+/(calibrate-layers|spill-[\d-]+(/.*)?)", p), p
    return layers


def layer_attempts(state):
    """layer -> sorted attempts of its calibrate tasks, all DONE."""
    attempts = {}
    for (kind, _), r in task_rows(state).items():
        m = re.fullmatch(r"layer(\d+)\.slice\d+", r["name"])
        if kind == "calibrate" and m:
            assert r["state"] == "DONE", r
            attempts.setdefault(int(m.group(1)), []).append(r["attempt"])
    return {layer: sorted(a) for layer, a in attempts.items()}


class Job:
    def __init__(self, qd, source, root, workers=2, **calibration):
        root.mkdir(parents=True, exist_ok=True)
        self.qd, self.root = qd, root
        self.out, self.state, self.amax = root / "out", root / "state.db", root / "amax.json"
        # Evaluation is tested in test_evaluate_stage.py.
        fields = {"weight_format": "nvfp4", "recipe": "experts",
                  "calibration": {**CALIBRATION, "amax_out": str(self.amax), **calibration},
                  "evaluate": {"enabled": False}}
        host = fields["calibration"].pop("host_memory_bytes", None)
        if host is not None:
            fields["host_memory_bytes"] = host
        self.spec = write_spec(root / "spec.json", source["dir"], self.out, **fields)
        self.workers = workers

    def run(self, kill_at=None):
        env = {"QUANTD_TEST_KILL_AT": kill_at} if kill_at else None
        return self.qd.run("run", "--state", self.state, "--workers", self.workers, *RUN_FLAGS,
                           self.spec, env_extra=env)

    def run_ok(self):
        proc = self.run()
        assert proc.returncode == 0, proc.stderr
        assert job_row(self.state) == [("SUCCEEDED", "", "")]
        return proc

    def result(self):
        return {"out": tree_hashes(self.out), "amax": self.amax.read_bytes(),
                "rows": stored_amax(self.state)}


@pytest.fixture(scope="module")
def reference(qd, source, tmp_path_factory):
    """An uninterrupted `quantd run` with the default export options (2 workers, 2 slices)."""
    job = Job(qd, source, tmp_path_factory.mktemp("calstage") / "reference")
    job.run_ok()
    return job


def check_export(job, calibration):
    """input_scale == amax_out / 2688 for every NVFP4 module, and amax_out == the export of the
    stored rows under the job's options."""
    amax = json.loads(job.amax.read_text())
    rows = job.result()["rows"]
    scales = input_scales(job.out)
    assert len(scales) == 72  # every routed expert projection of the 3 layers x 8 experts
    for module, scale in scales.items():
        assert np.float32(scale) == np.float32(amax[module]) / np.float32(2688), module
        assert 0 < scale and np.isfinite(scale)
    w2_input = calibration.get("w2_input", "max")
    per_layer = calibration.get("expert_amax", "per_expert") == "layer_max"
    layer_max = {}
    for module in scales:
        layer, proj = module.split(".")[1], module.rsplit(".", 1)[1]
        if module in rows:
            weighted = rows[module][0]
            value = weighted
            if proj == "w2":
                unweighted = rows[module + ".unweighted"][0]
                assert unweighted <= W2_BOUND
                assert amax[module + ".weighted"] == weighted
                assert amax[module + ".unweighted"] == unweighted
                value = {"weighted": weighted, "unweighted": unweighted,
                         "max": max(weighted, unweighted)}[w2_input]
            key = (layer, "w13" if proj in ("w1", "w3") else "w2")
            layer_max[key] = max(layer_max.get(key, 0.0), value)
            if not per_layer and proj == "w2":
                assert amax[module] == f32(value), module
    for module in scales:
        layer, proj = module.split(".")[1], module.rsplit(".", 1)[1]
        if proj in ("w1", "w3"):
            base = module.rsplit(".", 1)[0]
            assert amax[base + ".w1"] == amax[base + ".w3"], module
        if per_layer:
            key = (layer, "w13" if proj in ("w1", "w3") else "w2")
            assert amax[module] == f32(layer_max[key]), module


def test_run_calibrates_and_quantizes_w4a4(qd, reference):
    check_export(reference, {})
    qd.run_ok("verify", reference.out)
    rows = task_rows(reference.state)
    kinds = [k for (k, _), r in rows.items()]
    assert kinds.count("calibrate") == 1 + 3 * 2 + 1  # tokens, 3 layers x 2 slices, amax_out
    assert all(r["state"] == "DONE" and r["attempt"] == 1 for r in rows.values())
    assert leftovers(reference.state) == []
    assert job_dirs(reference.state) == []  # SUCCEEDED: its tokens file went with it
    # Token counts: every sample reaches each layer's attention once.
    stored = reference.result()["rows"]
    tokens = stored["layers.0.attn.wq_a"][1]
    assert tokens == stored["layers.2.attn.wq_a"][1] > 8 * 16


def test_same_table_as_quantd_calibrate(qd, reference):
    """The engine's stage and `quantd calibrate` (one slice, no engine) give the same file."""
    amax = reference.root / "calibrate.amax.json"
    qd.run_ok("calibrate", reference.spec, "--amax-out", amax, "--threads", 1)
    assert amax.read_bytes() == reference.amax.read_bytes()


@pytest.mark.parametrize("options", [{"w2_input": "weighted"}, {"w2_input": "unweighted"},
                                     {"expert_amax": "layer_max"},
                                     {"uncalibrated": "model_max"}])
def test_export_options(qd, source, reference, tmp_path, options):
    job = Job(qd, source, tmp_path / "job", **options)
    job.run_ok()
    check_export(job, options)
    # The measurement does not depend on the export options.
    assert job.result()["rows"] == reference.result()["rows"]
    qd.run_ok("verify", job.out)


def test_one_worker_two_workers_and_spilling_give_the_same_bytes(qd, source, reference,
                                                                 tmp_path):
    one = Job(qd, source, tmp_path / "one", workers=1)
    one.run_ok()
    assert one.result() == reference.result()
    # A host budget below one batch's activations: every output is spilled and read back.
    spilled = Job(qd, source, tmp_path / "spilled", host_memory_bytes=4096)
    spilled.run_ok()
    assert spilled.result() == reference.result()
    assert leftovers(spilled.state) == []


def test_constant_mode_writes_input_scale_one(qd, source, tmp_path):
    job = Job(qd, source, tmp_path / "constant", mode="constant")
    job.run_ok()
    assert set(input_scales(job.out).values()) == {1.0}
    assert not any(k == "calibrate" for (k, _) in task_rows(job.state))


# Kill points (one worker: tasks in plan order; calibrate task 1 is "tokens", 2k and 2k+1 the
# slices of layer k-1): after layer 0 was recorded (a layer boundary), and half way through the
# first slice of layer 1 (inside a layer).
KILLS = ["calibrate:3:done", "calibrate:4:mid"]


@pytest.mark.parametrize("kill_at", KILLS)
def test_run_killed_with_spilled_layers_resumes_after_them(qd, source, reference, tmp_path,
                                                           kill_at):
    """Under the default checkpoint_seconds (300), a layer whose outputs are all spilled (host
    budget 4 KiB) is checkpointed anyway, by hard links: the restart resumes from layer 1."""
    job = Job(qd, source, tmp_path / "job", workers=1, host_memory_bytes=4096)
    proc = job.run(kill_at=kill_at)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # The killed process spilled layer 0's outputs and checkpointed them: both still there.
    assert any(p.startswith("job-1/spill-") for p in leftovers(job.state))
    assert checkpointed_layers(job.state) == {0}
    proc = job.run_ok()
    assert "calibration resumes from layer 1: the checkpointed outputs of layer 0 are " \
           "verified" in proc.stderr
    assert layer_attempts(job.state)[0] == [1, 1]
    assert job.result() == reference.result()
    assert leftovers(job.state) == []
    assert job_dirs(job.state) == []


def test_run_killed_without_checkpoint_resumes_from_layer_0(qd, source, reference, tmp_path):
    """Under the default checkpoint_seconds, layers kept in memory are not checkpointed in a run
    shorter than 300 s: the restart calibrates from layer 0 again."""
    job = Job(qd, source, tmp_path / "job", workers=1)
    proc = job.run(kill_at="calibrate:3:done")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert checkpointed_layers(job.state) == set()
    proc = job.run_ok()
    assert "requeued 2 done task(s): calibration resumes from layer 0: no usable layer " \
           "checkpoint" in proc.stderr
    assert layer_attempts(job.state) == {0: [2, 2], 1: [1, 1], 2: [1, 1]}
    assert job.result() == reference.result()
    assert leftovers(job.state) == []


def test_run_with_its_tokens_file_gone_recalibrates_from_layer_0(qd, source, reference, tmp_path):
    """The layers depend on the tokens: without the file the tokens task runs again, and every
    layer after it, whatever was checkpointed."""
    job = Job(qd, source, tmp_path / "job", workers=1, host_memory_bytes=4096)
    proc = job.run(kill_at="calibrate:3:done")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert checkpointed_layers(job.state) == {0}
    tokens = job.state.parent / "state.db.work" / "job-1" / "tokens.bin"
    tokens.unlink()
    proc = job.run_ok()
    assert f"calibrate tokens: output {tokens} is gone" in proc.stderr
    assert "calibration resumes from layer 0: no usable layer checkpoint" in proc.stderr
    assert layer_attempts(job.state)[0] == [2, 2]
    assert job.result() == reference.result()
    assert leftovers(job.state) == []


@pytest.fixture(scope="module")
def deep_source(qd, source, tmp_path_factory):
    """The tiny fixture with twice its decoder layers (6: tests/bench/deepen_fixture.py), so that
    a restart resumes in the middle of the model."""
    out = tmp_path_factory.mktemp("deep") / "tiny-v4-x2"
    subprocess.run([sys.executable, str(REPO / "tests" / "bench" / "deepen_fixture.py"),
                    str(source["dir"]), str(out), "2"], check=True)
    return {"dir": out}


@pytest.fixture(scope="module")
def deep_reference(qd, deep_source, tmp_path_factory):
    """An uninterrupted `quantd run` of the 6-layer fixture (1 worker, 2 slices)."""
    job = Job(qd, deep_source, tmp_path_factory.mktemp("calstage-deep") / "reference", workers=1)
    job.run_ok()
    assert sorted(layer_attempts(job.state)) == [0, 1, 2, 3, 4, 5]
    return job


# On the 6-layer fixture with checkpoint_seconds 0 (every layer but the last is checkpointed):
# after layer 3 was recorded (a boundary: calibrate task 9 is layer 3's second slice), and half
# way through layer 4's first slice (task 10); both resume from layer 4.
DEEP_KILLS = ["calibrate:9:done", "calibrate:10:mid"]


@pytest.mark.parametrize("kill_at", DEEP_KILLS)
def test_run_killed_resumes_from_the_last_checkpointed_layer(qd, deep_source, deep_reference,
                                                              tmp_path, kill_at):
    job = Job(qd, deep_source, tmp_path / "job", workers=1, checkpoint_seconds=0)
    proc = job.run(kill_at=kill_at)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # Every earlier boundary was removed once the next one was committed.
    assert checkpointed_layers(job.state) == {3}
    proc = job.run_ok()
    assert "calibration resumes from layer 4: the checkpointed outputs of layer 3 are " \
           "verified" in proc.stderr
    attempts = layer_attempts(job.state)
    # Layers 0-3 were not run again; layer 4's first slice was, when it was interrupted.
    assert {layer: attempts[layer] for layer in range(4)} == {l: [1, 1] for l in range(4)}
    assert attempts[4] == ([1, 2] if kill_at.endswith(":mid") else [1, 1])
    assert job.result() == deep_reference.result()
    assert leftovers(job.state) == []
    assert job_dirs(job.state) == []


def test_run_never_trusts_a_corrupt_checkpoint(qd, deep_source, deep_reference, tmp_path):
    job = Job(qd, deep_source, tmp_path / "job", workers=1, checkpoint_seconds=0)
    proc = job.run(kill_at="calibrate:9:done")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    batch = next((job.state.parent / "state.db.work" / "job-1" / "calibrate-layers").glob(
        "layer3.slice1.batch0.safetensors"))
    data = bytearray(batch.read_bytes())
    data[-1] ^= 1
    batch.write_bytes(bytes(data))
    proc = job.run_ok()
    assert f"layer 3 slice 1: checkpoint not used: {batch} does not have the SHA-256 its " \
           "manifest records" in proc.stderr
    assert "calibration resumes from layer 0" in proc.stderr
    attempts = layer_attempts(job.state)
    assert {layer: attempts[layer] for layer in range(4)} == {l: [2, 2] for l in range(4)}
    assert job.result() == deep_reference.result()
    assert leftovers(job.state) == []


def daemon_spec(pb, source, out, **calibration):
    return pb.JobSpec(source=str(source["dir"]), output=str(out), recipe="experts",
                      weight_format="nvfp4",
                      calibration=pb.CalibrationSpec(dataset=str(DATA), num_samples=8,
                                                     seq_len=256, **calibration),
                      evaluate=pb.EvaluateSpec(enabled=False))


def run_daemon_reference(qd, source, root):
    """`quantd run` of the spec the daemon tests submit (dataset shorthand, 2 slices)."""
    spec = write_spec(root / "spec.json", source["dir"], root / "out", recipe="experts",
                      weight_format="nvfp4",
                      calibration={"dataset": str(DATA), "num_samples": 8, "seq_len": 256},
                      evaluate={"enabled": False})
    qd.run_ok("run", "--state", root / "state.db", "--workers", 2, *RUN_FLAGS, spec)
    return {"out": tree_hashes(root / "out"), "rows": stored_amax(root / "state.db")}


@pytest.fixture(scope="module")
def daemon_reference(qd, source, tmp_path_factory):
    return run_daemon_reference(qd, source, tmp_path_factory.mktemp("calstage-daemon"))


@pytest.fixture(scope="module")
def deep_daemon_reference(qd, deep_source, tmp_path_factory):
    return run_daemon_reference(qd, deep_source, tmp_path_factory.mktemp("calstage-daemon-deep"))


def test_daemon_calibrates(qd, source, stubs, daemon_reference, tmp_path):
    from test_daemon import Client  # the QuantService calls with deadlines
    pb = stubs[0]
    d = Daemon(qd.binary, tmp_path / "state")
    try:
        d.start()
        out = tmp_path / "out"
        client = Client(stubs, d.channel())
        job = client.submit(daemon_spec(pb, source, out), "calibrate")
        seen = client.watch(job.id)
        final = seen[-1]
        assert final.state == pb.SUCCEEDED, final
        assert [s.kind for s in final.stages][:2] == ["inspect", "calibrate"]
        # The calibrate stage counts tokens and says which layer (1-based) its tasks calibrate.
        calibrate = [s for m in seen for s in m.stages if s.kind == "calibrate"]
        assert {s.unit for s in calibrate} == {"tokens"}
        assert {s.step for s in calibrate} <= {"", "layer 1 of 3", "layer 2 of 3", "layer 3 of 3"}
        assert all(s.step == "" for s in calibrate if s.state != pb.StageProgress.RUNNING)
        assert {s.unit for s in final.stages if s.kind not in ("calibrate", "evaluate")} == \
            {"bytes"}
        assert any(s.step for s in calibrate), calibrate
        d.stop()
    finally:
        d.close()
    assert tree_hashes(out) == daemon_reference["out"]
    state = tmp_path / "state" / "quantd.db"
    assert stored_amax(state) == daemon_reference["rows"]
    assert leftovers(state) == []
    assert job_dirs(state) == []
    qd.run_ok("verify", out)


@pytest.mark.parametrize("kill_at", DEEP_KILLS)
def test_daemon_killed_resumes_from_the_last_checkpointed_layer(qd, deep_source, stubs,
                                                                 deep_daemon_reference, tmp_path,
                                                                 kill_at):
    """The daemon (one CPU worker: tasks in plan order), checkpoint_seconds 0 through the gRPC
    spec, killed after layer 3 or inside layer 4 of 6: it resumes from layer 4."""
    from test_daemon import Client
    pb = stubs[0]
    d = Daemon(qd.binary, tmp_path / "state", env={"QUANTD_TEST_KILL_AT": kill_at})
    state = tmp_path / "state" / "quantd.db"
    try:
        d.start()
        out = tmp_path / "out"
        job = Client(stubs, d.channel()).submit(
            daemon_spec(pb, deep_source, out, checkpoint_seconds=0), "calibrate")
        assert d.wait(120) == -signal.SIGKILL, d.log()
        assert checkpointed_layers(state) == {3}
        d.env = {}
        d.start()
        final = Client(stubs, d.channel()).watch(job.id)[-1]
        assert final.state == pb.SUCCEEDED, final
        assert "calibration resumes from layer 4: the checkpointed outputs of layer 3 are " \
               "verified" in d.log()
        d.stop()
    finally:
        d.close()
    attempts = layer_attempts(state)
    assert {layer: attempts[layer] for layer in range(4)} == {l: [1, 1] for l in range(4)}
    assert tree_hashes(out) == deep_daemon_reference["out"]
    assert stored_amax(state) == deep_daemon_reference["rows"]
    assert leftovers(state) == []
    assert job_dirs(state) == []


@pytest.mark.parametrize("then", ["cancel", "resume", "delete"])
def test_daemon_cancel_or_pause_mid_calibration_leaves_no_spill_file(qd, source, stubs,
                                                                     daemon_reference, tmp_path,
                                                                     then):
    """Cancelled (or paused, then resumed or deleted) while layer 1 calibrates, with every
    activation spilled (host budget 4 KiB): the job's spill files are gone once it stops; a
    paused job keeps its tokens file and the checkpoint of its last spilled layer, a resumed one
    calibrates from the layer after it and gives the uninterrupted bytes; a cancelled, finished
    or deleted job leaves no job directory."""
    pause = then != "cancel"
    from test_daemon import Client
    pb = stubs[0]
    d = Daemon(qd.binary, tmp_path / "state")
    state = tmp_path / "state" / "quantd.db"
    try:
        d.start()
        client = Client(stubs, d.channel())
        out = tmp_path / "out"
        spec = daemon_spec(pb, source, out)
        spec.host_memory_bytes = 4096
        job = client.submit(spec, "cancel")
        answers = []

        def stop_in_layer_1(message):
            calibrate = [s for s in message.stages if s.kind == "calibrate"]
            # tokens and both slices of layer 0 done: layer 1 is running, layer 0 spilled.
            if not answers and calibrate and calibrate[0].tasks_done >= 3:
                answers.append(client.cancel(job.id, pause=pause))
            return False

        seen = client.watch(job.id, stop_in_layer_1)
        assert answers, seen[-1]
        assert seen[-1].state == (pb.PAUSED if pause else pb.CANCELLED), seen[-1]
        deadline = time.monotonic() + 10
        while any("spill-" in p for p in leftovers(state)) and time.monotonic() < deadline:
            time.sleep(0.1)
        # Layer 0 at least was checkpointed (its outputs were spilled); layer 1 too if it ended
        # before the pause took effect, and then layer 0's checkpoint was removed.
        kept = checkpointed_layers(state)
        assert not any("spill-" in p for p in leftovers(state)), leftovers(state)
        work = state.parent / (state.name + ".work") / f"job-{job.id}"
        assert job_dirs(state) == ([work.name] if pause else [])
        if pause:
            assert (work / "tokens.bin").is_file()
            assert len(kept) == 1 and kept <= {0, 1}, kept
        if then == "resume":
            client.resume(job.id)
            final = client.watch(job.id)[-1]
            assert final.state == pb.SUCCEEDED, final
            layer = min(kept)
            assert f"calibration resumes from layer {layer + 1}: the checkpointed outputs of " \
                   f"layer {layer} are verified" in d.log()
            assert tree_hashes(out) == daemon_reference["out"]
            assert stored_amax(state) == daemon_reference["rows"]
            assert leftovers(state) == []
        if then == "delete":
            client.delete(job.id)
        assert job_dirs(state) == []
        d.stop()
    finally:
        d.close()
