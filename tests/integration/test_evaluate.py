"""`quantd evaluate`: the quantized output against its source on held-out samples.

On the tiny DeepSeek-V4 fixture (its own byte-level tokenizer) with the repository's
calibration text:
  - a checkpoint against itself, and outputs that equal the source in exact arithmetic (the
    BF16 materialization of the FP8/MXFP4 source, and a W4A16 output whose experts were cast
    losslessly from MXFP4), evaluated in `math` numerics, give KL 0, top-1 agreement 1 and
    perplexity ratio 1 exactly, and infinite SQNR (null in JSON) at every layer. (`official`
    numerics would differ there by design: the source's FP8 activation simulation belongs to its
    FP8 / MXFP4 GEMMs, which a BF16 or W4A16 reader does not run);
  - a W4A4 output with one routed expert's weight_scale bytes zeroed (by the test) breaks a gate
    that the undamaged output passes; the message names the figure and layer 1, the only layer
    whose teacher-forced SQNR changes.
"""

import json
import struct

import pytest

from run_helpers import write_spec
from conftest import REPO

CALIBRATION = {"datasets": [{"path": str(REPO / "tests" / "data" / "calibration_sample.jsonl"),
                             "samples": 8}],
               "seq_len": 48, "min_seq_len": 16}
GATE_BROKEN = 3
DAMAGED = "layers.1.ffn.experts.3.w1.weight_scale"


def zero_tensor(checkpoint, name):
    """Overwrites the bytes of tensor `name` in its shard with zeros."""
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    shard = checkpoint / index[name]
    raw = bytearray(shard.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8:8 + header_len])[name]["data_offsets"]
    raw[8 + header_len + begin:8 + header_len + end] = bytes(end - begin)
    shard.write_bytes(raw)


@pytest.fixture(scope="module")
def job(qd, tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    src = root / "tiny-v4"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "tiny", "--seed", 1, src)
    amax = root / "amax.json"
    spec = write_spec(root / "calibrate.json", src, root / "unused", calibration=CALIBRATION)
    qd.run_ok("calibrate", spec, "--amax-out", amax, "--threads", 1)

    def evaluate(spec, *extra, ok=True):
        out = root / f"report{len(list(root.glob('report*.json')))}.json"
        proc = (qd.run_ok if ok else qd.run)("evaluate", spec, "--out", out, "--threads", 1, *extra)
        return proc, (json.loads(out.read_text()) if out.exists() else None)

    return {"root": root, "src": src, "amax": amax, "evaluate": evaluate}


def assert_identical(report):
    n = report["next_token"]
    assert n["mean_kl"] == 0 and n["p99_kl"] == 0 and n["max_kl"] == 0, n
    assert n["top1_agreement"] == 1 and n["ppl_ratio"] == 1, n
    assert n["positions"] == report["tokens"] > 0
    for layer in report["layers"]:
        assert layer["free_running_sqnr_db"] is None, layer
        assert layer["teacher_forced_sqnr_db"] is None, layer
    assert report["worst_layer"] == -1


def test_a_checkpoint_against_itself_is_exact(qd, job):
    root, src = job["root"], job["src"]
    spec = write_spec(root / "self.json", src, src, calibration=CALIBRATION,
                      evaluate={"num_samples": 8, "gate": {"max_mean_kl": 0, "min_top1_agreement": 1,
                                                           "max_ppl_ratio": 1}})
    proc, report = job["evaluate"](spec)
    assert_identical(report)
    assert report["samples"] == 8 and report["numerics"] == "official"
    assert report["gate"] == {"passed": True, "broken": []}
    config = json.loads((src / "config.json").read_text())
    assert [l["layer"] for l in report["layers"]] == list(range(config["num_hidden_layers"]))
    assert "top-1 agreement 1.0000" in proc.stdout


def test_bf16_materialization_and_lossless_w4a16_equal_the_source_in_math_numerics(qd, job):
    root, src = job["root"], job["src"]
    calibration = {**CALIBRATION, "numerics": "math"}
    spec = write_spec(root / "w4a16.json", src, root / "w4a16", bf16=root / "bf16",
                      weight_format="w4a16_nvfp4", recipe="experts", expert_cast="lossless",
                      calibration=calibration, evaluate={"num_samples": 8})
    qd.run_ok("run", "--state", root / "w4a16.db", "--device", "cpu", "--threads", 1, spec)
    _, w4a16 = job["evaluate"](spec)
    assert_identical(w4a16)
    _, bf16 = job["evaluate"](spec, "--quantized", root / "bf16")
    assert_identical(bf16)


