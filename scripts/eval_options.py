#!/usr/bin/env python3
"""Compares the export options that matter on one source: the tiny DeepSeek-V4 fixture (or
--source DIR) converted once per option, each output evaluated against the source with
`quantd evaluate`, one table of the figures.

Options (the `experts` recipe unless said, ModelOpt export):
  constant        W4A4, input_scale 1.0 (calibration.mode constant: no forward pass)
  weighted        W4A4, calibrated, w2 amax from its routing-weighted input (NVIDIA's recipe)
  unweighted      W4A4, calibrated, w2 amax from its unweighted input (what the runtimes quantize)
  max             W4A4, calibrated, the larger of the two (quantd's default)
  layer_max       as max, each layer's amax written into every expert (expert_amax layer_max)
  requantize      as max, experts requantized from their MXFP4 values (expert_cast requantize)
  w4a16           weights only, lossless expert cast
  full            as max, with the `full` recipe (attention and shared experts too; V4's grouped
                  attn.wo_a stays in its source format)
  full_w4a16      the `full` recipe, weights only

Calibration and evaluation use disjoint samples of tests/data/calibration_sample.jsonl (the
evaluation takes the samples after the calibration ones). Also prints the wall time of one
calibration against one evaluation (both single-threaded by default, same machine, same run),
per token: the evaluation runs three layer passes per token (source, quantized free-running,
quantized teacher-forced) plus two heads, calibration one pass.

    scripts/eval_options.py [--work DIR] [--threads N] [--calibrate-samples N]
                            [--evaluate-samples N] [--seq-len N] [--numerics official|math]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "calibration_sample.jsonl"

OPTIONS = [
    ("constant", {"mode": "constant"}, {}),
    ("weighted", {"w2_input": "weighted"}, {}),
    ("unweighted", {"w2_input": "unweighted"}, {}),
    ("max", {"w2_input": "max"}, {}),
    ("layer_max", {"w2_input": "max", "expert_amax": "layer_max"}, {}),
    ("requantize", {"w2_input": "max"}, {"expert_cast": "requantize"}),
    ("w4a16", None, {"weight_format": "w4a16_nvfp4"}),
    ("full", {"w2_input": "max"}, {"recipe": "full"}),
    ("full_w4a16", None, {"recipe": "full", "weight_format": "w4a16_nvfp4"}),
]


def run(cmd):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--source", type=Path, default=None,
                    help="source checkpoint (default: the tiny fixture)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calibrate-samples", type=int, default=16)
    ap.add_argument("--evaluate-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--numerics", choices=["official", "math"], default="official")
    args = ap.parse_args()
    build = Path(os.environ.get("QUANTD_BUILD_DIR", REPO / "build"))
    quantd = build / "server" / "quantd"
    work = args.work or Path(tempfile.mkdtemp(prefix="quantd-eval-options-"))
    work.mkdir(parents=True, exist_ok=True)
    source = args.source
    if source is None:
        source = work / "source"
        if not source.exists():
            run([quantd, "mkfixture", "--arch", "deepseek-v4", "--preset", "tiny", "--seed", 1,
                 source])
    calibration = {"datasets": [{"path": str(DATA), "samples": args.calibrate_samples}],
                   "seq_len": args.seq_len, "min_seq_len": 16, "numerics": args.numerics}
    rows, costs = [], {}
    for name, cal_options, spec_options in OPTIONS:
        d = work / name
        d.mkdir(exist_ok=True)
        spec = {"source": str(source), "output": str(d / "out"), "recipe": "experts",
                "calibration": dict(calibration),
                "evaluate": {"num_samples": args.evaluate_samples}, **spec_options}
        if cal_options is not None:
            spec["calibration"].update(cal_options)
            (d / "calibrate.json").write_text(json.dumps(spec))
            start = time.monotonic()
            proc = run([quantd, "calibrate", d / "calibrate.json", "--amax-out", d / "amax.json",
                        "--threads", args.threads])
            if name == "max":
                costs["calibrate"] = time.monotonic() - start
                costs["calibrate_tokens"] = int(re.search(r"on (\d+) tokens", proc.stdout).group(1))
            spec["calibration"]["amax_file"] = str(d / "amax.json")
        (d / "spec.json").write_text(json.dumps(spec))
        if not (d / "out" / "config.json").exists():
            run([quantd, "run", "--state", d / "state.db", "--device", "cpu", "--threads",
                 args.threads, d / "spec.json"])
        start = time.monotonic()
        run([quantd, "evaluate", d / "spec.json", "--out", d / "report.json", "--threads",
             args.threads])
        if name == "max":
            costs["evaluate"] = time.monotonic() - start
        report = json.loads((d / "report.json").read_text())
        costs["evaluate_tokens"] = report["tokens"]
        n = report["next_token"]
        sqnr = [l["teacher_forced_sqnr_db"] for l in report["layers"]]
        worst = min((s for s in sqnr if s is not None), default=None)
        rows.append((name, n["mean_kl"], n["p99_kl"], n["top1_agreement"], n["ppl_ratio"], worst,
                     report["layers"][-1]["free_running_sqnr_db"]))

    print(f"source {source}, {args.numerics} numerics, evaluated on {costs['evaluate_tokens']} "
          f"held-out tokens")
    print(f"{'option':<11} {'mean KL':>9} {'p99 KL':>9} {'top-1':>7} {'ppl ratio':>9} "
          f"{'min TF SQNR':>11} {'last FR SQNR':>12}")
    fmt = lambda x: "inf" if x is None else f"{x:.2f}"
    for name, kl, p99, top1, ratio, worst, last in rows:
        print(f"{name:<11} {kl:>9.4f} {p99:>9.4f} {top1:>7.4f} {ratio:>9.4f} {fmt(worst):>11} "
              f"{fmt(last):>12}")
    per_cal = costs["calibrate"] / costs["calibrate_tokens"]
    per_eval = costs["evaluate"] / costs["evaluate_tokens"]
    print(f"cost (option max, {args.threads} thread(s), process wall time): calibrate "
          f"{costs['calibrate']:.2f} s for {costs['calibrate_tokens']} tokens, evaluate "
          f"{costs['evaluate']:.2f} s for {costs['evaluate_tokens']} tokens; per token evaluate / "
          f"calibrate = {per_eval / per_cal:.2f}")


if __name__ == "__main__":
    main()
