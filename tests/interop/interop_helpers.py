"""Helpers shared by the interop tests: an independent safetensors parser, the E2M1 code table,
and the NVFP4 test tensors (random and adversarial)."""

import json
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

# safetensors dtype name -> (torch dtype, bytes per element).
ST_DTYPES = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
}

# E2M1 value of each 4-bit code (bit 3 = sign), as ModelOpt, DeepSeek and vLLM tabulate it.
E2M1_VALUES = torch.tensor(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32
)


def read_raw(path):
    """Parses a safetensors file by hand, independently of both the library and quantd.

    Returns (header_len, metadata, {name: (dtype, shape, bytes)}) after checking that the data
    section is exactly the concatenation of the tensors: no gap, overlap or trailing bytes.
    """
    blob = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    metadata = header.pop("__metadata__", {})
    data = blob[8 + n :]
    tensors = {}
    spans = []
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        size = ST_DTYPES[entry["dtype"]][1]
        numel = int(np.prod(entry["shape"], dtype=np.int64))
        assert end - begin == numel * size, f"{path}: {name}: byte range does not match shape"
        tensors[name] = (entry["dtype"], list(entry["shape"]), data[begin:end])
        spans.append((begin, end))
    pos = 0
    for begin, end in sorted(spans):
        assert begin == pos, f"{path}: gap or overlap at data byte {begin}"
        pos = end
    assert pos == len(data), f"{path}: {len(data) - pos} trailing bytes"
    return n, metadata, tensors


