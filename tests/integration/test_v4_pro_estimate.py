"""scripts/v4_pro_estimate.py (issue 12's paper estimate): its byte model reproduces the tensor
shapes of deepseek_v4_format.md and the size of the real DeepSeek-V4 Pro checkpoint, and its FLOP
count is the sum of the layer's matrix products."""

import importlib.util
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "scripts" / "v4_pro_estimate.py"


def load():
    spec = importlib.util.spec_from_file_location("v4_pro_estimate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bytes_match_the_documented_shapes():
    e = load()
    # wq_a F8_E4M3 [1536,7168] + F8_E8M0 [12,56]; experts.E.w1 I8 [3072,3584] + F8_E8M0 [3072,224].
    assert e.fp8(1536, 7168) == 1536 * 7168 + 12 * 56
    assert e.mxfp4(3072, 7168) == 3072 * 3584 + 3072 * 224
    # Layers 0-1 HCA+hash, 2 CSA+hash, then CSA at even and HCA at odd layers up to 60.
    kinds = e.layer_kinds(e.PRO)
    assert kinds[(128, True)] == [0, 1] and kinds[(4, True)] == [2]
    assert kinds[(4, False)] == list(range(4, 61, 2))
    assert kinds[(128, False)] == list(range(3, 60, 2))


def test_flops_of_a_window_layer_are_its_products():
    e = load()
    c = dict(e.PRO, compress_ratios=[0])
    d, q, hd = 7168, 1536, 512
    macs = (q * d + 128 * hd * q + hd * d + 16 * 1024 * 4096 + d * 16 * 1024  # attention linears
            + 2 * 128 * hd * (1 + 2) / 2                       # seq_len 2: 1 then 2 visible keys
            + 384 * d + 2 * 6 * 4 * 4 * d                      # router, hc_pre of both sub-blocks
            + 7 * 3 * 3072 * d)                                # 6 routed + 1 shared expert
    assert e.layer_flops(c, 0, 2) == 2 * macs


def test_prints_the_table_and_the_checkpoint_size():
    out = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True,
                         check=True).stdout
    # The real checkpoint: 805.33 (GiB) in 64 shards.
    assert "whole checkpoint 805.3 GiB" in out
    assert "128 samples:" in out and "512 samples:" in out and "1024 samples:" in out
    # Memory per GPU and seconds per stage on both machines, for each sample count.
    for machine in ("8xB200", "8xH100"):
        assert f"  {machine}: " in out and "GB per GPU" in out
        rows = [line.split() for line in out.splitlines() if line.strip().startswith(machine)
                and len(line.split()) == 6]
        assert [int(r[1]) for r in rows] == [128, 512, 1024], rows
    assert "measured (scripts/real_scale.sh" in out


def test_the_layer_memory_model_counts_the_dense_weights_and_the_batch():
    e = load()
    c = e.PRO
    # An HCA layer's dense linears: attention (wq_a, wq_b, wkv, wo_a, wo_b), the compressor's wkv
    # and wgate, the router and the shared expert, in BF16; the hc mixers in float32.
    values = (1536 * 7168 + 65536 * 1536 + 512 * 7168 + 16384 * 4096 + 7168 * 16384
              + 2 * 512 * 7168 + 384 * 7168 + 3 * 3072 * 7168)
    assert e.dense_decoded_bytes(c, 128) == 2 * values + 4 * 2 * 24 * 4 * 7168
    # calibration/calibrate_layer.cc EstimateBatchBytes: one 512-token sequence at Pro width.
    per_token = 4 * 4 * 7168 + 4 * 7168 + 1536 + 3 * 128 * 512 + 384 + 3 * 7 * 3072
    assert e.batch_bytes(c, 1, 512) == 4 * (512 * per_token + 128 * 512 * 512)
