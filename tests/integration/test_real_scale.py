"""scripts/real_scale.sh at CI size: a checkpoint of DeepSeek-V4-Pro's real dimensions (hidden
7168, 128 heads, moe width 3072: the shapes of one real layer) with the expert count and the
vocabulary cut (8 experts, 1024 ids), through the same calibrated, evaluated W4A4 `quantd run` and
`quantd verify` as the full-size run (issue 21, item 5).

The run must succeed with no lease expired, every layer task must report its seconds of load,
decode, forward (and record), and the run's peak anonymous memory must stay within what its
tasks declared: at most two layer tasks run at once (two workers), each holding at most its
planned requirement (pipeline/stages/layer_task_memory.h), plus 1 GiB for the process itself
(gRPC-free run loop, thread stacks, a quantize task's buffers, the tokenized samples)."""

import re
import sqlite3
import subprocess

from conftest import REPO


def test_a_pro_shaped_layer_calibrates_evaluates_and_verifies(qd, tmp_path):
    work = tmp_path / "real-scale"
    proc = subprocess.run(
        [str(REPO / "scripts" / "real_scale.sh"), "--experts", "8", "--vocab", "1024",
         "--samples", "2", "--eval-samples", "1", "--seq-len", "64", "--threads", "2",
         "--dir", str(work)],
        capture_output=True, text=True, timeout=600, env={"QUANTD_BIN": qd.binary,
                                                          "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    out = proc.stdout
    assert "leases expired: 0" in out, out
    tasks = dict(re.findall(r"^    ((?:calibrate|evaluate) \S+)\s+(load .*)$", out, re.M))
    assert set(tasks) == {"calibrate layer0.slice0", "calibrate layer0.slice1",
                          "evaluate layer0"}, out
    for name, seconds in tasks.items():
        fields = ["load", "decode", "forward"] + (["record"] if name.startswith("calib") else [])
        assert re.fullmatch(", ".join(rf"{f} [\d.]+ s" for f in fields), seconds), (name, seconds)
    assert re.search(r"^quantd verify: [\d.]+ s, [\d.]+ GB/s", out, re.M), out
    assert re.search(r"stage quantize\s+[\d.]+ s, [\d.]+ GB/s", out), out

    peak_anon = float(re.search(r"peak anonymous ([\d.]+) GiB", out).group(1)) * 2**30
    db = sqlite3.connect(work / "state.db")
    declared = [b for (b,) in db.execute(
        "SELECT memory_bytes FROM tasks ORDER BY memory_bytes DESC LIMIT 2")]
    assert declared[0] > 0, declared
    assert peak_anon <= sum(declared) + 2**30, (peak_anon, declared)
    # The source and the output are removed without --keep; the state stays.
    assert not (work / "source").exists() and not (work / "output").exists()
