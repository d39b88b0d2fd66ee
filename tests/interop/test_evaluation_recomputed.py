"""The evaluate stage's figures, recomputed independently (issue 23 item 2).

The tiny transformers DeepSeek-V4 of v4_tiny_model.py is written in the official layout, and
`quantd run` converts it to W4A4 NVFP4 with calibration and evaluation, in `math` numerics (fp32
throughout, as transformers runs), for both recipes (`experts`, `full`) and both `w2_input`
settings (`weighted`, `unweighted`). Then every figure the job stored (next-token mean, p99 and
max KL, top-1 agreement, both perplexities and their ratio, each layer's free-running and
teacher-forced SQNR) is recomputed without quantd's code:
  - the source model is transformers' own DeepseekV4ForCausalLM with the source's decoded
    weights (v4_tiny_model.py);
  - the quantized model is the same with every module the output declares NVFP4 decoded by
    ModelOpt (`NVFP4QTensor.dequantize` with weight_scale and weight_scale_2) and, as every one
    of them ships an `input_scale`, its input fake-quantized with ModelOpt's NVFP4 quantizer
    (`NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=input_scale)`, then dequantize;
    blocks whose E4M3 scale underflows to 0 zeroed, as the runtimes' kernels do: see
    test_nvfp4_fake_quant.py); routed experts run transformers' own loop with the w1/w3 input
    and the unweighted w2 input quantized, the routing weight applied after w2;
  - the held-out samples are the ones quantd's calibration data rules give (the file's lines in
    the seeded SplitMix64 order of calibration/calibration_data.h, the evaluation taking the
    samples after the calibration ones), checked against the job's sample and token counts;
  - the figures follow their definitions (evaluation/next_token_metrics.h, sqnr.h).
Modules the output leaves unquantized keep the source's values (the BF16 copies of FP8 modules in
the `full` layout are bit-equal decodings: test_pipeline_output.py).

Noise band. quantd's forward and transformers' compute the same real numbers in another float32
order: their activations differ by about 1e-6 relative (test_v4_forward.py measures ~1e-6). NVFP4
rounding turns that into occasional discrete flips (an E2M1 value or an E4M3 block scale on the
other side of a rounding threshold), whose effect on the figures is measured directly: the
recomputation is repeated PERTURBATIONS times with every quantized input multiplied by
(1 + 1e-6 s), s = +-1 drawn per element, and a figure's band is MARGIN times the largest change
that caused plus what the float32 difference itself does where no rounding flips (the source's
perplexity has no quantized input; a layer's teacher-forced SQNR may see no flip):
float32_difference. quantd's figure must lie within the band of the unperturbed recomputation.
The band is wide for the next-token figures (a flipped rounding can flip a routing or indexer
top-k choice, and the change runs down the sequence: mean KL moves by ~1-4% of itself here) and
narrow for the teacher-forced SQNR of each layer (one layer on the source's activations, nothing
accumulated: ~1e-3 dB). A module
evaluated unlike its export (the grouped `attn.wo_a` shipped W4A4 while quantd's evaluator ran
it unquantized, as the `full` recipe did before issue 23) moves the figures far outside it.
"""

import copy
import json
import math
import sqlite3
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from v4_tiny_model import CONFIG, LINEAR_NAMES, build_tiny_model

transformers = pytest.importorskip("transformers")

CALIBRATION_SAMPLES, EVALUATION_SAMPLES, SEQ_LEN = 8, 8, 160
DATA_SEED = 4321
RUN_FLAGS = ["--device", "cpu", "--workers", "2", "--threads", "1"]
PERTURBATION = 1e-6
PERTURBATIONS = 2
MARGIN = 3.0
FP32_FLOOR = 1e-6
E4M3_TINY = 2.0 ** -10
CASES = [(recipe, w2) for recipe in ("experts", "full") for w2 in ("weighted", "unweighted")]
NEXT_TOKEN = ["mean_kl", "p99_kl", "max_kl", "top1_agreement", "source_ppl", "quantized_ppl",
              "ppl_ratio"]

OFFICIAL_TO_HF = {official: hf for hf, official in LINEAR_NAMES.items()}
U64 = (1 << 64) - 1


# ---- the held-out samples: calibration_data.h's seeded order -------------------------------------

class SplitMix64:
    def __init__(self, seed):
        self.state = seed & U64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & U64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
        return z ^ (z >> 31)

    def below(self, n):
        limit = U64 - U64 % n
        while True:
            x = self.next()
            if x < limit:
                return x % n


