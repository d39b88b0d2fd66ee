"""Resumability of `quantd run` (issue 3 §4): SIGKILL at chosen points and at random times, then
the same command again: the final output is byte-identical to an uninterrupted run's, no .tmp file
survives, and no task that was done before the kill is redone.

Deterministic kill points use the runner's test hook QUANTD_TEST_KILL_AT (server/scheduler/kill_hook.h).
"""

import json
import random
import re
import signal
import sqlite3
import subprocess
import time

import pytest

from run_helpers import job_row, task_rows, tree_hashes, write_spec

RUN_FLAGS = ["--workers", "2", "--device", "cpu", "--threads", "1"]


def spec_fields(source, kind):
    if kind == "nvfp4-experts-bf16":  # every stage: inspect, dequant, quantize, export, verify
        return {"weight_format": "nvfp4", "recipe": "experts",
                "calibration": {"amax_file": str(source["amax"])}}
    if kind == "w4a16-full-ct":
        return {"weight_format": "w4a16_nvfp4", "recipe": "full",
                "export_format": "compressed-tensors"}
    raise ValueError(kind)


class Job:
    """One job spec with its own output, BF16 and state paths under `root`."""

    def __init__(self, qd, source, root, kind):
        self.qd = qd
        root.mkdir(parents=True, exist_ok=True)
        self.out = root / "out"
        self.bf16 = root / "bf16" if kind.endswith("-bf16") else None
        self.state = root / "state.db"
        self.spec = write_spec(root / "spec.json", source["dir"], self.out, self.bf16,
                               **spec_fields(source, kind))

    def args(self):
        return ["run", "--state", self.state, *RUN_FLAGS, self.spec]

    def run(self, kill_at=None):
        env = {"QUANTD_TEST_KILL_AT": kill_at} if kill_at else None
        return self.qd.run(*self.args(), env_extra=env)

    def popen(self):
        return subprocess.Popen(self.qd.cmd(*self.args()), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def hashes(self):
        out = {"out": tree_hashes(self.out)}
        if self.bf16 is not None:
            out["bf16"] = tree_hashes(self.bf16)
        return out


@pytest.fixture(scope="module")
def reference(qd, source, tmp_path_factory):
    """Uninterrupted runs: output hashes and wall time per spec kind."""
    refs = {}
    for kind in ("nvfp4-experts-bf16", "w4a16-full-ct"):
        job = Job(qd, source, tmp_path_factory.mktemp("ref") / kind, kind)
        start = time.monotonic()
        proc = job.run()
        assert proc.returncode == 0, proc.stderr
        refs[kind] = {"hashes": job.hashes(), "seconds": time.monotonic() - start}
        assert job_row(job.state) == [("SUCCEEDED", "", "")]
        assert all(r["attempt"] == 1 and r["state"] == "DONE"
                   for r in task_rows(job.state).values())
    return refs


def assert_no_tmp(hashes):
    for tree in hashes.values():
        assert not [n for n in tree if n.endswith(".tmp")], tree


def assert_resumed_without_redoing(before, after):
    """`before`: tasks when the process died; `after`: when the job finished."""
    assert before.keys() == after.keys()
    for key, b in before.items():
        a = after[key]
        assert a["state"] == "DONE", (key, a)
        if b["state"] == "DONE":
            assert a["attempt"] == b["attempt"] and a["sha"] == b["sha"], (key, b, a)
        else:  # not started (attempt 0), or interrupted (LEASED, or requeued on SIGINT): run once
            assert b["state"] in ("PENDING", "LEASED") and a["attempt"] == b["attempt"] + 1, (
                key, b, a)


# (kill point, kind): every stage at its start, quantize and dequant half-written, a finished
# shard not yet recorded ("written"), between tasks ("done"), and during export.
KILL_POINTS = [
    ("inspect:1", "nvfp4-experts-bf16"),
    ("dequant:2", "nvfp4-experts-bf16"),
    ("dequant:3:mid", "nvfp4-experts-bf16"),
    ("quantize:1", "nvfp4-experts-bf16"),
    ("quantize:2:mid", "nvfp4-experts-bf16"),
    ("quantize:3:written", "nvfp4-experts-bf16"),
    ("quantize:2:done", "nvfp4-experts-bf16"),
    ("quantize:4:mid", "w4a16-full-ct"),
    ("export:1", "nvfp4-experts-bf16"),
    ("export:1:written", "w4a16-full-ct"),
    ("verify:3", "nvfp4-experts-bf16"),
]


@pytest.mark.parametrize("kill_at,kind", KILL_POINTS)
def test_sigkill_at_a_point_then_resume_is_byte_identical(qd, source, reference, tmp_path,
                                                          kill_at, kind):
    job = Job(qd, source, tmp_path, kind)
    killed = job.run(kill_at)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    before = task_rows(job.state)
    stage, n = kill_at.split(":")[:2]
    mode = kill_at.split(":")[2] if kill_at.count(":") == 2 else "start"
    # The hook fired where asked: the n-th task of the stage is the one held (or just done). A
    # verify task starts as soon as its shard's quantize task is done, so verify tasks start in
    # the order quantize tasks finish: there, one of them is held, and n tasks have started.
    if stage == "verify":
        rows = [r for (kind, _), r in before.items() if kind == stage]
        assert sum(r["state"] in ("DONE", "LEASED") for r in rows) >= int(n), before
        target = next((r for r in rows if r["state"] == "LEASED"), None)
        assert target is not None, before
    else:
        target = before[(stage, int(n) - 1)]
    assert target["state"] == ("DONE" if mode == "done" else "LEASED"), before
    assert job_row(job.state)[0][0] == "RUNNING"
    written_to = {"quantize": job.out, "dequant": job.bf16}.get(stage)
    if mode == "mid" and written_to is not None:  # half-written shard
        assert (written_to / f"{target['name']}.tmp").exists(), sorted(written_to.iterdir())
    if mode == "written" and written_to is not None:  # renamed into place, not recorded
        assert (written_to / target["name"]).exists(), sorted(written_to.iterdir())

    resumed = job.run()
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming job 1" in resumed.stderr
    assert job_row(job.state) == [("SUCCEEDED", "", "")]
    hashes = job.hashes()
    assert_no_tmp(hashes)
    assert hashes == reference[kind]["hashes"]
    assert_resumed_without_redoing(before, task_rows(job.state))


def test_sigkill_at_random_times_then_resume_is_byte_identical(qd, source, reference, tmp_path):
    kind = "w4a16-full-ct"
    job = Job(qd, source, tmp_path, kind)
    rng = random.Random(20240601)
    span = reference[kind]["seconds"]
    done_before = {}  # task -> (attempt, sha) once seen DONE: must never change
    kills = 0
    for _ in range(5):
        proc = job.popen()
        time.sleep(rng.uniform(0.0, span))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, proc.returncode
        kills += 1
        if not job.state.exists():
            continue
        rows = task_rows(job.state)
        for key, r in rows.items():
            if key in done_before:
                assert (r["state"], r["attempt"], r["sha"]) == ("DONE", *done_before[key]), key
            elif r["state"] == "DONE":
                done_before[key] = (r["attempt"], r["sha"])
    final = job.run()
    assert final.returncode == 0, final.stderr
    assert job_row(job.state) == [("SUCCEEDED", "", "")]
    for key, (attempt, sha) in done_before.items():
        r = task_rows(job.state)[key]
        assert (r["attempt"], r["sha"]) == (attempt, sha), key
    hashes = job.hashes()
    assert_no_tmp(hashes)
    assert hashes == reference[kind]["hashes"]
    assert kills >= 1


def test_sigint_pauses_the_job_and_the_same_command_resumes(qd, source, reference, tmp_path):
    kind = "nvfp4-experts-bf16"
    job = Job(qd, source, tmp_path, kind)
    proc = job.popen()
    # Not a terminal: one log line per finished task. Interrupt after the first BF16 shard.
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("dequant ") and " done: " in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 130, (proc.returncode, "".join(lines) + rest)
    assert "interrupted; the job is PAUSED" in rest
    assert job_row(job.state) == [("PAUSED", "interrupted", "")]
    rows = task_rows(job.state)
    assert not [k for k, r in rows.items() if r["state"] == "LEASED"], rows
    assert rows[("export", 0)]["state"] == "PENDING"

    resumed = job.run()
    assert resumed.returncode == 0, resumed.stderr
    hashes = job.hashes()
    assert_no_tmp(hashes)
    assert hashes == reference[kind]["hashes"]
    assert_resumed_without_redoing(rows, task_rows(job.state))


def test_exit_codes_and_refusals(qd, source, tmp_path):
    state = tmp_path / "state.db"
    # 2: usage (no spec, a bad spec, a bad option).
    assert qd.run("run", "--state", state).returncode == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"source": "x", "output": "y", "colour": "red"}')
    proc = qd.run("run", "--state", state, bad)
    assert proc.returncode == 2 and "colour" in proc.stderr, proc.stderr
    good = write_spec(tmp_path / "a.json", source["dir"], tmp_path / "out",
                      weight_format="w4a16_nvfp4")
    assert qd.run("run", "--state", state, "--workers", "0", good).returncode == 2
    assert qd.run("run", "--state", state, "--device", "tpu", good).returncode == 2
    assert not state.exists()
    # 1: W4A4 without amax (the job is recorded as FAILED, nothing is written).
    nvfp4 = write_spec(tmp_path / "b.json", source["dir"], tmp_path / "out-b")
    proc = qd.run("run", "--state", tmp_path / "b.db", nvfp4)
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith(
        "weight_format nvfp4 needs input amax: give calibration data (calibration.dataset or "
        "datasets), calibration.amax_file or calibration.mode constant, or use w4a16_nvfp4"), proc.stderr
    assert job_row(tmp_path / "b.db")[0][0] == "FAILED"
    # 0, then 0 again (a no-op), then 1 for another spec on the same state file.
    qd.run_ok("run", "--state", state, *RUN_FLAGS, good)
    again = qd.run_ok("run", "--state", state, *RUN_FLAGS, good)
    assert "already SUCCEEDED" in again.stderr
    other = write_spec(tmp_path / "c.json", source["dir"], tmp_path / "out-c",
                       weight_format="w4a16_nvfp4", recipe="full")
    proc = qd.run("run", "--state", state, other)
    assert proc.returncode == 1
    assert f"state file {state} belongs to a different job spec" in proc.stderr


