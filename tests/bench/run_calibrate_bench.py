#!/usr/bin/env python3
"""Benchmark of layer-wise calibration on the CPU (issue 12): `quantd calibrate` (the calibrate
stage's code path: calibration/calibrate_layer.h, activation_store.h) on a DeepSeek-V4 fixture
and on copies with 2x and 4x its decoder layers (deepen_fixture.py), printed as one table:

  tokens/s     calibration tokens x layers / wall time of the layer loop (each token goes through
               every layer), and tokens through the whole model per second
  peak RSS     VmHWM of the process (includes the pages of the memory-mapped source it touched)
  peak anon    peak RssAnon sampled every 20 ms: RSS without file pages, i.e. the layer's decoded
               weights, the activations between layers and the forward's working memory; this is
               what must not grow with depth
  per layer    mean seconds per layer: load (read + decode the dense weights), decode (the routed
               experts, one at a time inside the forward), forward, record
               (the amax observer), spill (write + read back activations; 0 in memory)

One more run of the deepest fixture spills every activation (--spill-dir) to show the spill cost,
and one more of the base fixture checkpoints every layer's outputs (--checkpoint-dir, what a
calibrating job with calibration.checkpoint_seconds 0 writes at each boundary:
calibration/layer_checkpoint.h): its bytes and seconds per boundary.

  QUANTD_BIN=path              the quantd binary (default: $QUANTD_BUILD_DIR/server/quantd)
  QUANTD_BENCH_PRESET=small    the base fixture preset (tiny, small, bench)
  QUANTD_BENCH_SAMPLES=16      calibration samples (from tests/data/calibration_sample.jsonl)
  QUANTD_BENCH_SEQ_LEN=256     tokens per sample at most
  QUANTD_BENCH_THREADS=0       CPU threads (0 = all cores)
  QUANTD_BENCH_DIR=dir         where fixtures go (default: a new dir under /var/tmp, removed)
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYER_LINE = re.compile(r"layer (\d+) of (\d+): .*\(load ([\d.]+) s, decode ([\d.]+) s, "
                        r"forward ([\d.]+) s, record ([\d.]+) s, spill ([\d.]+) s;")
DONE_LINE = re.compile(r"calibrated (\d+) layers on (\d+) tokens in ([\d.]+) s")
CHECKPOINT_LINE = re.compile(r"layer \d+ of \d+ checkpoint: (\d+) bytes in ([\d.]+) s")


def quantd():
    if "QUANTD_BIN" in os.environ:
        return os.environ["QUANTD_BIN"]
    return str(Path(os.environ.get("QUANTD_BUILD_DIR", REPO / "build")) / "server" / "quantd")


def status_kib(pid, key):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def calibrate(qd, spec, amax_out, threads, spill_dir=None, checkpoint_dir=None):
    """Runs `quantd calibrate`; returns wall, peak RSS, peak anon (KiB) and the parsed lines."""
    args = [qd, "calibrate", str(spec), "--amax-out", str(amax_out), "--threads", str(threads)]
    if spill_dir is not None:
        args += ["--spill-dir", str(spill_dir)]
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", str(checkpoint_dir)]
    start = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    anon = hwm = 0
    while proc.poll() is None:
        a, h = status_kib(proc.pid, "RssAnon"), status_kib(proc.pid, "VmHWM")
        anon, hwm = max(anon, a or 0), max(hwm, h or 0)
        time.sleep(0.02)
    out, err = proc.communicate()
    wall = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"run_calibrate_bench: {' '.join(args)} failed:\n{err}")
    layers = [tuple(float(x) for x in m.groups()[2:]) for m in LAYER_LINE.finditer(err)]
    done = DONE_LINE.search(out)
    checkpoints = [(int(m.group(1)), float(m.group(2))) for m in CHECKPOINT_LINE.finditer(err)]
    return {"wall": wall, "hwm": hwm, "anon": anon, "layers": layers, "checkpoints": checkpoints,
            "tokens": int(done.group(2)), "loop": float(done.group(3))}


def mean_forward(r):
    return sum(x[2] for x in r["layers"]) / len(r["layers"])


def main():
    qd = quantd()
    preset = os.environ.get("QUANTD_BENCH_PRESET", "small")
    samples = int(os.environ.get("QUANTD_BENCH_SAMPLES", "16"))
    seq_len = int(os.environ.get("QUANTD_BENCH_SEQ_LEN", "256"))
    threads = int(os.environ.get("QUANTD_BENCH_THREADS", "0"))
    keep = "QUANTD_BENCH_DIR" in os.environ
    work = Path(os.environ["QUANTD_BENCH_DIR"]) if keep else Path(
        tempfile.mkdtemp(prefix="quantd-calbench.", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        base = work / f"src-{preset}-x1"
        if not (base / "config.json").exists():
            subprocess.run([qd, "mkfixture", "--arch", "deepseek-v4", "--preset", preset,
                            "--seed", "3", str(base)], check=True, capture_output=True)
        rows = []
        for factor in (1, 2, 4):
            src = base if factor == 1 else work / f"src-{preset}-x{factor}"
            if not (src / "config.json").exists():
                subprocess.run([sys.executable, str(Path(__file__).parent / "deepen_fixture.py"),
                                str(base), str(src), str(factor)], check=True)
            spec = work / f"spec-x{factor}.json"
            spec.write_text(json.dumps({
                "source": str(src), "output": str(work / "unused"), "weight_format": "nvfp4",
                "calibration": {"datasets": [{"path": str(REPO / "tests" / "data" /
                                                          "calibration_sample.jsonl"),
                                              "samples": samples}],
                                "seq_len": seq_len}}))
            runs = [("memory", calibrate(qd, spec, work / "amax.json", threads))]
            if factor == 1:
                runs.append(("ckpt", calibrate(qd, spec, work / "amax.json", threads,
                                               checkpoint_dir=work / "checkpoints")))
            if factor == 4:
                spill = work / "spill"
                spill.mkdir(exist_ok=True)
                runs.append(("spilled", calibrate(qd, spec, work / "amax.json", threads, spill)))
            for mode, r in runs:
                rows.append((factor, mode, r))

        print(f"quantd calibrate, preset {preset} x1/x2/x4 layers, {samples} samples x <= "
              f"{seq_len} tokens, threads {threads or 'all'}")
        print(f"{'layers':>6} {'acts':>7} {'tokens':>7} {'wall s':>7} {'layer-tok/s':>11} "
              f"{'model tok/s':>11} {'peak RSS MiB':>12} {'peak anon MiB':>13} "
              f"{'load':>6} {'decode':>6} {'forward':>7} {'record':>6} {'spill':>6}  (s per layer)")
        for factor, mode, r in rows:
            n = len(r["layers"])
            mean = [sum(x[i] for x in r["layers"]) / n for i in range(5)]
            print(f"{n:>6} {mode:>7} {r['tokens']:>7} {r['wall']:>7.2f} "
                  f"{r['tokens'] * n / r['loop']:>11.0f} {r['tokens'] / r['loop']:>11.1f} "
                  f"{r['hwm'] / 1024:>12.1f} {r['anon'] / 1024:>13.1f} "
                  f"{mean[0]:>6.3f} {mean[1]:>6.3f} {mean[2]:>7.3f} {mean[3]:>6.3f} "
                  f"{mean[4]:>6.3f}")
        for factor, mode, r in rows:
            if r["checkpoints"]:
                n = len(r["checkpoints"])
                size = sum(b for b, _ in r["checkpoints"]) / n
                seconds = sum(t for _, t in r["checkpoints"]) / n
                print(f"checkpoint per boundary ({n} boundaries of {len(r['layers'])} layers): "
                      f"{size / 2**20:.1f} MiB in {seconds:.3f} s ({size / 2**20 / seconds:.0f} "
                      f"MiB/s; write + fsync + SHA-256), {seconds / mean_forward(r):.2f}x the "
                      f"layer's forward")
        anon = [r["anon"] for _, mode, r in rows if mode == "memory"]
        print(f"peak anon RSS x4 / x1 layers: {anon[-1] / anon[0]:.2f} (flat: one layer + "
              f"activations, whatever the depth)")
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