def tensor_bytes(t):
    """The raw bytes of a CPU tensor of any dtype (0-dim and empty tensors included)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def library_tensors(path):
    """Every tensor of `path` as the `safetensors` library reads it, checked against the header.

    Asserts that the library sees the same names, metadata, dtypes, shapes and bytes as the
    hand parser, and returns ({name: tensor}, metadata).
    """
    _, metadata, raw = read_raw(path)
    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(raw), path
        assert (f.metadata() or {}) == metadata, path
        for name in f.keys():
            t = f.get_tensor(name)
            dtype, shape, data = raw[name]
            assert t.dtype == ST_DTYPES[dtype][0], (path, name, t.dtype, dtype)
            assert list(t.shape) == shape, (path, name, t.shape, shape)
            assert tensor_bytes(t) == data, (path, name)
            tensors[name] = t
    return tensors, metadata


def check_written_by_quantd(path):
    """Format rules quantd's writer follows beyond what readers need: the JSON header is padded
    with spaces so that the data section starts on an 8-byte boundary."""
    blob = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    assert (8 + n) % 8 == 0, f"{path}: data section starts at {8 + n}, not 8-byte aligned"
    header = blob[8 : 8 + n]
    stripped = header.rstrip(b" ")
    assert stripped.startswith(b"{") and stripped.endswith(b"}"), f"{path}: header is not JSON"
    assert len(header) - len(stripped) < 8, f"{path}: more padding than alignment needs"


def shards(checkpoint_dir):
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    assert files, f"{checkpoint_dir}: no .safetensors files"
    return files


def checkpoint_tensors(checkpoint_dir):
    """{name: tensor} over every shard, as the library reads them (checked by library_tensors)."""
    tensors = {}
    for shard in shards(checkpoint_dir):
        t, _ = library_tensors(shard)
        assert not set(t) & set(tensors), f"{shard}: tensor names repeated across shards"
        tensors.update(t)
    return tensors


def unpack_codes(packed):
    """uint8 [r, c/2] -> E2M1 codes uint8 [r, c]; the even element is the low nibble."""
    codes = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    return codes


def f32_bits(t):
    """float32 tensor -> int32 bit patterns, so that comparisons are bit-exact."""
    return t.contiguous().view(torch.int32)


# ---- NVFP4 test tensors ------------------------------------------------------------------------

# E2M1 rounding thresholds (reference nvfp4_modelopt.md §1.5) and the magnitudes they separate.
E2M1_THRESHOLDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _bf16_neighbours(x):
    """x (exactly representable in BF16) and its two BF16 neighbours, as float32."""
    b = torch.tensor([x], dtype=torch.float32).bfloat16().view(torch.int16)
    near = torch.cat([b - 1, b, b + 1]).view(torch.bfloat16).float()
    return [float(v) for v in near]


def _threshold_tensor():
    """[8, 64] BF16 whose elements land exactly on (and one BF16 ulp around) every E2M1
    threshold after scaling, and whose block scales hit FP8 rounding ties.

    The tensor amax is 2688 * 2^-12, so weight_scale_2 = 2^-12 exactly and the amax block gets
    scale 448. A block whose amax is 6 * s * 2^-12 gets block scale s, so x / (s * 2^-12) is
    exact and equals the chosen threshold.
    """
    s2 = 2.0**-12
    t = torch.zeros(8, 64)
    t[0, 0] = 2688 * s2  # tensor amax -> weight_scale_2 = 2^-12, block scale 448
    blocks = []
    for s in (1.0, 1.5, 0.5, 2.0**-9 * 3):  # exact E4M3 block scales (the last is subnormal)
        vals = []
        for th in E2M1_THRESHOLDS:
            vals += _bf16_neighbours(th * s * s2)
        # Every block also holds 6 * s * 2^-12, its amax, so that its scale is exactly s.
        for j in range(0, len(vals), 15):
            blocks.append([6 * s * s2] + vals[j : j + 15])
    # FP8 ties: block amax / (6 * 2^-12) = 1.0625 (-> 1.0), 1.1875 (-> 1.25), 1.5 * 2^-9 (-> 2^-8)
    # and 2.5 * 2^-9 (-> 2^-8); each block's largest element then scales past 5 or to 6.
    for tie in (1.0625, 1.1875, 1.5 * 2.0**-9, 2.5 * 2.0**-9):
        blocks.append([6 * tie * s2, -6 * tie * s2, 5 * tie * s2, 3.5 * tie * s2])
    for i, chunk in enumerate(blocks):
        chunk = chunk + [0.0] * (16 - len(chunk))
        r, b = divmod(i, 4)
        r += 1  # row 0 holds the amax
        t[r, 16 * b : 16 * b + 16] = torch.tensor(chunk)
    # Negatives of the same rows, so that the sign path sees every threshold too.
    t[5:8] = -t[1:4]
    out = t.bfloat16()
    assert torch.equal(out.float(), t), "threshold values must be exact in BF16"
    return out


def nvfp4_cases():
    """name -> BF16/F32 [rows, cols] tensors covering the NVFP4 edge cases."""
    g = torch.Generator().manual_seed(20260901)
    cases = {}

    cases["normal"] = (torch.randn(256, 512, generator=g) * 0.02).bfloat16()

    # Student-t (2 degrees of freedom) with outlier channels, as real weights have.
    z = torch.randn(7, 4096, generator=g)
    u = torch.rand(7, 4096, generator=g).clamp_min(1e-12)
    heavy = z / torch.sqrt(-torch.log(u))
    heavy[:, [5, 100, 2000, 4095]] *= 50
    cases["heavy_tailed_outliers"] = (heavy * 0.01).bfloat16()

    # Some all-zero 16-blocks and one all-zero row.
    zb = torch.randn(64, 256, generator=g)
    mask = torch.rand(64, 16, generator=g) < 0.15
    zb.view(64, 16, 16)[mask] = 0
    zb[17] = 0
    cases["zero_blocks"] = zb.bfloat16()

    # Block amaxes around the 2^-9 floor: block scale amax_b / (6 * amax / 2688) = 2^-9 at
    # amax_b = 2^-9 / 448 (amax = 1), so blocks range over [2^-13, 2^-5] times that.
    floor = 2.0**-9 / 448
    tiny = torch.zeros(32, 256)
    tiny[0, 0] = 1.0
    ratios = [2.0**k for k in range(-13, -4)] + [0.49, 0.5, 0.51, 0.75, 1.0, 1.5, 2.0, 3.0]
    for i, ratio in enumerate(ratios):
        r, b = 1 + i // 16, i % 16
        amax_b = floor * ratio
        blk = (torch.rand(16, generator=g) * 2 - 1) * amax_b
        blk[i % 16] = -amax_b if i % 2 else amax_b
        tiny[r, 16 * b : 16 * b + 16] = blk
    cases["tiny_near_floor"] = tiny.bfloat16()

    cases["thresholds"] = _threshold_tensor()

    # Negatives that round to -0 (code 0x8), and literal -0.0 (code 0x0 in ModelOpt).
    neg = torch.zeros(4, 32)
    neg[:, 0] = 6.0
    neg[:, 1:8] = -torch.tensor([0.01, 0.1, 0.2, 0.24, 0.25, 0.26, 1e-30])
    neg[:, 8:12] = -0.0
    neg[:, 16] = -6.0
    neg[:, 17:24] = -torch.tensor([1e-6, 0.05, 0.125, 0.2, 0.3, 0.0, 1e-20])
    cases["negative_zero"] = neg.bfloat16()

    # Rows spanning 2^-60 .. 2^60, one with BF16 subnormals (a kernel that flushes denormals
    # would turn their blocks into zero blocks and their negatives into +0).
    dyn = torch.randn(64, 512, generator=g)
    dyn *= torch.exp2(torch.linspace(-60, 60, 64)).unsqueeze(1)
    dyn[3] = torch.randn(512, generator=g) * 1e-39
    cases["dynamic_range"] = dyn.bfloat16()

    # A tensor of BF16 subnormals: weight_scale_2 and the block scale * weight_scale_2 products
    # are float32 subnormals, the quotients are not (denormals-are-zero would flush everything).
    sub = torch.randn(8, 64, generator=g) * 2.0**-128
    sub[0, :16] = torch.linspace(-2.0**-133, 2.0**-133, 16)
    cases["subnormal"] = sub.bfloat16()

    cases["row_1x16"] = torch.randn(1, 16, generator=g).bfloat16()

    # F32 input (values not representable in BF16).
    cases["f32_input"] = torch.randn(16, 64, generator=g, dtype=torch.float32) * 3

    cases["all_zero"] = torch.zeros(4, 32, dtype=torch.bfloat16)
    return cases


# Fused groups: tensors that share one global amax (vLLM runs them as one GEMM).
NVFP4_GROUPS = [["gate", "up"], ["q", "k", "v"]]


def nvfp4_group_cases():
    g = torch.Generator().manual_seed(7)
    return {
        "gate": (torch.randn(64, 256, generator=g) * 0.01).bfloat16(),
        "up": (torch.randn(64, 256, generator=g) * 0.05).bfloat16(),
        "q": (torch.randn(48, 128, generator=g) * 0.02).bfloat16(),
        "k": (torch.randn(16, 128, generator=g) * 0.3).bfloat16(),
        "v": (torch.randn(16, 128, generator=g) * 0.001).bfloat16(),
    }