def seeded_order(lines, seed=0, file_index=0):
    order = list(range(lines))
    rng = SplitMix64(seed ^ ((0xD1B54A32D192ED03 * (file_index + 1)) & U64))
    for i in range(lines, 1, -1):
        j = rng.below(i)
        order[i - 1], order[j] = order[j], order[i - 1]
    return order


# ---- ModelOpt's NVFP4 ----------------------------------------------------------------------------

def nvfp4_qtensor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    assert modelopt.__version__.startswith("0.47"), modelopt.__version__
    return NVFP4QTensor


class FakeQuant:
    """ModelOpt's NVFP4 activation quantization under a calibrated input_scale; with `seed`, every
    input is first multiplied by (1 + PERTURBATION s), s = +-1 per element."""

    def __init__(self, qtensor, seed=None):
        self.qtensor = qtensor
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    def __call__(self, x, input_scale):
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).float()
        if flat.shape[0] == 0:
            return x
        if self.generator is not None:
            signs = torch.randint(0, 2, flat.shape, generator=self.generator).float() * 2 - 1
            flat = flat * (1 + PERTURBATION * signs)
        scale_2 = input_scale.float().reshape(())
        q, scale, scale_2 = self.qtensor.quantize(flat, 16, weights_scaling_factor_2=scale_2)
        y = q.dequantize(torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
        blocks = flat.view(flat.shape[0], -1, 16)
        underflow = blocks.abs().amax(-1) / (6.0 * scale_2) <= E4M3_TINY
        y = y.reshape(blocks.shape).masked_fill(underflow[..., None], 0.0)
        return y.reshape(shape).to(x.dtype)


def decode_nvfp4(qtensor, tensors, module):
    packed = tensors[f"{module}.weight"]
    rows, half = packed.shape
    q = qtensor((rows, 2 * half), torch.float32, packed)
    return q.dequantize(dtype=torch.float32, scale=tensors[f"{module}.weight_scale"],
                        double_scale=tensors[f"{module}.weight_scale_2"], block_sizes={-1: 16})


# ---- the quantized transformers model ------------------------------------------------------------

def quantized_model(source_model, output_tensors, qtensor, fake_quant):
    """A copy of `source_model` with the output's NVFP4 modules decoded and their inputs
    fake-quantized; returns (model, the official names of the W4A4 modules)."""
    model = copy.deepcopy(source_model)
    modules = sorted(n[: -len(".input_scale")] for n in output_tensors
                     if n.endswith(".input_scale"))
    assert modules and all(f"{m}.weight_scale_2" in output_tensors for m in modules)
    inter = CONFIG["moe_intermediate_size"]
    experts = {}  # (layer, expert) -> {"w13": input_scale, "w2": input_scale}
    with torch.no_grad():
        for m in modules:
            parts = m.split(".")
            layer = int(parts[1])
            local = ".".join(parts[2:])
            w = decode_nvfp4(qtensor, output_tensors, m)
            scale = output_tensors[f"{m}.input_scale"]
            block = model.model.layers[layer]
            if local in OFFICIAL_TO_HF:
                linear = block.get_submodule(OFFICIAL_TO_HF[local])
                assert linear.weight.shape == w.shape, m
                linear.weight.copy_(w)
                linear.register_forward_pre_hook(
                    lambda mod, args, s=scale: (fake_quant(args[0], s), *args[1:]))
                continue
            assert parts[2:4] == ["ffn", "experts"], f"no transformers module for {m}"
            e, leaf = int(parts[4]), parts[5]
            routed = block.mlp.experts
            if leaf == "w2":
                routed.down_proj[e].copy_(w)
            else:
                rows = slice(0, inter) if leaf == "w1" else slice(inter, 2 * inter)
                routed.gate_up_proj[e][rows].copy_(w)
            key = "w2" if leaf == "w2" else "w13"
            seen = experts.setdefault((layer, e), {})
            # w1 and w3 are one fused GEMM: they share one input_scale.
            assert key not in seen or torch.equal(seen[key], scale), m
            seen[key] = scale
    for n, layer in enumerate(model.model.layers):
        scales = {e: s for (l, e), s in experts.items() if l == n}
        if scales:
            quantize_experts(layer.mlp.experts, scales, fake_quant)
    return model, modules


def quantize_experts(routed, scales, fake_quant):
    """transformers' DeepseekV4Experts.forward with the W4A4 inputs quantized: w1/w3's input and
    w2's unweighted input; the routing weight multiplies w2's output."""
    def forward(hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        for e in range(routed.num_experts):
            top_k_pos, token_idx = torch.where((top_k_index == e).T)
            if token_idx.numel() == 0:
                continue
            s = scales.get(e, {})
            x = hidden_states[token_idx]
            if "w13" in s:
                x = fake_quant(x, s["w13"])
            current = routed._apply_gate(F.linear(x, routed.gate_up_proj[e]))
            if "w2" in s:
                current = fake_quant(current, s["w2"])
            current = F.linear(current, routed.down_proj[e]) * top_k_weights[token_idx, top_k_pos,
                                                                              None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final

    routed.forward = forward


# ---- the figures ---------------------------------------------------------------------------------

def layer_inputs_outputs(model, ids):
    """(logits, [layer call: (args, kwargs)], [layer output]) of one forward."""
    calls, outputs, handles = {}, {}, []
    for n, layer in enumerate(model.model.layers):
        def pre(module, args, kwargs, n=n):
            calls[n] = (tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args),
                        dict(kwargs))

        def post(module, args, kwargs, output, n=n):
            outputs[n] = (output[0] if isinstance(output, tuple) else output).detach().clone()
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    for h in handles:
        h.remove()
    n = len(model.model.layers)
    return logits, [calls[i] for i in range(n)], [outputs[i] for i in range(n)]


def teacher_forced_output(model, layer, source_call):
    """Layer `layer` of `model` called as the source model called its own (its input, the
    positions, the token ids)."""
    args, kwargs = source_call
    with torch.no_grad():
        output = model.model.layers[layer](*args, **kwargs)
    return output[0] if isinstance(output, tuple) else output


def sqnr_db(ref, x):
    r, e = ref.double(), x.double() - ref.double()
    signal, noise = float((r * r).sum()), float((e * e).sum())
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def next_token(source_logits, quantized_logits, ids):
    lp = torch.log_softmax(source_logits.double(), -1)
    lq = torch.log_softmax(quantized_logits.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).flatten()
    ranked = torch.sort(kl).values
    p99 = float(ranked[math.ceil(0.99 * kl.numel()) - 1])
    top1 = float((source_logits.argmax(-1) == quantized_logits.argmax(-1)).double().mean())
    target = ids[:, 1:, None]
    source_nll = float(-lp[:, :-1].gather(-1, target).mean())
    quantized_nll = float(-lq[:, :-1].gather(-1, target).mean())
    return {"mean_kl": float(kl.mean()), "p99_kl": p99, "max_kl": float(kl.max()),
            "top1_agreement": top1, "source_ppl": math.exp(source_nll),
            "quantized_ppl": math.exp(quantized_nll),
            "ppl_ratio": math.exp(quantized_nll) / math.exp(source_nll)}


def recompute(source, output_tensors, qtensor, ids, seed=None):
    """Every figure of the evaluate stage for the output, by transformers + ModelOpt."""
    fake_quant = FakeQuant(qtensor, seed)
    model, modules = quantized_model(source["model"], output_tensors, qtensor, fake_quant)
    logits, _, outputs = layer_inputs_outputs(model, ids)
    figures = next_token(source["logits"], logits, ids)
    for n in range(len(outputs)):
        figures[f"layer{n}.free_running_db"] = sqnr_db(source["outputs"][n], outputs[n])
        forced = teacher_forced_output(model, n, source["calls"][n])
        figures[f"layer{n}.teacher_forced_db"] = sqnr_db(source["outputs"][n], forced)
    return figures, modules


def float32_difference(figure, value):
    """What a 1e-6 relative difference of both models' values does to `figure` where no rounding
    flips: 1e-6 of a next-token figure; for an SQNR of D dB, whose noise sum(e^2) is made of
    errors e about 10^(-D/20) of the values, 2e-6 10^(D/20) of that sum, i.e. 10/ln(10) times
    that in dB."""
    if figure.endswith("_db"):
        return 10 / math.log(10) * 2 * FP32_FLOOR * 10 ** (value / 20)
    return FP32_FLOOR * abs(value)


def quantd_figures(state):
    con = sqlite3.connect(str(state))
    con.row_factory = sqlite3.Row
    try:
        job = con.execute("SELECT state FROM jobs").fetchall()
        e = dict(con.execute("SELECT * FROM evaluations").fetchone())
        layers = con.execute("SELECT * FROM evaluation_layers ORDER BY layer").fetchall()
    finally:
        con.close()
    assert [r["state"] for r in job] == ["SUCCEEDED"], job
    figures = {k: e[k] for k in NEXT_TOKEN}
    for row in layers:
        n = row["layer"]
        for kind in ("free_running", "teacher_forced"):
            signal, noise = row[f"{kind}_signal"], row[f"{kind}_noise"]
            figures[f"layer{n}.{kind}_db"] = (math.inf if noise == 0
                                              else 10 * math.log10(signal / noise))
    return figures, e


# ---- the jobs ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluation_recomputed")
    model, _ = build_tiny_model(root / "ckpt")
    lines = CALIBRATION_SAMPLES + EVALUATION_SAMPLES
    generator = torch.Generator().manual_seed(DATA_SEED)
    samples = torch.randint(0, CONFIG["vocab_size"], (lines, SEQ_LEN), generator=generator)
    data = root / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": row.tolist()}) + "\n" for row in samples))
    held_out = seeded_order(lines)[CALIBRATION_SAMPLES:]
    ids = samples[held_out]
    logits, calls, outputs = layer_inputs_outputs(model, ids)
    return {"root": root, "model": model, "data": data, "ids": ids, "logits": logits,
            "calls": calls, "outputs": outputs}


def run_job(qd, source, recipe, w2_input):
    root = source["root"] / f"{recipe}-{w2_input}"
    root.mkdir()
    spec = root / "spec.json"
    spec.write_text(json.dumps({
        "source": str(source["root"] / "ckpt"), "output": str(root / "out"),
        "recipe": recipe, "weight_format": "nvfp4",
        "calibration": {"datasets": [{"path": str(source["data"]),
                                      "samples": CALIBRATION_SAMPLES}],
                        "seq_len": SEQ_LEN, "min_seq_len": 1, "numerics": "math",
                        "w2_input": w2_input},
        "evaluate": {"num_samples": EVALUATION_SAMPLES}}))
    qd._run_ok([qd.quantd, "run", "--state", root / "state.db", *RUN_FLAGS, spec])
    tensors = {}
    for shard in sorted((root / "out").glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors, root / "state.db"


@pytest.fixture(scope="module")
def results(qd, source):
    qtensor = nvfp4_qtensor()
    out = {}

    def get(recipe, w2_input):
        if (recipe, w2_input) not in out:
            tensors, state = run_job(qd, source, recipe, w2_input)
            ours, row = quantd_figures(state)
            base, modules = recompute(source, tensors, qtensor, source["ids"])
            perturbed = [recompute(source, tensors, qtensor, source["ids"], seed=s)[0]
                         for s in range(1, PERTURBATIONS + 1)]
            band = {k: MARGIN * (max(abs(p[k] - base[k]) for p in perturbed)
                                 + float32_difference(k, base[k])) for k in base}
            out[(recipe, w2_input)] = {"ours": ours, "row": row, "base": base, "band": band,
                                       "modules": modules}
        return out[(recipe, w2_input)]
    return get


@pytest.mark.parametrize("recipe,w2_input", CASES)
def test_figures_equal_the_transformers_modelopt_recomputation(results, recipe, w2_input):
    r = results(recipe, w2_input)
    ours, base, band, row = r["ours"], r["base"], r["band"], r["row"]
    assert (row["samples"], row["tokens"], row["numerics"]) == (
        EVALUATION_SAMPLES, EVALUATION_SAMPLES * SEQ_LEN, "math")
    assert (row["positions"], row["predicted"]) == (
        EVALUATION_SAMPLES * SEQ_LEN, EVALUATION_SAMPLES * (SEQ_LEN - 1))
    assert sorted(ours) == sorted(base)
    wo_a = [m for m in r["modules"] if m.endswith(".attn.wo_a")]
    assert not wo_a, f"the output declares the grouped output projection W4A4: {wo_a}"
    print(f"\n{recipe} / w2_input {w2_input}: {len(r['modules'])} W4A4 modules")
    print(f"  {'figure':28} {'quantd':>14} {'recomputed':>14} {'|diff|':>10} {'band':>10}")
    outside = {}
    for k in sorted(base):
        diff = abs(ours[k] - base[k])
        print(f"  {k:28} {ours[k]:14.8g} {base[k]:14.8g} {diff:10.3g} {band[k]:10.3g}")
        if diff > band[k]:
            outside[k] = (ours[k], base[k], band[k])
    assert not outside, f"figures outside the noise band (quantd, recomputed, band): {outside}"


def test_the_outputs_ship_input_scales_only_for_modules_the_runtimes_run_w4a4(results):
    """`full` quantizes the attention projections the runtimes run as NVFP4 W4A4 (wq_a with wkv,
    wq_b, wo_b) and the shared experts, not the grouped wo_a; `experts` only the routed experts."""
    full = {m.split(".", 2)[2] for m in results("full", "unweighted")["modules"]}
    experts = {m.split(".", 2)[2] for m in results("experts", "unweighted")["modules"]}
    attention = {"attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_b"}
    shared = {"ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3"}
    assert full - experts == attention | shared, sorted(full - experts)
    assert all(m.startswith("ffn.experts.") for m in experts), sorted(experts)
