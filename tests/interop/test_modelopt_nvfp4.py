"""quantd's NVFP4 bytes against NVIDIA ModelOpt's own NVFP4 quantization, on CPU.

The oracle is ModelOpt's real PTQ path, not a re-implementation: every test tensor becomes the
weight of an nn.Linear, `mtq.quantize(..., NVFP4_DEFAULT_CFG)` calibrates it with max
calibration, fused groups go through `preprocess_linear_fusion` (which raises every member's
weight amax to the group max), and `_export_quantized_weight` (what `export_hf_checkpoint` runs
for each linear) produces weight / weight_scale / weight_scale_2. That path calls
`NVFP4QTensor.get_weights_scaling_factor` and `NVFP4QTensor.quantize`, which run on CPU tensors
(only the optional TensorRT-LLM kernel needs a GPU, and the export does not ask for it).
"""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from interop_helpers import E2M1_VALUES, NVFP4_GROUPS, f32_bits, nvfp4_cases, unpack_codes

CASES = list(nvfp4_cases())


@pytest.fixture(scope="module")
def modelopt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "transformers version not tested" and similar
        import modelopt
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export.quant_utils import preprocess_linear_fusion
        from modelopt.torch.export.unified_export_hf import _export_quantized_weight
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    assert modelopt.__version__.startswith("0.47"), modelopt.__version__
    return SimpleNamespace(mtq=mtq, fuse=preprocess_linear_fusion, export=_export_quantized_weight,
                           qtensor=NVFP4QTensor)


def modelopt_export(mo, weights, groups=()):
    """name -> (weight U8, weight_scale as uint8, weight_scale_2 F32) from ModelOpt's PTQ+export."""
    model = torch.nn.ModuleDict()
    for name, w in weights.items():
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
        model[name] = linear

    def forward_loop(m):
        for linear in m.values():
            linear(torch.ones(2, linear.in_features, dtype=linear.weight.dtype))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mo.mtq.quantize(model, mo.mtq.NVFP4_DEFAULT_CFG, forward_loop)
        for group in groups:
            mo.fuse([model[n] for n in group])
        out = {}
        for name, linear in model.items():
            assert linear.weight_quantizer.is_enabled, name
            mo.export(linear, linear.weight.dtype)
            assert linear.weight.dtype == torch.uint8, (name, linear.weight.dtype)
            assert linear.weight_scale.dtype == torch.float8_e4m3fn, name
            assert linear.weight_scale_2.shape == (), name
            out[name] = (linear.weight.detach().clone(),
                         linear.weight_scale.detach().view(torch.uint8).clone(),
                         linear.weight_scale_2.detach().clone())
    return out


@pytest.fixture(scope="module")
def modelopt_nvfp4(modelopt, nvfp4_inputs):
    cases, group_cases = nvfp4_inputs
    return {**modelopt_export(modelopt, cases),
            **modelopt_export(modelopt, group_cases, NVFP4_GROUPS)}


def assert_same_bytes(ours, ref, what):
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    diff = (ours != ref).nonzero()
    assert len(diff) == 0, (
        f"{what}: {len(diff)} of {ref.numel()} bytes differ; first at "
        f"{[tuple(d.tolist()) for d in diff[:5]]}: ours "
        f"{[hex(int(ours[tuple(d)])) for d in diff[:5]]}, ModelOpt "
        f"{[hex(int(ref[tuple(d)])) for d in diff[:5]]}"
    )


