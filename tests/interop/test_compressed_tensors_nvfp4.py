"""quantd's NVFP4 output against compressed-tensors' NVFP4 code (the library vLLM's
`compressed-tensors` format and llm-compressor use), on CPU.

Reference nvfp4_modelopt.md §5.2 says the two schemes are the same mathematics with these
differences, and this file checks that they are exactly those:

  1. the global scale is inverted: weight_global_scale = 2688 / amax (quantd/ModelOpt store
     weight_scale_2 = amax / 2688);
  2. float32 operation order: block scale gs * (amax_b / 6) instead of amax_b / (6 * s2), and
     value x / (S / gs) instead of x / (S * s2);
  3. no 2^-9 floor on block scales: a scale that rounds to E4M3 zero is replaced by 0.125;
  4. an all-zero block gets 0.125 (quantd and ModelOpt: 1.0);
  5. when 2688 / amax overflows float32 (an all-zero tensor, or amax < 2688 / FLT_MAX, about
     7.9e-36) the global scale is replaced by 1.0, and every block scale follows from that.

Both libraries are first reproduced bit for bit from those formulas in plain torch float32 (so
the list is complete), then every byte where quantd and compressed-tensors differ is attributed
to exactly one item of the list.

compressed-tensors is driven through its own functions: `generate_gparam`, `calculate_qparams`
(with the NVFP4 scheme's arguments) and `NVFP4PackedCompressor.compress`. Min/max are passed in
float32; llm-compressor's observers pass the weight's own dtype, which for BF16 weights makes
`generate_gparam` compute 2688 / amax in BF16 — an extra rounding of llm-compressor, not of
compressed-tensors, and not exercised here.
"""

from types import SimpleNamespace

import pytest
import torch

from interop_helpers import NVFP4_GROUPS, f32_bits, nvfp4_cases, unpack_codes

CASES = list(nvfp4_cases())
E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
ZERO_BLOCK_CT = 0x20  # E4M3 0.125, compressed-tensors' replacement for a zero scale
ONE = 0x38            # E4M3 1.0


@pytest.fixture(scope="module")
def ct():
    import compressed_tensors
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    assert compressed_tensors.__version__.startswith("0.20"), compressed_tensors.__version__
    return SimpleNamespace(compressor=NVFP4PackedCompressor, gparam=generate_gparam,
                           qparams=calculate_qparams, unpack=unpack_fp4_from_uint8,
                           scheme=QuantizationScheme(targets=["Linear"], **NVFP4))


def ct_nvfp4(ct, w, amax=None):
    """(weight_packed, weight_scale bytes, weight_global_scale) from compressed-tensors."""
    wf = w.float()
    rows, cols = wf.shape
    if amax is None:
        lo, hi = wf.min(), wf.max()
    else:  # a fused group: the largest member amax (llm-compressor takes the min global scale)
        lo, hi = -amax, amax
    gs = ct.gparam(lo.reshape(1), hi.reshape(1))
    blocks = wf.view(rows, cols // 16, 16)
    scale, _ = ct.qparams(blocks.amin(-1), blocks.amax(-1), ct.scheme.weights, global_scale=gs)
    out = ct.compressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, ct.scheme)
    assert out["weight_scale"].dtype == torch.float8_e4m3fn
    return out["weight_packed"], out["weight_scale"].view(torch.uint8), out["weight_global_scale"]


def e2m1_codes(q):
    """E2M1 codes as both libraries round (sign taken before rounding, ties to even)."""
    mag = q.abs()
    order = torch.searchsorted(E2M1_BOUNDS, mag).to(torch.uint8)
    order += ((mag == 0.75) | (mag == 1.75) | (mag == 3.5)).to(torch.uint8)
    return ((q < 0).to(torch.uint8) << 3) | order


def e4m3(x):
    return x.to(torch.float8_e4m3fn)


