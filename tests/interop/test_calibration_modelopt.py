"""Calibration against ModelOpt's own max calibration.

The tiny transformers DeepSeek-V4 of v4_tiny_model.py (same weights in the official layout, same
token ids) is calibrated twice: by ModelOpt (`mtq.quantize` with NVFP4_DEFAULT_CFG, algorithm
"max", on the CPU) and by `quantd calibrate` in `math` numerics with `w2_input: unweighted`
(transformers, like the runtimes, applies the routing weight after `down_proj`). Every input amax
ModelOpt records must equal quantd's within test_v4_forward.TOLERANCE (float32 summation order;
derivation there).

What ModelOpt instruments: every nn.Linear of the attention and the shared expert, and the fused
routed experts (`DeepseekV4Experts`, through its generic `_QuantFusedExperts`) with ONE input
quantizer per projection shared by all experts of the layer: its amax is the layer's max over
experts (quantd's `expert_amax: layer_max`). The router (`DeepseekV4TopKRouter`, not an
nn.Linear) is not instrumented and lm_head is disabled by the config. So ModelOpt does not reach
the per-expert amax: those are compared through forward hooks on the expert weights instead
(HF's own F.linear inputs of each expert).
"""

import json

import pytest
import torch

from test_v4_forward import TOLERANCE
from v4_tiny_model import LINEAR_NAMES, SEQ_LEN, SEQUENCES, build_tiny_model

transformers = pytest.importorskip("transformers")
mtq = pytest.importorskip("modelopt.torch.quantization")

from conftest import REPO  # noqa: E402


def expert_hooks(model, amax):
    """Per-expert input amax of w1/w3 and the unweighted w2 input, from the experts' F.linear."""
    handles = []
    for n, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts

        def hook(module, args, n=n, experts=experts):
            flat, index, _ = args
            for e in range(experts.gate_up_proj.shape[0]):
                _, tok = torch.where((index == e).T)
                if tok.numel() == 0:
                    continue
                x = flat[tok]
                a = experts._apply_gate(torch.nn.functional.linear(x, experts.gate_up_proj[e]))
                p = f"layers.{n}.ffn.experts.{e}."
                for name, v in ((p + "w1", x), (p + "w3", x), (p + "w2", a)):
                    amax[name] = max(amax.get(name, 0.0), float(v.abs().max()))

        handles.append(experts.register_forward_pre_hook(hook))
    return handles


def modelopt_amax(model):
    """Official module name -> amax of every calibrated ModelOpt input quantizer."""
    out, unknown = {}, []
    for name, module in model.named_modules():
        for attr, official in (("input_quantizer", None),
                               ("gate_up_proj_input_quantizer", "experts.w13"),
                               ("down_proj_input_quantizer", "experts.w2")):
            q = getattr(module, attr, None)
            if q is None or not q.is_enabled or getattr(q, "amax", None) is None:
                continue
            parts = name.split(".")
            if parts[:2] != ["model", "layers"]:
                unknown.append(name)
                continue
            n, local = parts[2], ".".join(parts[3:])
            if official is not None:
                out[f"layers.{n}.ffn.{official}"] = float(q.amax.max())
            elif local in LINEAR_NAMES:
                out[f"layers.{n}.{LINEAR_NAMES[local]}"] = float(q.amax.max())
            else:
                unknown.append(name)
    assert not unknown, f"ModelOpt instruments modules this test does not map: {unknown}"
    return out


@pytest.fixture(scope="module")
def calibrations(qd, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calibration_modelopt")
    model, ids = build_tiny_model(tmp / "ckpt")
    hooked = {}
    handles = expert_hooks(model, hooked)
    config = mtq.NVFP4_DEFAULT_CFG

    def forward_loop(m):
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)

    mtq.quantize(model, config, forward_loop)
    for h in handles:
        h.remove()

    data = tmp / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": row.tolist()}) + "\n" for row in ids))
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({
        "source": str(tmp / "ckpt"), "output": str(tmp / "unused"),
        "calibration": {"datasets": [{"path": str(data), "samples": SEQUENCES}],
                        "seq_len": SEQ_LEN, "min_seq_len": 1, "numerics": "math",
                        "w2_input": "unweighted"}}))
    table = tmp / "table.json"
    qd._run_ok([qd.quantd, "calibrate", spec, "--amax-out", tmp / "amax.json",
                "--table-out", table, "--tokenizer", REPO / "tests/data/deepseek_v3_tokenizer"])
    ours = json.loads(table.read_text())["modules"]
    return {"modelopt": modelopt_amax(model), "hooked": hooked, "ours": ours}


def ours_amax(ours, module):
    if module.endswith(".ffn.experts.w13") or module.endswith(".ffn.experts.w2"):
        layer = module[: -len(".experts.w13") if module.endswith("w13") else -len(".experts.w2")]
        projs = ("w1", "w3") if module.endswith("w13") else ("w2",)
        key = "unweighted_amax" if projs == ("w2",) else "amax"
        return max(row[key] for m, row in ours.items()
                   if m.startswith(layer + ".experts.") and m.rsplit(".", 1)[1] in projs)
    return ours[module]["amax"]


def test_every_modelopt_input_amax_equals_quantds_math_calibration(calibrations):
    mo, ours = calibrations["modelopt"], calibrations["ours"]
    assert len(mo) >= 4 * 10, sorted(mo)
    errors = {m: abs(ours_amax(ours, m) - v) / v for m, v in mo.items()}
    worst = max(errors, key=errors.get)
    print(f"{len(errors)} ModelOpt input quantizers; worst relative error {errors[worst]:.2e} ({worst})")
    assert errors[worst] <= TOLERANCE, {m: e for m, e in errors.items() if e > TOLERANCE}


def test_per_expert_amax_equals_transformers_hooks(calibrations):
    hooked, ours = calibrations["hooked"], calibrations["ours"]
    assert hooked
    errors = {}
    for m, v in hooked.items():
        row = ours[m]
        got = row["unweighted_amax"] if m.endswith(".w2") else row["amax"]
        errors[m] = abs(got - v) / v
    worst = max(errors, key=errors.get)
    print(f"{len(errors)} per-expert inputs; worst relative error {errors[worst]:.2e} ({worst})")
    assert errors[worst] <= TOLERANCE, {m: e for m, e in errors.items() if e > TOLERANCE}
