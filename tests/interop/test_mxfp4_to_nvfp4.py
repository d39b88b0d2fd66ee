"""quantd's lossless MXFP4 -> NVFP4 cast against torch's decode and ModelOpt 0.47's own cast
(`modelopt.torch.export.shard_cast_utils`, which runs on CPU).

With weight_scale_2 = 2^(kmax-8), a 32-block with exponent k gets the exact E4M3 block scale
2^(k-kmax+8) when k-kmax+8 >= -9, and its nibbles are copied, so it decodes to the same values
bit for bit. The others ("out of window") are requantized from their exact values with ModelOpt's
NVFP4 rules and counted.

Where ModelOpt's `quantize_mxfp4_to_nvfp4_lossless` differs, by design:
  - it re-encodes every block from BF16, so a -0 nibble (0x8) becomes +0 (0x0); quantd copies
    nibbles verbatim (both decode to zero);
  - for out-of-window blocks it uses the amax of the 32-element MXFP4 block for both 16-element
    halves; quantd uses each half's own amax, i.e. ModelOpt's plain NVFP4 quantization of the
    exact values (`quantize_mxfp4_to_nvfp4` with global amax 2688 * 2^(kmax-8)), which is what
    these blocks are compared against;
  - it ignores scale byte 0 (k = -127) when taking kmax and counts such blocks as lossless,
    assuming they are all zero; quantd treats them as any other exponent.
"""

import re
import warnings

import pytest
import torch
from safetensors.torch import save_file

from interop_helpers import E2M1_VALUES, checkpoint_tensors, f32_bits, tensor_bytes, unpack_codes


@pytest.fixture(scope="module")
def cast_utils():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export import shard_cast_utils
    return shard_cast_utils


def run_cast(qd, source, out, level, *extra):
    """Runs the cast; returns (output tensors, {weight name: (kmax, requantized blocks)})."""
    stdout = qd.tool("--simd", level, "mxfp4-to-nvfp4", source, out, *extra)
    counts = {m[0]: (int(m[1]), int(m[2]))
              for m in re.findall(r"^(\S+) kmax=(-?\d+) requantized_blocks=(\d+)$", stdout, re.M)}
    return qd.load_output(out), counts


def mxfp4_values(weight, scale):
    """torch's decode of MXFP4 (uint8 weight and scale bytes) to float32."""
    unit = scale.view(torch.float8_e8m0fnu).float().repeat_interleave(32, dim=1)
    return E2M1_VALUES[unpack_codes(weight).long()] * unit


