"""`quantd run`'s output on the tiny DeepSeek-V4 fixture, read by the peer libraries (issue 3
item 6):

  1. the `safetensors` library loads every tensor of the `experts` and `full` outputs (W4A4 and
     W4A16, ModelOpt format) with the dtypes and shapes vLLM expects, and the tensors left in
     their source format are the source's bytes;
  2. decoding our NVFP4 with torch, against the source decoded with torch to BF16 (as the
     pipeline decodes it before quantizing), gives the error the verify stage stored in the state
     database; lossless-cast experts decode to the source values exactly outside the
     requantized blocks;
  3. compressed-tensors, loading our compressed-tensors output the way transformers does
     (QuantizationConfig from config.json, apply_quantization_config, compress_model for the
     parameter layout, decompress_model), gives the values of our ModelOpt output of the same
     job, rounded to BF16, up to the rounding difference derived at the test;
  4. the BF16 copy (materialize_bf16) equals torch's own float8 / MXFP4 decoding rounded to
     BF16, bit for bit.
"""

import json
import re
import sqlite3
from types import SimpleNamespace

import pytest
import torch

from interop_helpers import (
    E2M1_VALUES,
    check_written_by_quantd,
    checkpoint_tensors,
    f32_bits,
    read_raw,
    shards,
    tensor_bytes,
    unpack_codes,
)
from test_torch_decode import expected_decodes

RUN_FLAGS = ["--device", "cpu", "--workers", "2", "--threads", "1"]

# The jobs, each run once. A "-ct" job is its ModelOpt twin with export_format
# compressed-tensors; "experts-w4a4" also writes the BF16 copy.
JOBS = {
    "experts-w4a4": {"recipe": "experts", "weight_format": "nvfp4"},
    "experts-w4a16": {"recipe": "experts", "weight_format": "w4a16_nvfp4"},
    "experts-w4a4-requantize": {"recipe": "experts", "weight_format": "nvfp4",
                                "expert_cast": "requantize"},
    "full-w4a4": {"recipe": "full", "weight_format": "nvfp4"},
    "full-w4a16": {"recipe": "full", "weight_format": "w4a16_nvfp4"},
    "experts-w4a4-ct": {"recipe": "experts", "weight_format": "nvfp4",
                        "export_format": "compressed-tensors"},
    "full-w4a4-ct": {"recipe": "full", "weight_format": "nvfp4",
                     "export_format": "compressed-tensors"},
    "full-w4a16-ct": {"recipe": "full", "weight_format": "w4a16_nvfp4",
                      "export_format": "compressed-tensors"},
}
BF16_JOB = "experts-w4a4"
CT_TWIN = {job: job[: -len("-ct")] for job in JOBS if job.endswith("-ct")}
MODELOPT = [job for job in JOBS if job not in CT_TWIN]
LOSSLESS = [job for job in MODELOPT if JOBS[job].get("expert_cast") != "requantize"]

# The V4 recipes of DESIGN.md as regexes over module names: `experts` = routed experts of the
# main layers; `full` adds the attention projections the runtimes run as W4A4 (not the grouped
# wo_a, nor the compressor / indexer ones) and the shared experts.
RECIPES = {
    "experts": r"layers\.\d+\.ffn\.experts\.\d+\.w[123]",
    "full": r"layers\.\d+\.(attn\.(wq_a|wkv|wq_b|wo_b)|ffn\.shared_experts\.w[123]"
            r"|ffn\.experts\.\d+\.w[123])",
}
# Linears that readers run as one GEMM, so they share weight_scale_2 and input_scale.
FUSED = [("w1", "w3"), ("wq_a", "wkv")]
ROUTED = re.compile(r"(.+)\.experts\.\d+\.(w[123])")


# ---- helpers -----------------------------------------------------------------------------------

