"""`quantd calibrate`: layer-by-layer calibration of the tiny DeepSeek-V4 fixture on the built-in
calibration text, then `quantd run` W4A4 with the amax file it wrote, then `quantd verify`.

The fixture's vocabulary (1024) is smaller than the DeepSeek tokenizer's, so the token ids are
folded into it (--fold-token-ids); the forward, the observer and the export are the real ones.
"""

import json
import re
import struct

import pytest
from safetensors import safe_open

from run_helpers import write_spec
from conftest import REPO

DATA = REPO / "tests" / "data"
TOKENIZER = DATA / "deepseek_v3_tokenizer"
CALIBRATION = {"datasets": [{"path": str(DATA / "calibration_sample.jsonl"), "samples": 8}],
               "seq_len": 48, "min_seq_len": 16}
EXPERT = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])")


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.fixture(scope="module")
def calibrated(qd, tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    src = root / "tiny-v4"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "tiny", "--seed", 5, src)
    spec = write_spec(root / "calibrate.json", src, root / "unused", calibration=CALIBRATION)

    def calibrate(name, *extra):
        amax, table = root / f"{name}.amax.json", root / f"{name}.table.json"
        proc = qd.run_ok("calibrate", spec, "--amax-out", amax, "--table-out", table,
                         "--tokenizer", TOKENIZER, "--fold-token-ids", "--threads", 1, *extra)
        return {"amax": amax, "table": table, "stderr": proc.stderr, "stdout": proc.stdout}

    return {"root": root, "src": src, "one": calibrate("one"),
            "two": calibrate("two", "--slices", 2, "--spill-dir", root)}


def test_calibrate_reports_progress_and_writes_every_expert(calibrated):
    one = calibrated["one"]
    config = json.loads((calibrated["src"] / "config.json").read_text())
    layers, experts = config["num_hidden_layers"], config["n_routed_experts"]
    for k in range(1, layers + 1):
        assert f"layer {k} of {layers}:" in one["stderr"], one["stderr"]
    assert "tokens/s" in one["stderr"] and "ETA" in one["stderr"]
    amax = json.loads(one["amax"].read_text())
    table = json.loads(one["table"].read_text())["modules"]
    for layer in range(layers):
        for e in range(experts):
            p = f"layers.{layer}.ffn.experts.{e}."
            for proj in ("w1", "w2", "w3"):
                assert amax[p + proj] > 0, p + proj
            assert amax[p + "w1"] == amax[p + "w3"]
            row = table.get(p + "w2")
            if row is not None:  # reached: the default w2_input is the max of both inputs
                assert amax[p + "w2"] == max(row["amax"], row["unweighted_amax"])
                assert amax[p + "w2.weighted"] == row["amax"]
                assert amax[p + "w2.unweighted"] == row["unweighted_amax"]
                assert row["unweighted_amax"] <= 10 * 10 / (1 + 2.718281828459045 ** -10) * (1 + 1 / 256)
    # Every linear the forward observed is in the file, not only the quantized ones.
    for m in ("layers.0.attn.wq_a", "layers.1.attn.indexer.wq_b", "layers.2.ffn.gate",
              "layers.2.ffn.shared_experts.w2"):
        assert amax[m] > 0, m


def test_two_slices_spilled_give_identical_bytes(calibrated):
    one, two = calibrated["one"], calibrated["two"]
    assert one["amax"].read_bytes() == two["amax"].read_bytes()
    t1, t2 = json.loads(one["table"].read_text()), json.loads(two["table"].read_text())
    assert t1["modules"] == t2["modules"]
    assert len(t2["slices"]) == 2 * len(t1["slices"])
    # Spilled activations are removed once the next layer read them, the last layer's at the end.
    assert not list(calibrated["root"].glob("layer*"))


def test_run_with_the_amax_file_writes_amax_over_2688_and_verifies(qd, calibrated):
    root = calibrated["root"]
    out = root / "out"
    spec = write_spec(root / "run.json", calibrated["src"], out, weight_format="nvfp4",
                      recipe="experts", calibration={"amax_file": str(calibrated["one"]["amax"])})
    qd.run_ok("run", "--state", root / "state.db", "--device", "cpu", "--threads", 1, spec)
    qd.run_ok("verify", out)
    amax = json.loads(calibrated["one"]["amax"].read_text())
    checked = 0
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if not name.endswith(".input_scale"):
                    continue
                module = name[: -len(".input_scale")]
                assert EXPERT.fullmatch(module), name
                scale = f.get_tensor(name).float().item()
                assert scale == f32(f32(amax[module]) / 2688.0), (name, scale, amax[module])
                checked += 1
    config = json.loads((calibrated["src"] / "config.json").read_text())
    assert checked == 3 * config["num_hidden_layers"] * config["n_routed_experts"]


def test_constant_mode_writes_2688_without_a_forward(qd, calibrated):
    root = calibrated["root"]
    spec = write_spec(root / "constant.json", calibrated["src"], root / "unused",
                      calibration={"mode": "constant"})
    path = root / "constant.amax.json"
    qd.run_ok("calibrate", spec, "--amax-out", path)
    amax = json.loads(path.read_text())
    assert amax and set(amax.values()) == {2688.0}
    assert "layers.0.ffn.experts.0.w1" in amax
