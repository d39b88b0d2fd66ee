"""quantd's FP8-block and MXFP4 decoding against PyTorch's own float8_e4m3fn / float8_e8m0fnu
decoding of the same bytes, bit for bit in float32.

  FP8 block: w = float(e4m3) * scale, the scale of the 128x128 block (E8M0 2^(b-127) for V4,
             float32 `weight_scale_inv` for V3, where edge blocks are partial);
  MXFP4:     w = e2m1[nibble] * 2^(b-127), low nibble = even column, one E8M0 per 32 columns.
"""

import math

import torch
from safetensors.torch import save_file

from interop_helpers import E2M1_VALUES, checkpoint_tensors, f32_bits, library_tensors, unpack_codes


def fp8_block_reference(weight, scale):
    """torch's decode: weight float8_e4m3fn [r, c], scale float8_e8m0fnu or float32 [R, C]."""
    rows, cols = weight.shape
    s = scale.float().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return weight.float() * s[:rows, :cols]


def mxfp4_reference(weight, scale):
    """torch's decode: weight int8 [r, c/2] (two E2M1 codes per byte), scale float8_e8m0fnu."""
    values = E2M1_VALUES[unpack_codes(weight.view(torch.uint8)).long()]
    return values * scale.float().repeat_interleave(32, dim=1)


def expected_decodes(tensors):
    """name -> torch-decoded float32 for every FP8-block and MXFP4 weight of a checkpoint."""
    expected = {}
    for name, t in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if t.dtype == torch.float8_e4m3fn and t.dim() == 2:
            scale = tensors.get(f"{module}.scale") if module else None
            if scale is None:
                scale = tensors[f"{name}_scale_inv"]
            expected[name] = fp8_block_reference(t, scale)
        elif t.dtype == torch.int8 and module and f"{module}.scale" in tensors:
            assert tensors[f"{module}.scale"].dtype == torch.float8_e8m0fnu, name
            expected[name] = mxfp4_reference(t, tensors[f"{module}.scale"])
    return expected


def assert_bits_equal(got, want, what):
    assert got.dtype == torch.float32 and got.shape == want.shape, (what, got.shape, want.shape)
    bad = (f32_bits(got) != f32_bits(want)).nonzero()
    assert len(bad) == 0, (
        f"{what}: {len(bad)} of {want.numel()} values differ; first at "
        f"{[tuple(b.tolist()) for b in bad[:4]]}: ours {[got[tuple(b)].item() for b in bad[:4]]}, "
        f"torch {[want[tuple(b)].item() for b in bad[:4]]}")


def check_decode(qd, source, out, simd_levels):
    tensors = checkpoint_tensors(source) if source.is_dir() else library_tensors(source)[0]
    expected = expected_decodes(tensors)
    assert expected, f"{source}: nothing to decode"
    for level in simd_levels:
        qd.tool("--simd", level, "decode", source, out)
        ours = qd.load_output(out)
        assert set(ours) == set(expected), (level, set(ours) ^ set(expected))
        for name, want in expected.items():
            assert_bits_equal(ours[name], want, f"{name} [{level}]")
    return tensors, expected


def test_torch_e8m0_decode_is_a_power_of_two():
    """The oracle itself: float8_e8m0fnu byte b decodes to 2^(b-127), 0xFF to NaN."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = b.view(torch.float8_e8m0fnu).float()
    for i in range(255):
        assert decoded[i].item() == math.ldexp(1.0, i - 127), i
    assert math.isnan(decoded[255].item())


def test_v4_fixture(qd, v4_fixture, simd_levels, tmp_path):
    tensors, _ = check_decode(qd, v4_fixture, tmp_path / "decoded.safetensors", simd_levels)
    dtypes = {t.dtype for t in tensors.values()}
    assert {torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8} <= dtypes


def test_v3_fixture_with_partial_blocks(qd, v3_fixture, simd_levels, tmp_path):
    tensors, _ = check_decode(qd, v3_fixture, tmp_path / "decoded.safetensors", simd_levels)
    fp8 = [t for t in tensors.values() if t.dtype == torch.float8_e4m3fn]
    assert fp8 and all(f"{n}_scale_inv" in tensors for n, t in tensors.items()
                       if t.dtype == torch.float8_e4m3fn)
    assert any(t.shape[0] % 128 or t.shape[1] % 128 for t in fp8), "no partial edge block"


def test_every_code_and_scale(qd, simd_levels, tmp_path):
    """Every non-NaN E4M3 byte under every non-NaN E8M0 scale (products that underflow to
    subnormals and overflow to inf included), F32 scales with partial edge blocks (a subnormal
    scale among them), and every MXFP4 byte under every E8M0 scale."""
    g = torch.Generator().manual_seed(3)
    fp8_codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    cols = 128 * 255
    idx = torch.arange(128 * cols) % len(fp8_codes)
    e8m0_weight = fp8_codes[idx].view(128, cols)
    e8m0_scale = torch.arange(255, dtype=torch.uint8).view(1, 255)

    f32_weight = fp8_codes[torch.randint(0, len(fp8_codes), (200, 300), generator=g)]
    f32_scale = torch.tensor([[1.0, 3.0, 1e-40], [0.1, 2.0**-126, 12345.678]])

    mx_weight = torch.arange(32 * 128).remainder(256).to(torch.uint8).view(32, 128)
    mx_weight = mx_weight[torch.randperm(32, generator=g)]
    mx_scale = torch.arange(32 * 8).remainder(255).to(torch.uint8).view(32, 8)

    src = tmp_path / "codes.safetensors"
    save_file({
        "e8m0.weight": e8m0_weight.view(torch.float8_e4m3fn),
        "e8m0.scale": e8m0_scale.view(torch.float8_e8m0fnu),
        "v3.weight": f32_weight.view(torch.float8_e4m3fn),
        "v3.weight_scale_inv": f32_scale,
        "experts.0.w1.weight": mx_weight.view(torch.int8),
        "experts.0.w1.scale": mx_scale.view(torch.float8_e8m0fnu),
    }, str(src))
    _, expected = check_decode(qd, src, tmp_path / "decoded.safetensors", simd_levels)
    for name in ("e8m0.weight", "v3.weight"):
        mag = expected[name].abs()
        assert bool(((mag > 0) & (mag < 2.0**-126)).any()), f"{name}: no subnormal result"
    assert bool(torch.isinf(expected["e8m0.weight"]).any()), "no overflow to inf"