def check_cast(name, weight, scale, ours, kmax, count, cast_utils):
    """weight uint8 [r, c/2], scale uint8 [r, c/32]: the MXFP4 source; ours: the cast's tensors."""
    module = name[: -len(".weight")]
    packed = ours[f"{module}.weight"]
    block_scale = ours[f"{module}.weight_scale"].view(torch.uint8)
    scale_2 = ours[f"{module}.weight_scale_2"]
    rows, half = weight.shape
    assert packed.shape == (rows, half) and block_scale.shape == (rows, 2 * half // 16)
    assert scale_2.item() == 2.0 ** (kmax - 8), name

    k = scale.int() - 127
    e = (k - kmax + 8).repeat_interleave(2, dim=1)  # per 16-block
    window = e >= -9
    assert count == int((~window).sum()), name

    # In-window blocks: scale 2^e exactly, nibbles copied, values bit-identical to the source.
    exact = torch.tensor([2.0**v for v in e[window].tolist()], dtype=torch.float32)
    assert torch.equal(block_scale[window], exact.to(torch.float8_e4m3fn).view(torch.uint8)), name
    byte_window = window.repeat_interleave(8, dim=1)
    assert torch.equal(packed[byte_window], weight[byte_window]), name
    source_values = mxfp4_values(weight, scale)
    ours_values = (E2M1_VALUES[unpack_codes(packed).long()].double()
                   * ours[f"{module}.weight_scale"].double().repeat_interleave(16, dim=1)
                   * scale_2.double()).float()
    value_window = window.repeat_interleave(16, dim=1)
    assert torch.equal(f32_bits(ours_values[value_window]), f32_bits(source_values[value_window]))

    # ModelOpt's lossless cast, same kmax: equal in-window, up to -0 nibbles.
    mo_packed, mo_scale, mo_scale_2, _, _ = cast_utils.quantize_mxfp4_to_nvfp4_lossless(
        weight.view(torch.int8), scale.view(torch.float8_e8m0fnu), kmax, "cpu")
    assert f32_bits(mo_scale_2) == f32_bits(scale_2), name
    assert torch.equal(mo_scale.view(torch.uint8)[window], block_scale[window]), name
    codes = unpack_codes(packed)
    plus_zero = torch.where(codes == 0x8, torch.zeros_like(codes), codes)
    code_window = window.repeat_interleave(16, dim=1)
    assert torch.equal(unpack_codes(mo_packed)[code_window], plus_zero[code_window]), name

    # Out-of-window blocks: ModelOpt's plain NVFP4 quantization of the exact values.
    if count:
        amax = torch.tensor(2688.0 * 2.0 ** (kmax - 8))
        ref_packed, ref_scale, ref_scale_2, _ = cast_utils.quantize_mxfp4_to_nvfp4(
            weight.view(torch.int8), scale.view(torch.float8_e8m0fnu), amax, "cpu")
        assert f32_bits(ref_scale_2) == f32_bits(scale_2), name
        assert torch.equal(ref_scale.view(torch.uint8)[~window], block_scale[~window]), name
        assert torch.equal(unpack_codes(ref_packed)[~code_window], codes[~code_window]), name
    return int((codes[code_window] == 0x8).sum())


def test_v4_fixture_experts(qd, v4_fixture, simd_levels, cast_utils, tmp_path):
    tensors = checkpoint_tensors(v4_fixture)
    experts = {n: t for n, t in tensors.items()
               if t.dtype == torch.int8 and n.endswith(".weight") and n[:-7] + ".scale" in tensors}
    assert experts
    first, counts = run_cast(qd, v4_fixture, tmp_path / "first.safetensors", simd_levels[0])
    assert set(counts) == set(experts)
    for name, w in experts.items():
        scale = tensors[name[:-7] + ".scale"].view(torch.uint8)
        kmax = int(scale.max()) - 127
        assert counts[name][0] == kmax, name
        check_cast(name, w.view(torch.uint8), scale, first, kmax, counts[name][1], cast_utils)
    # The other SIMD levels write the same bytes and counts.
    for level in simd_levels[1:]:
        ours, level_counts = run_cast(qd, v4_fixture, tmp_path / f"{level}.safetensors", level)
        assert level_counts == counts, level
        assert set(ours) == set(first)
        for name, t in first.items():
            assert tensor_bytes(ours[name]) == tensor_bytes(t), (level, name)


def spread_mxfp4():
    """An MXFP4 weight [8, 256] whose block exponents span 127 octaves: blocks at the window's
    edges (k - kmax = -17 is the last lossless one), far below it, scale byte 0, -0 nibbles, and
    out-of-window blocks with one all-zero 16-half."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randint(0, 256, (8, 128), generator=g, dtype=torch.int32).to(torch.uint8)
    weight[0, :8] = 0x88                      # -0 nibbles in an in-window block
    weight[1, 64:72] = 0x00                   # all-zero first half of an out-of-window block
    offsets = [0, -3, -8, -16, -17, -18, -30, -147]  # k - kmax; -147 is scale byte 0
    kmax_byte = 147
    scale = torch.tensor([[kmax_byte + offsets[(r + b) % 8] for b in range(8)] for r in range(8)],
                         dtype=torch.int32).to(torch.uint8)
    return weight, scale


@pytest.mark.parametrize("extra_octaves", [0, 3])
def test_exponent_spread(qd, simd_levels, cast_utils, tmp_path, extra_octaves):
    """With --kmax above the tensor's own (an expert's w1 sharing w3's larger kmax), more blocks
    fall out of the window."""
    weight, scale = spread_mxfp4()
    src = tmp_path / "spread.safetensors"
    save_file({"experts.0.w1.weight": weight.view(torch.int8),
               "experts.0.w1.scale": scale.view(torch.float8_e8m0fnu)}, str(src))
    kmax = int(scale.max()) - 127 + extra_octaves
    extra = ["--kmax", kmax] if extra_octaves else []
    for level in simd_levels:
        ours, counts = run_cast(qd, src, tmp_path / f"{level}.safetensors", level, *extra)
        assert counts["experts.0.w1.weight"][0] == kmax
        count = counts["experts.0.w1.weight"][1]
        # 16-blocks per row: 16; offsets -18, -30, -147 (and -16, -17 with 3 extra octaves) are out.
        assert count == 8 * 2 * (3 if extra_octaves == 0 else 5), count
        minus_zero = check_cast("experts.0.w1.weight", weight, scale, ours, kmax, count, cast_utils)
        assert minus_zero > 0, "the -0 nibbles must survive the cast"


def test_kmax_below_own_is_rejected(qd, tmp_path):
    weight, scale = spread_mxfp4()
    src = tmp_path / "spread.safetensors"
    save_file({"experts.0.w1.weight": weight.view(torch.int8),
               "experts.0.w1.scale": scale.view(torch.float8_e8m0fnu)}, str(src))
    err = qd.tool_fails("mxfp4-to-nvfp4", src, tmp_path / "out.safetensors", "--kmax", 19)
    assert "experts.0.w1.weight" in err and "kmax" in err