def emulate(w, amax):
    """Both schemes from the formulas, in float32. Returns a namespace of per-block and
    per-element tensors."""
    x = w.float()
    rows, cols = x.shape
    a = x.view(rows, cols // 16, 16).abs().amax(-1)
    six = torch.tensor(6.0)
    amax = torch.tensor(amax, dtype=torch.float32)
    # quantd / ModelOpt (formats.h; reference §1.2-§1.5).
    s2 = amax / 2688 if amax > 0 else torch.tensor(1.0) / 2688
    s_mo = a / (six * s2)
    s_mo_raw = s_mo.clone()
    s_mo[s_mo == 0] = 1.0
    scale_mo = e4m3(s_mo.clamp(2.0**-9, 448.0))
    q_mo = x.view(rows, cols // 16, 16) / (scale_mo.float() * s2).unsqueeze(-1)
    # compressed-tensors (reference §5.2).
    gs_raw = 2688 / amax.clamp_min(torch.finfo(torch.float32).tiny)
    gs = torch.nan_to_num(gs_raw, posinf=1.0)
    s_ct = gs * (a / six)
    scale_ct = e4m3(s_ct.clamp(-448.0, 448.0)).float()
    scale_ct = e4m3(torch.where(scale_ct == 0, 0.125, scale_ct))
    q_ct = x.view(rows, cols // 16, 16) / (scale_ct.float() / gs).unsqueeze(-1)
    return SimpleNamespace(
        a=a, s2=s2, gs=gs, gs_fallback=bool(torch.isinf(gs_raw)), s_mo=s_mo_raw, s_ct=s_ct,
        scale_mo=scale_mo.view(torch.uint8), scale_ct=scale_ct.view(torch.uint8),
        q_mo=q_mo.view(rows, cols), q_ct=q_ct.view(rows, cols),
        codes_mo=e2m1_codes(q_mo.view(rows, cols)), codes_ct=e2m1_codes(q_ct.view(rows, cols)))


def case_amax(name, nvfp4_inputs):
    cases, group_cases = nvfp4_inputs
    if name in cases:
        return float(cases[name].float().abs().max()), cases[name]
    group = next(g for g in NVFP4_GROUPS if name in g)
    return float(max(group_cases[n].float().abs().max() for n in group)), group_cases[name]


ALL = CASES + [n for g in NVFP4_GROUPS for n in g]


@pytest.fixture(scope="module")
def compared(ct, nvfp4_inputs, quantd_nvfp4):
    """name -> (emulation, compressed-tensors output, quantd output at the first SIMD level)."""
    ours = next(iter(quantd_nvfp4.values()))
    result = {}
    for name in ALL:
        amax, w = case_amax(name, nvfp4_inputs)
        grouped = name not in nvfp4_inputs[0]
        packed, scale, gs = ct_nvfp4(ct, w, torch.tensor(amax) if grouped else None)
        result[name] = (emulate(w, amax), SimpleNamespace(packed=packed, scale=scale, gs=gs),
                        SimpleNamespace(packed=ours[f"{name}.weight"],
                                        scale=ours[f"{name}.weight_scale"].view(torch.uint8),
                                        s2=ours[f"{name}.weight_scale_2"]))
    return result


@pytest.mark.parametrize("name", ALL)
def test_formulas_reproduce_both_libraries(name, compared):
    em, theirs, ours = compared[name]
    # compressed-tensors, bit for bit.
    assert f32_bits(theirs.gs) == f32_bits(em.gs.reshape(1)), name
    assert torch.equal(theirs.scale, em.scale_ct), name
    assert torch.equal(unpack_codes(theirs.packed), em.codes_ct), name
    # quantd, bit for bit (independently of the ModelOpt package).
    assert f32_bits(ours.s2) == f32_bits(em.s2), name
    assert torch.equal(ours.scale, em.scale_mo), name
    assert torch.equal(unpack_codes(ours.packed), em.codes_mo), name


def classify(em, theirs, ours):
    """Counts of the differences between quantd and compressed-tensors, by cause; asserts that
    every differing scale byte and code has one of the causes of reference §5.2."""
    # A zero block scale: the block is all zero, or amax_b / (6 * s2) underflows float32 (a block
    # of subnormals far below the tensor amax); compressed-tensors' gs * (amax_b / 6) is then 0 too.
    zero = em.s_mo == 0
    floor = (em.s_mo < 2.0**-9) & ~zero
    differ = ours.scale != theirs.scale
    counts = {"blocks": em.a.numel(), "zero_blocks": int((em.a == 0).sum()),
              "zero_scale_blocks": int(zero.sum())}
    if em.gs_fallback and em.a.max() > 0:
        # 5. compressed-tensors quantizes with global scale 1.0: its block scales gs * amax_b / 6
        #    underflow E4M3 and become 0.125, nothing is comparable block by block.
        assert bool((theirs.scale == ZERO_BLOCK_CT).all())
        counts["fallback_blocks"] = int(differ.sum())
        return counts
    # 4. zero scales: 1.0 against 0.125.
    assert bool((em.s_ct[zero] == 0).all())
    assert bool((ours.scale[zero] == ONE).all()) and bool((theirs.scale[zero] == ZERO_BLOCK_CT).all())
    # 3. below the floor: quantd clamps to 2^-9 (0x01); compressed-tensors keeps the rounded
    #    scale, which is 0x01 again unless it rounds to 0 (scale <= 2^-10) and becomes 0.125.
    assert bool((ours.scale[floor] == 0x01).all())
    underflow = floor & (e4m3(em.s_ct).float() == 0)
    assert bool((theirs.scale[underflow] == ZERO_BLOCK_CT).all())
    assert bool((theirs.scale[floor & ~underflow] == 0x01).all())
    counts["floor_blocks"] = int(floor.sum())
    counts["floor_blocks_0.125"] = int(underflow.sum())
    # 2. operation order: every other differing scale comes from a block whose unrounded
    #    scales differ (by an ulp or two) and lands one E4M3 step away.
    order = differ & ~zero & ~floor
    assert bool((em.s_ct[order] != em.s_mo[order]).all())
    step = (ours.scale[order].int() - theirs.scale[order].int()).abs()
    assert bool((step == 1).all()), step
    counts["order_blocks"] = int(order.sum())
    # Codes: in blocks with equal scale bytes, a code differs only where the two quotients differ.
    same = (~differ).repeat_interleave(16, dim=1)
    codes_ours, codes_ct = unpack_codes(ours.packed), unpack_codes(theirs.packed)
    code_diff = (codes_ours != codes_ct) & same
    # ... and an E2M1 rounding threshold lies between them (inclusive: ties round to even).
    lo = torch.minimum(em.q_mo[code_diff].abs(), em.q_ct[code_diff].abs())
    hi = torch.maximum(em.q_mo[code_diff].abs(), em.q_ct[code_diff].abs())
    straddle = ((lo.unsqueeze(-1) <= E2M1_BOUNDS) & (E2M1_BOUNDS <= hi.unsqueeze(-1))).any(-1)
    assert bool((em.q_mo[code_diff] != em.q_ct[code_diff]).all())
    assert bool(straddle.all())
    counts["order_codes"] = int(code_diff.sum())
    counts["codes_in_equal_blocks"] = int(same.sum())
    return counts


@pytest.mark.parametrize("name", ALL)
def test_differences_are_exactly_those_of_the_reference(name, compared):
    em, theirs, ours = compared[name]
    counts = classify(em, theirs, ours)
    # 1 and 5: the global scale.
    if not em.gs_fallback:
        # 2688/amax against 1/(amax/2688): equal or one float32 ulp apart.
        inverse = (torch.tensor(1.0) / ours.s2).reshape(1)
        assert int((f32_bits(theirs.gs) - f32_bits(inverse)).abs()) <= 1, name
    else:
        assert theirs.gs.item() == 1.0
    # Operation order is a rare effect: at most 1% of blocks and of codes. (Codes are not as rare
    # as one-ulp events suggest: BF16 weights and E4M3 scales have few significant bits, so
    # x * 2688 / (S * amax) often equals a threshold exactly, and then the two roundings of the
    # quotient decide the side.)
    if "fallback_blocks" in counts:
        return
    assert counts["order_blocks"] <= max(1, counts["blocks"] // 100), counts
    assert counts["order_codes"] <= max(2, counts["codes_in_equal_blocks"] // 100), counts


def test_differences_where_expected(compared):
    """The adversarial tensors produce each kind of difference; random normal weights only the
    rare operation-order kind."""
    counts = {name: classify(*compared[name]) for name in ALL}
    for name, c in counts.items():
        print(name, c)
    assert counts["zero_blocks"]["zero_blocks"] > 0
    assert counts["dynamic_range"]["zero_scale_blocks"] > counts["dynamic_range"]["zero_blocks"]
    assert counts["subnormal"]["fallback_blocks"] == counts["subnormal"]["blocks"]
    assert counts["tiny_near_floor"]["floor_blocks"] >= 10
    assert counts["tiny_near_floor"]["floor_blocks_0.125"] >= 5
    assert counts["dynamic_range"]["floor_blocks_0.125"] > 0
    assert counts["normal"]["zero_blocks"] == counts["normal"]["floor_blocks"] == 0
    # Exact thresholds and FP8 ties are computed exactly by both orders (powers of two).
    assert counts["thresholds"]["order_blocks"] == counts["thresholds"]["order_codes"] == 0


@pytest.mark.parametrize("name", ALL)
def test_compressed_tensors_decompresses_our_output(name, ct, compared, quantd_nvfp4):
    """quantd's NVFP4, converted to compressed-tensors' layout as its own ModelOpt converter does
    (weight_global_scale = 1 / weight_scale_2, same bytes otherwise), decompresses to our dequant
    within one BF16 ulp (compressed-tensors decompresses to BF16 and divides by the global scale
    where we multiply by weight_scale_2)."""
    em, _, ours = compared[name]
    dequant = next(iter(quantd_nvfp4.values()))[f"{name}.dequant"]
    inverse = (torch.tensor(1.0) / ours.s2).reshape(1)
    if torch.isinf(inverse):
        # weight_scale_2 below 2^-128 (amax below ~7.9e-36) has no finite inverse: such a tensor
        # cannot be expressed in compressed-tensors' format at all (nor quantized by it, see 5.).
        assert em.gs_fallback and name == "subnormal", name
        return
    rows, half = ours.packed.shape
    state = {"weight_packed": ours.packed, "weight_scale": ours.scale.view(torch.float8_e4m3fn),
             "weight_global_scale": inverse}
    weight = ct.compressor.decompress(state, ct.scheme)["weight"]
    assert weight.shape == (rows, 2 * half) and weight.dtype == torch.bfloat16
    ours_bf16 = dequant.bfloat16()
    ulps = (weight.view(torch.int16).int() - ours_bf16.view(torch.int16).int()).abs()
    same_value = weight.float() == ours_bf16.float()  # +0.0 and -0.0
    assert bool(((ulps <= 1) | same_value).all()), name