def verify_summaries(state_path):
    """Shard name -> how its verify task checked the bytes, from the task_done events."""
    con = sqlite3.connect(str(state_path))
    try:
        messages = [m for (m,) in con.execute(
            "SELECT message FROM events WHERE kind = 'task_done' AND message LIKE 'verify %'")]
    finally:
        con.close()
    out = {}
    for m in messages:
        shard = re.search(r"(model-\d+-of-\d+\.safetensors)", m).group(1)
        out[shard] = "rehashed" if "read back and re-hashed" in m else (
            "size" if "hashed as they were written" in m else m)
    return out


def test_each_output_byte_is_hashed_once_and_a_resumed_job_rehashes_the_earlier_shards(
        qd, source, reference, tmp_path):
    """Issue 24 item 1: an uninterrupted run's verify tasks re-hash nothing (the writer hashed
    every byte as it wrote it); after a kill, the shards the killed process wrote are read back and
    re-hashed, the others not. The manifest lists every file with its SHA-256 (recomputed here
    with hashlib), and `quantd verify --deep` re-hashes them all."""
    kind = "w4a16-full-ct"
    fresh = Job(qd, source, tmp_path / "fresh", kind)
    assert fresh.run().returncode == 0
    assert set(verify_summaries(fresh.state).values()) == {"size"}, verify_summaries(fresh.state)

    job = Job(qd, source, tmp_path / "killed", kind)
    assert job.run("quantize:3").returncode == -signal.SIGKILL
    before = task_rows(job.state)
    earlier = {r["name"] for (k, _), r in before.items() if k == "quantize" and r["state"] == "DONE"}
    assert earlier
    assert job.run().returncode == 0
    summaries = verify_summaries(job.state)
    assert summaries == {shard: "rehashed" if shard in earlier else "size" for shard in summaries}
    assert set(summaries.values()) == {"rehashed", "size"}, summaries

    manifest = json.loads((job.out / "quantd_manifest.json").read_text())
    assert manifest["format"] == "quantd-manifest-1"
    hashes = tree_hashes(job.out)
    del hashes["quantd_manifest.json"]
    assert {p: f["sha256"] for p, f in manifest["files"].items()} == hashes
    assert all(f["size"] == (job.out / p).stat().st_size for p, f in manifest["files"].items())
    deep = qd.run("verify", "--deep", job.out)
    assert deep.returncode == 0, deep.stdout + deep.stderr
    assert f"manifest: {len(hashes)} files, sizes and SHA-256 checked" in deep.stdout

    # One flipped byte in a copied file: sizes still match, only --deep sees it.
    config = job.out / "tokenizer.json"
    data = bytearray(config.read_bytes())
    data[-2] ^= 1
    config.write_bytes(bytes(data))
    assert qd.run("verify", job.out).returncode == 0
    deep = qd.run("verify", "--deep", job.out)
    assert deep.returncode == 1
    assert "[manifest] tokenizer.json: SHA-256" in deep.stdout
