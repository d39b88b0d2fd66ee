#!/usr/bin/env python3
"""The calibration forward against the peer that calibrates with it (issue 24 item 3): quantd's
layer-wise forward (`quantd calibrate`, the calibrate stage's code path) and transformers' own
fp32 DeepSeek-V4 forward (DeepseekV4Model, eager attention and experts, the model the forward
oracle test checks us against) on the same model and the same token ids, printed as one table.

The model is built by transformers (tests/interop/v4_tiny_model.py: its random, well-conditioned
weights written in the official FP8 / MXFP4 layout, which quantd reads and transformers holds
decoded), at the tiny oracle shape and at the widths of quantd's `small` and `bench` fixture
presets (hidden, heads, ranks, experts, top-k, vocabulary; their layer patterns). Per preset:

  quantd         tokens / s of `quantd calibrate` (samples x seq_len tokens through every layer,
                 the layer loop's wall time: loading and decoding the weights included), in
                 `math` numerics (fp32 throughout, as transformers) and `official` numerics
  hf batched     transformers with every sample in one batch (the base model: no LM head, which
                 calibration does not run either)
  hf one by one  transformers one sample at a time
  ratio          quantd / hf batched (the target is >= 1.5)

Best of QUANTD_BENCH_REPEAT runs each, all in one process run, so the ratios compare like with
like on whatever load the machine has.

  QUANTD_BIN=path                 the quantd binary (default: $QUANTD_BUILD_DIR/server/quantd)
  QUANTD_BENCH_PRESETS="tiny small"  presets measured (tiny, small, bench)
  QUANTD_BENCH_SAMPLES=32         samples
  QUANTD_BENCH_SEQ_LEN=128        tokens per sample
  QUANTD_BENCH_THREADS=2          CPU threads for both (torch.set_num_threads, --threads)
  QUANTD_BENCH_REPEAT=3           runs per measurement
Needs the interop virtualenv (torch, transformers): scripts/setup.sh makes it.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "interop"))

import torch  # noqa: E402

from v4_tiny_model import build_tiny_model  # noqa: E402

DONE_LINE = re.compile(r"calibrated (\d+) layers on (\d+) tokens in ([\d.]+) s")

# The widths of quantd's fixture presets (server/fixture/fixture_spec.cc V4Config); the tiny
# preset is the oracle model as it is.
PRESETS = {
    "tiny": {},
    "small": {"hidden_size": 1024, "vocab_size": 32768, "num_hidden_layers": 4,
              "num_hash_layers": 2, "compress_ratios": [0, 4, 128, 4, 0],
              "num_attention_heads": 8, "head_dim": 512, "q_lora_rank": 512, "o_groups": 4,
              "o_lora_rank": 512, "sliding_window": 128, "index_n_heads": 16,
              "index_head_dim": 128, "index_topk": 64, "n_routed_experts": 32,
              "num_experts_per_tok": 4, "moe_intermediate_size": 512},
    "bench": {"hidden_size": 2048, "vocab_size": 129280, "num_hidden_layers": 6,
              "num_hash_layers": 3, "compress_ratios": [0, 0, 4, 128, 4, 128, 0],
              "num_attention_heads": 16, "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8,
              "o_lora_rank": 1024, "sliding_window": 128, "index_n_heads": 32,
              "index_head_dim": 128, "index_topk": 256, "n_routed_experts": 64,
              "num_experts_per_tok": 6, "moe_intermediate_size": 512},
}


def quantd():
    if "QUANTD_BIN" in os.environ:
        return os.environ["QUANTD_BIN"]
    return str(Path(os.environ.get("QUANTD_BUILD_DIR", REPO / "build")) / "server" / "quantd")


def ours_tokens_per_s(ckpt, ids, numerics, threads, repeat, tmp):
    data = tmp / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": row.tolist()}) + "\n" for row in ids))
    spec = tmp / f"spec-{numerics}.json"
    spec.write_text(json.dumps({
        "source": str(ckpt), "output": str(tmp / "unused"),
        "calibration": {"datasets": [{"path": str(data), "samples": ids.shape[0]}],
                        "seq_len": ids.shape[1], "min_seq_len": 1, "numerics": numerics}}))
    best = 0.0
    for _ in range(repeat):
        proc = subprocess.run(
            [quantd(), "calibrate", str(spec), "--amax-out", str(tmp / "amax.json"),
             "--threads", str(threads), "--tokenizer",
             str(REPO / "tests/data/deepseek_v3_tokenizer")],
            capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"quantd calibrate failed:\n{proc.stderr[-2000:]}")
        done = DONE_LINE.search(proc.stdout + proc.stderr)
        if done is None:
            sys.exit("quantd calibrate printed no 'calibrated ... tokens in ... s' line")
        best = max(best, int(done.group(2)) / float(done.group(3)))
    return best


def hf_tokens_per_s(model, ids, batched, repeat):
    best = 0.0
    with torch.no_grad():
        for _ in range(repeat):
            start = time.perf_counter()
            if batched:
                model.model(input_ids=ids, use_cache=False)
            else:
                for row in ids:
                    model.model(input_ids=row[None], use_cache=False)
            best = max(best, ids.numel() / (time.perf_counter() - start))
    return best


def main():
    presets = os.environ.get("QUANTD_BENCH_PRESETS", "tiny small").split()
    samples = int(os.environ.get("QUANTD_BENCH_SAMPLES", "32"))
    seq_len = int(os.environ.get("QUANTD_BENCH_SEQ_LEN", "128"))
    threads = int(os.environ.get("QUANTD_BENCH_THREADS", "2"))
    repeat = int(os.environ.get("QUANTD_BENCH_REPEAT", "3"))
    if not Path(quantd()).is_file():
        sys.exit(f"{quantd()} is missing: build quantd first")
    torch.set_num_threads(threads)
    print(f"{samples} samples x {seq_len} tokens, {threads} threads, best of {repeat}")
    print(f"{'preset':8} {'quantd math':>12} {'quantd official':>16} {'hf batched':>11} "
          f"{'hf one by one':>14} {'math/hf':>8} {'official/hf':>12}")
    for preset in presets:
        with tempfile.TemporaryDirectory(prefix="quantd-fwd-bench-") as d:
            tmp = Path(d)
            model, ids = build_tiny_model(tmp / "ckpt", PRESETS[preset], samples, seq_len)
            math = ours_tokens_per_s(tmp / "ckpt", ids, "math", threads, repeat, tmp)
            official = ours_tokens_per_s(tmp / "ckpt", ids, "official", threads, repeat, tmp)
            batched = hf_tokens_per_s(model, ids, True, repeat)
            one_by_one = hf_tokens_per_s(model, ids, False, repeat)
            print(f"{preset:8} {math:12.0f} {official:16.0f} {batched:11.0f} {one_by_one:14.0f} "
                  f"{math / batched:8.2f} {official / batched:12.2f}", flush=True)
            del model


if __name__ == "__main__":
    main()
