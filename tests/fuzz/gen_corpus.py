#!/usr/bin/env python3
"""Writes the fuzz seed corpus (small valid safetensors files) into tests/fuzz/corpus/.

Run from anywhere; the files are committed, so this only needs rerunning when seeds change.
"""
import json
import pathlib
import struct


def image(tensors, metadata=None):
    """A safetensors file: tensors is a list of (name, dtype, shape, data bytes)."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


SEEDS = {
    "empty": image([]),
    "one_f32": image([("w", "F32", [2], struct.pack("<2f", 1.0, -2.0))]),
    "metadata": image([("a", "U8", [3], b"\x01\x02\x03")], {"format": "pt", "k": "v\"[{"}),
    "fp8_block": image([
        ("layers.0.attn.wq.weight", "F8_E4M3", [2, 4], bytes(range(8))),
        ("layers.0.attn.wq.scale", "F8_E8M0", [1, 1], b"\x7f"),
    ]),
    "mixed": image([
        ("bf16", "BF16", [2, 2], b"\x80\x3f" * 4),
        ("f16", "F16", [1], b"\x00\x3c"),
        ("f64", "F64", [], struct.pack("<d", 0.5)),
        ("i8", "I8", [2], b"\xff\x01"),
        ("i32", "I32", [1], struct.pack("<i", -7)),
        ("i64", "I64", [1, 1], struct.pack("<q", 1 << 40)),
        ("bool", "BOOL", [2], b"\x00\x01"),
        ("empty", "F32", [0, 3], b""),
    ]),
}

if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parent / "corpus"
    out.mkdir(exist_ok=True)
    for name, data in SEEDS.items():
        assert len(data) < 1024, name
        (out / f"{name}.safetensors").write_bytes(data)