def assert_matches_modelopt(name, ours, ref, level):
    weight, scale, scale_2 = ref
    assert ours[f"{name}.weight"].dtype == torch.uint8
    assert ours[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
    assert ours[f"{name}.weight_scale_2"].dtype == torch.float32
    assert ours[f"{name}.weight_scale_2"].shape == ()
    assert f32_bits(ours[f"{name}.weight_scale_2"]) == f32_bits(scale_2), (
        f"{name} [{level}]: weight_scale_2 {ours[f'{name}.weight_scale_2'].item()!r} "
        f"!= ModelOpt {scale_2.item()!r}")
    assert_same_bytes(ours[f"{name}.weight_scale"].view(torch.uint8), scale,
                      f"{name} [{level}] weight_scale")
    assert_same_bytes(ours[f"{name}.weight"], weight, f"{name} [{level}] weight")


@pytest.mark.parametrize("name", [c for c in CASES if c != "all_zero"])
def test_bytes_identical_to_modelopt(name, quantd_nvfp4, modelopt_nvfp4):
    for level, ours in quantd_nvfp4.items():
        assert_matches_modelopt(name, ours, modelopt_nvfp4[name], level)


def test_fused_groups_identical_to_modelopt(quantd_nvfp4, modelopt_nvfp4, nvfp4_inputs):
    _, group_cases = nvfp4_inputs
    for group in NVFP4_GROUPS:
        amax = max(group_cases[n].float().abs().max() for n in group)
        shared = np.float32(amax.item()) / np.float32(2688)
        for name in group:
            # The group shares the largest member's weight_scale_2, which is not every member's own.
            assert modelopt_nvfp4[name][2].item() == shared
            for level, ours in quantd_nvfp4.items():
                assert_matches_modelopt(name, ours, modelopt_nvfp4[name], level)
    own = group_cases["gate"].float().abs().max() / 2688
    assert modelopt_nvfp4["gate"][2] > own, "test data must make the group amax matter"


def test_modelopt_direct_api_agrees_with_export(modelopt, nvfp4_inputs, modelopt_nvfp4):
    """`NVFP4QTensor.quantize(w, 16)` with nothing supplied gives the export's bytes too, so the
    comparison above does not hinge on the export wrapper."""
    cases, _ = nvfp4_inputs
    for name, w in cases.items():
        if name == "all_zero":
            continue
        q, scale, scale_2 = modelopt.qtensor.quantize(w, 16)
        weight, ref_scale, ref_scale_2 = modelopt_nvfp4[name]
        assert torch.equal(q._quantized_data, weight), name
        assert torch.equal(scale.view(torch.uint8), ref_scale), name
        assert f32_bits(scale_2.float()) == f32_bits(ref_scale_2), name


def test_all_zero_tensor(quantd_nvfp4, modelopt_nvfp4):
    # ModelOpt: amax 0 gives weight_scale_2 = 0, every block scale 0 / (6 * 0) = NaN (the "0 ->
    # 1.0" fix-up tests == 0, which NaN fails, and clamp keeps NaN), stored as E4M3 NaN 0xFF; every
    # value 0 / NaN = NaN, which `searchsorted` places past the last bound: code 7 (6.0), byte
    # 0x77. Such a checkpoint decodes to NaN.
    weight, scale, scale_2 = modelopt_nvfp4["all_zero"]
    assert scale_2.item() == 0.0
    assert bool((scale == 0xFF).all())
    assert bool((weight == 0x77).all())
    # quantd deliberately differs (formats.h Nvfp4GlobalScale): amax 0 is treated as amax 1, so
    # weight_scale_2 = 1/2688 (finite, and 1/weight_scale_2 is finite for compressed-tensors);
    # every block scale is 0 -> 1.0 (0x38) and every code 0, which decodes to exactly +0.0.
    for level, ours in quantd_nvfp4.items():
        expect = np.array([np.float32(1) / np.float32(2688)]).view(np.int32)[0]
        assert f32_bits(ours["all_zero.weight_scale_2"]).item() == expect, level
        assert bool((ours["all_zero.weight_scale"].view(torch.uint8) == 0x38).all()), level
        assert bool((ours["all_zero.weight"] == 0).all()), level
        assert bool((f32_bits(ours["all_zero.dequant"]) == 0).all()), level


def test_edge_cases_are_exercised(modelopt_nvfp4):
    """The adversarial tensors reach the code paths they are meant for (in ModelOpt's output)."""
    def scale_bytes(name):
        return modelopt_nvfp4[name][1]

    def codes(name):
        return unpack_codes(modelopt_nvfp4[name][0])

    assert bool((scale_bytes("zero_blocks") == 0x38).any())         # all-zero block -> 1.0
    assert bool((scale_bytes("tiny_near_floor") == 0x01).sum() > 4)  # clamped at 2^-9
    assert bool((scale_bytes("dynamic_range") == 0x01).any())
    assert bool((codes("negative_zero") == 0x8).any())               # tiny negatives -> -0
    assert bool((scale_bytes("thresholds") == 0x7E).any())           # 448
    assert bool((codes("thresholds") == 0x7).any())                  # saturation to 6
    # Literal -0.0 inputs encode as +0 (code 0): `weight < 0` is false for -0.0.
    assert bool((codes("negative_zero")[:, 8:12] == 0).all())


@pytest.mark.parametrize("name", CASES)
def test_dequant(name, quantd_nvfp4, modelopt, modelopt_nvfp4):
    """NAME.dequant is e2m1(code) * float(scale) * weight_scale_2 with one rounding (the first
    product is exact), i.e. the exactly rounded float64 product."""
    for level, ours in quantd_nvfp4.items():
        codes = unpack_codes(ours[f"{name}.weight"]).long()
        scale = ours[f"{name}.weight_scale"].float().repeat_interleave(16, dim=1)
        scale_2 = ours[f"{name}.weight_scale_2"]
        exact = (E2M1_VALUES[codes].double() * scale.double() * scale_2.double()).float()
        got = ours[f"{name}.dequant"]
        assert torch.equal(f32_bits(got), f32_bits(exact)), (name, level)

    if name == "all_zero":
        return
    # ModelOpt's own dequantize computes float(scale) * weight_scale_2 first and rounds it, then
    # multiplies by the E2M1 value: equal where that value is a power of two (or 0), at most one
    # float32 ulp apart where it is 1.5, 3 or 6 (double rounding). Its table decodes code 0x8 as
    # +0.0 where ours gives -0.0, so the first comparison is by value, not by bits.
    weight, scale_bytes, scale_2 = modelopt_nvfp4[name]
    rows, half = weight.shape
    qt = modelopt.qtensor((rows, 2 * half), torch.float32, weight)
    theirs = qt.dequantize(dtype=torch.float32, scale=scale_bytes.view(torch.float8_e4m3fn),
                           double_scale=scale_2, block_sizes={-1: 16})
    ours = next(iter(quantd_nvfp4.values()))[f"{name}.dequant"]
    mag = unpack_codes(weight) & 0x7
    pow2 = (mag <= 2) | (mag == 4) | (mag == 6)  # 0, 0.5, 1, 2, 4
    assert torch.equal(ours[pow2], theirs[pow2]), name
    ulps = (f32_bits(ours[~pow2]).long() - f32_bits(theirs[~pow2]).long()).abs()
    assert ulps.numel() == 0 or int(ulps.max()) <= 1, name