def test_zeroed_expert_scales_break_the_gate_naming_the_layer(qd, job):
    root, src = job["root"], job["src"]
    out = root / "w4a4"
    spec = write_spec(root / "w4a4.json", src, out, weight_format="nvfp4", recipe="experts",
                      calibration={**CALIBRATION, "amax_file": str(job["amax"])},
                      evaluate={"num_samples": 16})
    qd.run_ok("run", "--state", root / "w4a4.db", "--device", "cpu", "--threads", 1, spec)
    _, good = job["evaluate"](spec)
    n = good["next_token"]
    assert 0 < n["mean_kl"] and n["top1_agreement"] < 1  # W4A4 changes the model...
    for layer in good["layers"]:
        assert layer["teacher_forced_sqnr_db"] > 10, layer  # ...but not beyond recognition

    # A gate 10% above the undamaged output's KL: it passes.
    gated = json.loads(spec.read_text())
    gated["evaluate"]["gate"] = {"max_mean_kl": n["mean_kl"] * 1.1}
    spec.write_text(json.dumps(gated))
    _, passed = job["evaluate"](spec)
    assert passed["gate"]["passed"] and passed["next_token"] == n

    zero_tensor(out, DAMAGED)
    proc, damaged = job["evaluate"](spec, ok=False)
    assert proc.returncode == GATE_BROKEN, proc.stderr
    assert "quality gate: mean_kl" in proc.stderr and "max_mean_kl" in proc.stderr, proc.stderr
    assert "lowest teacher-forced SQNR at layer 1" in proc.stderr, proc.stderr
    assert damaged["gate"]["passed"] is False and damaged["worst_layer"] == 1
    assert damaged["next_token"]["mean_kl"] > n["mean_kl"] * 1.1
    # Teacher forcing isolates the damage: layers 0 and 2 see the source's activations and keep
    # their SQNR bit for bit; layer 1 loses at least 6 dB.
    before = {l["layer"]: l["teacher_forced_sqnr_db"] for l in good["layers"]}
    after = {l["layer"]: l["teacher_forced_sqnr_db"] for l in damaged["layers"]}
    assert after[0] == before[0] and after[2] == before[2]
    assert after[1] < before[1] - 6, (before, after)


def test_compressed_tensors_output_computes_what_the_modelopt_output_does(qd, job):
    # The same W4A4 conversion (every attention and expert linear) in both export formats: the
    # same codes and block scales; compressed-tensors stores 1 / weight_scale_2 and
    # 1 / input_scale, which the reader inverts again, so some scales come back one float32 ulp
    # off (23 of the fixture's 496 tensors). One ulp of input_scale flips the E4M3 rounding of
    # activation block scales that sit on a tie, a different but equally fine quantization: each
    # layer's own loss (teacher-forced SQNR) stays within 0.5 dB, while the next-token figures of
    # this tiny random model move by up to ~10% (its logits amplify any change), so they are
    # only required to be present and non-trivial.
    root, src = job["root"], job["src"]
    reports = {}
    for fmt in ("modelopt", "compressed-tensors"):
        spec = write_spec(root / f"full-{fmt}.json", src, root / f"full-{fmt}", recipe="full",
                          weight_format="nvfp4", export_format=fmt,
                          calibration={**CALIBRATION, "amax_file": str(job["amax"])},
                          evaluate={"num_samples": 8})
        qd.run_ok("run", "--state", root / f"full-{fmt}.db", "--device", "cpu", "--threads", 1,
                  spec)
        reports[fmt] = job["evaluate"](spec)[1]
    mo, ct = reports["modelopt"], reports["compressed-tensors"]
    for a, b in zip(mo["layers"], ct["layers"]):
        assert abs(a["teacher_forced_sqnr_db"] - b["teacher_forced_sqnr_db"]) < 0.5, (a, b)
    for r in (mo, ct):
        assert 0 < r["next_token"]["mean_kl"] < 5 and 0 < r["next_token"]["top1_agreement"] < 1


def test_bad_input_is_named(qd, job):
    root, src = job["root"], job["src"]
    no_data = write_spec(root / "nodata.json", src, src)
    proc = qd.run("evaluate", no_data)
    assert proc.returncode == 1
    assert "held-out samples" in proc.stderr and "calibration" in proc.stderr, proc.stderr
    bad = root / "bad.json"
    bad.write_text(json.dumps({"source": str(src), "output": str(src),
                               "evaluate": {"gate": {"max_mean_kl": -1}}}))
    proc = qd.run("evaluate", bad)
    assert proc.returncode == 2 and "evaluate.gate.max_mean_kl" in proc.stderr, proc.stderr