def quantized_modules(tensors):
    return {n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")}


def recipe_modules(source, recipe):
    return {n[: -len(".weight")] for n, t in source.items()
            if n.endswith(".weight") and t.dim() == 2
            and re.fullmatch(RECIPES[recipe], n[: -len(".weight")])}


def block_quantized_left(source, modules):
    """The FP8-block and MXFP4 linears of the source (those with a `.scale`) outside `modules`."""
    return {n[: -len(".scale")] for n in source if n.endswith(".scale")} - modules


def keeps_source_format(job):
    """Only NVIDIA's MIXED_PRECISION layout (V4 experts recipe, ModelOpt) describes modules left
    in FP8 / MXFP4; every other layout gets them as BF16."""
    return JOBS[job]["recipe"] == "experts" and JOBS[job].get("export_format") != \
        "compressed-tensors"


def assert_bf16_modules(tensors, left, source_values, job):
    """Each module in `left` is its source weight decoded by torch, rounded to BF16, bit for bit,
    and its scale is gone."""
    for m in sorted(left):
        t = tensors[f"{m}.weight"]
        want = source_values[f"{m}.weight"].bfloat16()
        assert t.dtype == torch.bfloat16 and t.shape == want.shape, (job, m, t.dtype, t.shape)
        assert torch.equal(t.view(torch.int16), want.view(torch.int16)), (job, m)
        assert f"{m}.scale" not in tensors, (job, m)


def logical_shape(source, module):
    """(out, in) of a source linear: FP8 [o, i], MXFP4 int8 [o, i/2]."""
    w = source[f"{module}.weight"]
    return w.shape[0], w.shape[1] * (2 if w.dtype == torch.int8 else 1)


def fused_group(module, modules):
    """The members of `module`'s fusion group among `modules` (itself when it has none)."""
    parent, leaf = module.rsplit(".", 1)
    for group in FUSED:
        if leaf in group:
            return [f"{parent}.{m}" for m in group if f"{parent}.{m}" in modules]
    return [module]


def nvfp4_values(packed, block_scale, scale_2):
    """Our torch decode: e2m1[nibble] * float(block scale) * weight_scale_2 in float32, the even
    element in the low nibble (the order of the products as formats.h Nvfp4Decode)."""
    scales = block_scale.float().repeat_interleave(16, dim=1)
    return E2M1_VALUES[unpack_codes(packed).long()] * scales * scale_2


def output_values(tensors, module):
    """A module of our output decoded as readers do: ModelOpt weight_scale_2, or
    compressed-tensors 1 / weight_global_scale (float32 division)."""
    if f"{module}.weight_packed" in tensors:
        scale_2 = torch.tensor(1.0) / tensors[f"{module}.weight_global_scale"]
        packed = tensors[f"{module}.weight_packed"]
    else:
        scale_2 = tensors[f"{module}.weight_scale_2"]
        packed = tensors[f"{module}.weight"]
    return nvfp4_values(packed, tensors[f"{module}.weight_scale"], scale_2)


def error_stats(ref, got):
    """(rel_rmse, sqnr_db, max_abs_err, element count) with the per-element operations of
    verify_rules.h ErrorStats: both float32, differences and squares in double."""
    r = ref.double()
    e = got.double() - r
    ref_sq, err_sq = float((r * r).sum()), float((e * e).sum())
    if err_sq == 0:
        return 0.0, float("inf"), float(e.abs().max()), r.numel()
    return ((err_sq / ref_sq) ** 0.5, 10 * torch.log10(torch.tensor(ref_sq / err_sq,
                                                                     dtype=torch.float64)).item(),
            float(e.abs().max()), r.numel())


def shard_map(checkpoint_dir):
    """{tensor: shard file name} from the shards' headers."""
    out = {}
    for shard in shards(checkpoint_dir):
        for name in read_raw(shard)[2]:
            out[name] = shard.name
    return out


def check_files(out_dir, source_dir):
    """Index and config: the index maps each tensor to its shard, config.json equals the source's
    apart from quantization_config, generation_config.json is copied. Returns config.json."""
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == shard_map(out_dir), out_dir
    config = json.loads((out_dir / "config.json").read_text())
    source_config = json.loads((source_dir / "config.json").read_text())
    assert ({k: v for k, v in config.items() if k != "quantization_config"}
            == {k: v for k, v in source_config.items() if k != "quantization_config"}), out_dir
    name = "generation_config.json"
    assert (out_dir / name).read_bytes() == (source_dir / name).read_bytes(), out_dir
    return config


def assert_copied(out, source, names, what):
    for name in names:
        assert out[name].dtype == source[name].dtype, (what, name)
        assert out[name].shape == source[name].shape, (what, name)
        assert tensor_bytes(out[name]) == tensor_bytes(source[name]), (what, name)


def read_state(state):
    """{tensor: (rel_rmse, sqnr_db, max_abs_err)} of the state database's one job, which
    succeeded."""
    con = sqlite3.connect(str(state))
    try:
        jobs = con.execute("SELECT id, state FROM jobs").fetchall()
        rows = con.execute("SELECT job_id, tensor, rel_rmse, sqnr_db, max_abs_err "
                           "FROM tensor_stats").fetchall()
    finally:
        con.close()
    assert len(jobs) == 1 and jobs[0][1] == "SUCCEEDED", jobs
    assert all(r[0] == jobs[0][0] for r in rows)
    return {r[1]: r[2:] for r in rows}


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source(v4_fixture):
    return checkpoint_tensors(v4_fixture)


@pytest.fixture(scope="module")
def source_values(source):
    """Weight name -> torch's float32 decode of every FP8-block and MXFP4 weight."""
    return expected_decodes(source)


@pytest.fixture(scope="module")
def amax(source, tmp_path_factory):
    """An amax file for every FP8 / MXFP4 linear (exact binary fractions, distinct per module)
    but the last routed expert of the last layer, which gets the fill rule."""
    modules = sorted(n[: -len(".weight")] for n in source
                     if n.endswith(".weight") and n[: -len(".weight")] + ".scale" in source)
    experts = [m for m in modules if re.fullmatch(RECIPES["experts"], m)]
    key = lambda m: tuple(int(x) for x in re.findall(r"\d+", m))
    last = max(experts, key=key).rsplit(".", 1)[0]
    filled = [m for m in experts if m.rsplit(".", 1)[0] == last]
    assert len(filled) == 3, filled
    table = {m: 0.5 + i / 64 for i, m in enumerate(modules) if m not in filled}
    path = tmp_path_factory.mktemp("amax") / "amax.json"
    path.write_text(json.dumps(table))
    return SimpleNamespace(path=path, table=table, filled=filled)


@pytest.fixture(scope="module")
def runs(qd, v4_fixture, amax, tmp_path_factory):
    """Job name -> its output directory, tensors and stored error stats; "bf16" -> the copy."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for job, fields in JOBS.items():
        spec = {"source": str(v4_fixture), "output": str(root / job), **fields}
        if fields["weight_format"] == "nvfp4":
            spec["calibration"] = {"amax_file": str(amax.path)}
        if job == BF16_JOB:
            spec["materialize_bf16"] = str(root / "bf16")
        (root / f"{job}.json").write_text(json.dumps(spec))
        qd._run_ok([qd.quantd, "run", "--state", root / f"{job}.db", *RUN_FLAGS,
                    root / f"{job}.json"])
        out[job] = SimpleNamespace(dir=root / job, tensors=checkpoint_tensors(root / job),
                                   stats=read_state(root / f"{job}.db"))
    out["bf16"] = root / "bf16"
    return out


# ---- 1. the safetensors library reads the output ----------------------------------------------

@pytest.mark.parametrize("job", MODELOPT)
def test_safetensors_reads_modelopt_output(job, runs, source, source_values, v4_fixture):
    run, fields = runs[job], JOBS[job]
    w4a4 = fields["weight_format"] == "nvfp4"
    for shard in shards(run.dir):
        check_written_by_quantd(shard)
    config = check_files(run.dir, v4_fixture)
    assert "quantization_config" in config
    assert (run.dir / "hf_quant_config.json").is_file()

    modules = quantized_modules(run.tensors)
    assert modules == recipe_modules(source, fields["recipe"])
    left = set() if keeps_source_format(job) else block_quantized_left(source, modules)
    assert keeps_source_format(job) or left, job  # `full` leaves mtp.* and the indexer's wq_b
    replaced = {f"{m}.{s}" for m in modules | left for s in ("weight", "scale")}
    suffixes = ("weight", "weight_scale", "weight_scale_2") + (("input_scale",) if w4a4 else ())
    assert set(run.tensors) == (set(source) - replaced) | {f"{m}.{s}" for m in modules
                                                           for s in suffixes} | {
        f"{m}.weight" for m in left}
    assert_bf16_modules(run.tensors, left, source_values, job)
    for m in modules:
        o, i = logical_shape(source, m)
        layout = {"weight": (torch.uint8, (o, i // 2)),
                  "weight_scale": (torch.float8_e4m3fn, (o, i // 16)),
                  "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ())}
        for s in suffixes:
            t = run.tensors[f"{m}.{s}"]
            assert (t.dtype, tuple(t.shape)) == layout[s], (job, m, s, t.dtype, t.shape)
        # No zero or NaN block scale byte (E4M3 0x00 / 0x80, 0x7F / 0xFF).
        magnitude = run.tensors[f"{m}.weight_scale"].view(torch.uint8) & 0x7F
        assert not bool(((magnitude == 0) | (magnitude == 0x7F)).any()), (job, m)
    assert_copied(run.tensors, source, set(source) - replaced, job)


@pytest.mark.parametrize("job", MODELOPT)
def test_global_and_input_scales(job, runs, source, source_values, amax):
    """weight_scale_2: 2^(kmax-8) for lossless-cast experts (kmax over w1/w3), else
    float32(group weight amax) / 2688; input_scale = float32(group input amax) / 2688, a routed
    expert without an amax row taking the max over its layer's experts of the same projection.
    Fusion partners share both."""
    run = runs[job]
    w4a4 = JOBS[job]["weight_format"] == "nvfp4"
    lossless = JOBS[job].get("expert_cast") != "requantize"
    modules = quantized_modules(run.tensors)

    def input_amax(m):
        if m in amax.table:
            return amax.table[m]
        layer, proj = ROUTED.fullmatch(m).groups()
        same = {"w1": "w13", "w3": "w13", "w2": "w2"}
        return max(v for n, v in amax.table.items() if (x := ROUTED.fullmatch(n))
                   and x[1] == layer and same[x[2]] == same[proj])

    checked_fill = 0
    for m in modules:
        group = fused_group(m, modules)
        s2 = run.tensors[f"{m}.weight_scale_2"]
        if lossless and ROUTED.fullmatch(m):
            kmax = max(int(source[f"{g}.scale"].view(torch.uint8).max()) - 127 for g in group)
            assert s2.item() == 2.0 ** (kmax - 8), (job, m)
        else:
            weight_amax = max(source_values[f"{g}.weight"].bfloat16().float().abs().max()
                              for g in group)
            assert f32_bits(s2) == f32_bits(weight_amax / 2688), (job, m)
        for g in group:
            assert f32_bits(run.tensors[f"{g}.weight_scale_2"]) == f32_bits(s2), (job, m, g)
        if not w4a4:
            continue
        want = torch.tensor(max(input_amax(g) for g in group), dtype=torch.float32) / 2688
        assert f32_bits(run.tensors[f"{m}.input_scale"]) == f32_bits(want), (job, m)
        checked_fill += m in amax.filled
    assert checked_fill == (3 if w4a4 else 0), job


@pytest.mark.parametrize("recipe", ["experts", "full"])
def test_w4a16_is_w4a4_without_input_scales(recipe, runs):
    w4a4, w4a16 = runs[f"{recipe}-w4a4"].tensors, runs[f"{recipe}-w4a16"].tensors
    assert set(w4a16) == {n for n in w4a4 if not n.endswith(".input_scale")}
    assert_copied(w4a16, w4a4, set(w4a16), recipe)


# ---- 2. torch's decode gives the stored error -------------------------------------------------

@pytest.mark.parametrize("job", list(JOBS))
def test_stored_error_matches_torch_decode(job, runs, source_values):
    """Both sides decode to the same float32 values and do the same double operations per element,
    so max_abs_err is equal exactly; the sums differ only in order. A sum of n non-negative
    doubles is within (n-1) 2^-53 relative of exact in any order, so the ratio err_sq / ref_sq
    agrees to 4n 2^-53, rel_rmse (its square root) to 2n 2^-53 and sqnr_db to
    10 / ln 10 * 4n 2^-53, each plus a few ulps for sqrt / log10."""
    run = runs[job]
    modules = quantized_modules(run.tensors)
    assert set(run.stats) == {f"{m}.weight" for m in modules}, job
    finite = 0
    for m in sorted(modules):
        ref = source_values[f"{m}.weight"].bfloat16().float()
        got = output_values(run.tensors, m)
        rel, sqnr, max_abs, n = error_stats(ref, got)
        stored_rel, stored_sqnr, stored_max = run.stats[f"{m}.weight"]
        assert stored_max == max_abs, (job, m, stored_max, max_abs)
        if sqnr == float("inf"):
            assert (stored_rel, stored_sqnr) == (0.0, float("inf")), (job, m)
            continue
        finite += 1
        u = 2.0**-53
        assert abs(stored_rel - rel) <= (2 * n * u + 4 * u) * rel, (job, m, stored_rel, rel)
        assert abs(stored_sqnr - sqnr) <= 4.35 * 4 * n * u + 8 * u * abs(sqnr), (
            job, m, stored_sqnr, sqnr)
    # Lossless-cast experts quantize exactly; FP8 sources and requantized experts do not.
    if JOBS[job]["recipe"] == "full" or JOBS[job].get("expert_cast") == "requantize":
        assert finite > 0, job
    else:
        assert finite == 0, job


@pytest.mark.parametrize("job", LOSSLESS)
def test_lossless_experts_decode_to_source_values(job, runs, source, source_values):
    """Outside the requantized 16-blocks (exponent k with k - kmax + 8 < -9, below E4M3's
    smallest scale 2^-9) the NVFP4 values are the MXFP4 values, bit for bit in float32."""
    run = runs[job]
    modules = quantized_modules(run.tensors)
    experts = [m for m in modules if ROUTED.fullmatch(m)]
    assert experts
    requantized = 0
    for m in experts:
        kmax = max(int(source[f"{g}.scale"].view(torch.uint8).max()) - 127
                   for g in fused_group(m, modules))
        k = source[f"{m}.scale"].view(torch.uint8).int() - 127
        window = (k - kmax + 8 >= -9).repeat_interleave(32, dim=1)
        got, want = output_values(run.tensors, m), source_values[f"{m}.weight"]
        assert torch.equal(f32_bits(got[window]), f32_bits(want[window])), (job, m)
        requantized += int((~window).sum()) // 16
    # The fixture holds out-of-window blocks, so the other branch is exercised too.
    assert requantized > 0, job


# ---- 3. compressed-tensors decompresses our output to our ModelOpt values ----------------------

@pytest.fixture(scope="module")
def ct_lib():
    import compressed_tensors
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    assert compressed_tensors.__version__.startswith("0.20"), compressed_tensors.__version__
    return SimpleNamespace(compressor=ModelCompressor, config=QuantizationConfig,
                           apply=apply_quantization_config)


def ct_load(ct_lib, run):
    """compressed-tensors' load path on a module tree with a Linear per linear of `run`:
    returns ({quantized module: decompressed BF16 weight}, quantization config)."""
    qc = ct_lib.config.model_validate(
        json.loads((run.dir / "config.json").read_text())["quantization_config"])
    model = torch.nn.Module()
    for name, t in run.tensors.items():
        if name.endswith(".weight_packed"):
            module, (o, i) = name[: -len(".weight_packed")], (t.shape[0], 2 * t.shape[1])
        elif name.endswith(".weight") and t.dim() == 2:
            module, (o, i) = name[: -len(".weight")], t.shape
        else:
            continue
        parent = model
        for part in module.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(module.rsplit(".", 1)[-1],
                          torch.nn.Linear(i, o, bias=False, dtype=torch.bfloat16, device="meta"))
    ct_lib.apply(model, qc, show_progress=False)
    quantized = {n for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    assert quantized == quantized_modules(run.tensors), quantized ^ quantized_modules(run.tensors)
    compressor = ct_lib.compressor(quantization_config=qc)
    # As transformers loads a compressed checkpoint: the model on the meta device, compressed to
    # get the parameters the checkpoint fills, then the checkpoint's tensors put in their place.
    compressor.compress_model(model)
    for n in quantized:
        params = dict(model.get_submodule(n).named_parameters(recurse=False))
        ours = {k[len(n) + 1 :]: t for k, t in run.tensors.items() if k.startswith(n + ".")}
        assert ({k: (p.dtype, tuple(p.shape)) for k, p in params.items()}
                == {k: (t.dtype, tuple(t.shape)) for k, t in ours.items()}), n
        for k in params:
            setattr(model.get_submodule(n), k, torch.nn.Parameter(ours[k].clone(),
                                                                  requires_grad=False))
    # The linears left unquantized get zero weights (their values are not under test here).
    for name, p in list(model.named_parameters()):
        if p.is_meta:
            owner, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(owner), attr,
                    torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=False))
    compressor.decompress_model(model)
    return {n: model.get_submodule(n).weight.data for n in quantized}, qc


@pytest.mark.parametrize("job", list(CT_TWIN))
def test_compressed_tensors_decompresses_to_modelopt_values(job, runs, ct_lib, source,
                                                            source_values, v4_fixture):
    """The CT output is the ModelOpt twin's bytes with weight_global_scale = 1 / weight_scale_2
    and input_global_scale = 1 / input_scale (float32 divisions). compressed-tensors decodes
    u = e2m1 * float32(bf16(S) / g) in float32 and rounds to BF16; we decode
    v = e2m1 * S * s2. With s2 a power of two (lossless experts) u = v; otherwise u and v are
    within a few float32 ulps, far below a BF16 ulp, so their BF16 roundings are equal except
    where a BF16 rounding midpoint lies between u and v, and there they are adjacent BF16 values.
    The test asserts exactly that and counts such elements: they are rare (about 4 per million
    random (value, scale, s2) triples) and the fixture has none."""
    run, twin = runs[job], runs[CT_TWIN[job]]
    w4a4 = JOBS[job]["weight_format"] == "nvfp4"
    check_files(run.dir, v4_fixture)
    assert not (run.dir / "hf_quant_config.json").exists()
    decompressed, qc = ct_load(ct_lib, run)
    assert qc.format == "nvfp4-pack-quantized" and qc.quant_method == "compressed-tensors"

    modules = quantized_modules(run.tensors)
    assert modules == quantized_modules(twin.tensors)
    suffixes = ("weight_packed", "weight_scale", "weight_global_scale") + (
        ("input_global_scale",) if w4a4 else ())
    renamed = {f"{m}.{s}" for m in modules for s in suffixes}
    # compressed-tensors describes only the NVFP4 modules: the FP8 / MXFP4 rest is BF16.
    left = block_quantized_left(source, modules)
    bf16 = {f"{m}.weight" for m in left}
    assert set(run.tensors) - renamed == (set(source) - {
        f"{m}.{s}" for m in modules | left for s in ("weight", "scale")}) | bf16
    assert_copied(run.tensors, twin.tensors, set(run.tensors) - renamed - bf16, job)
    assert_bf16_modules(run.tensors, left, source_values, job)

    straddles = 0
    for m in sorted(modules):
        t, tw = {s: run.tensors[f"{m}.{s}"] for s in suffixes}, twin.tensors
        assert torch.equal(t["weight_packed"], tw[f"{m}.weight"]), m
        assert tensor_bytes(t["weight_scale"]) == tensor_bytes(tw[f"{m}.weight_scale"]), m
        s2 = tw[f"{m}.weight_scale_2"]
        g = t["weight_global_scale"]
        assert f32_bits(g) == f32_bits((torch.tensor(1.0) / s2).reshape(1)), m
        if w4a4:
            want = (torch.tensor(1.0) / tw[f"{m}.input_scale"]).reshape(1)
            assert f32_bits(t["input_global_scale"]) == f32_bits(want), m

        theirs = decompressed[m]
        v = nvfp4_values(tw[f"{m}.weight"], tw[f"{m}.weight_scale"], s2)
        assert theirs.dtype == torch.bfloat16 and theirs.shape == v.shape, m
        codes = E2M1_VALUES[unpack_codes(t["weight_packed"]).long()]
        u = codes * (t["weight_scale"].bfloat16() / g).repeat_interleave(16, dim=1)
        assert u.dtype == torch.float32
        bits = lambda x: x.contiguous().view(torch.int16)
        assert torch.equal(bits(theirs), bits(u.bfloat16())), f"{m}: not the library's formula"
        ours = v.bfloat16()
        differ = bits(theirs) != bits(ours)
        if bool((s2 == 2.0 ** torch.log2(s2).round()).item()):
            assert torch.equal(u, v), m
        if not bool(differ.any()):
            continue
        a, b = theirs[differ].float(), ours[differ].float()
        assert bool((torch.sign(a) == torch.sign(b)).all()), m
        step = (bits(theirs)[differ].int() - bits(ours)[differ].int()).abs()
        assert bool((step == 1).all()), m
        mid = (a.double() + b.double()) / 2
        lo = torch.minimum(u[differ], v[differ]).double()
        hi = torch.maximum(u[differ], v[differ]).double()
        assert bool(((lo <= mid) & (mid <= hi)).all()), m
        straddles += int(differ.sum())
    print(f"{job}: {len(modules)} modules, {straddles} BF16 values differ by a rounding straddle")


# ---- 4. the BF16 copy is torch's decode ---------------------------------------------------------

def test_bf16_copy_is_torch_dequantization(runs, source, source_values, v4_fixture):
    copy_dir = runs["bf16"]
    for shard in shards(copy_dir):
        check_written_by_quantd(shard)
    config = check_files(copy_dir, v4_fixture)
    assert "quantization_config" not in config
    assert not (copy_dir / "hf_quant_config.json").exists()
    copy = checkpoint_tensors(copy_dir)
    scales = {n[: -len(".weight")] + ".scale" for n in source_values}
    assert scales <= set(source)
    assert set(copy) == set(source) - scales
    for name, want in source_values.items():
        got = copy[name]
        assert got.dtype == torch.bfloat16 and got.shape == want.shape, name
        assert torch.equal(got.view(torch.int16), want.bfloat16().view(torch.int16)), name
    assert_copied(copy, source, set(copy) - set(source_values), "bf16")
    dtypes = {source[n].dtype for n in source_values}
    assert dtypes == {torch.float8_e4m3fn, torch.int8}, dtypes
