"""quantd's safetensors files and the `safetensors` library, both ways.

  - the library reads every tensor of the V4 and V3 fixtures (and, in the other test files, every
    file quantd_interop_tool writes) with the dtype, shape and bytes that the header states,
    checked against an independent parse of the header (interop_helpers.read_raw);
  - quantd's reader and writer carry every tensor of those files through unchanged (`copy`);
  - a file the library writes, with every dtype quantd handles, is read by quantd and written
    back with identical tensors and metadata.
"""

import json

import numpy as np
import torch
from safetensors.torch import save_file

from interop_helpers import (
    ST_DTYPES,
    check_written_by_quantd,
    library_tensors,
    read_raw,
    shards,
    tensor_bytes,
)


def assert_same_file_contents(a, b):
    """Same tensors (names, dtypes, shapes, bytes) and metadata; the layout may differ."""
    _, meta_a, ta = read_raw(a)
    _, meta_b, tb = read_raw(b)
    assert meta_a == meta_b
    assert set(ta) == set(tb), set(ta) ^ set(tb)
    for name in ta:
        assert ta[name] == tb[name], name


def test_fixtures_read_by_library(v4_fixture, v3_fixture):
    for fixture in (v4_fixture, v3_fixture):
        index = json.loads((fixture / "model.safetensors.index.json").read_text())
        seen = {}
        total = 0
        for shard in shards(fixture):
            check_written_by_quantd(shard)
            tensors, _ = library_tensors(shard)
            for name, t in tensors.items():
                seen[name] = shard.name
                total += len(tensor_bytes(t))
        assert index["weight_map"] == seen
        assert index["metadata"]["total_size"] == total


def test_fixture_dtypes(v4_fixture, v3_fixture):
    """The fixtures hold every dtype DeepSeek's checkpoints use, so the peer checks cover them."""
    def dtypes(fixture):
        return {dtype for shard in shards(fixture) for dtype, _, _ in read_raw(shard)[2].values()}

    assert {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32", "I64"} <= dtypes(v4_fixture)
    assert {"F8_E4M3", "BF16", "F32"} <= dtypes(v3_fixture)


def test_copy_preserves_fixture_shards(qd, v4_fixture, v3_fixture, tmp_path):
    for fixture in (v4_fixture, v3_fixture):
        for shard in shards(fixture):
            out = tmp_path / f"{fixture.parent.name}-{shard.name}"
            qd.tool("copy", shard, out)
            check_written_by_quantd(out)
            library_tensors(out)
            assert_same_file_contents(shard, out)


def every_dtype_tensors():
    """One or more tensors of each dtype quantd handles, with arbitrary bit patterns (NaN and
    infinity codes included), 0-dim, empty and odd-sized shapes."""
    g = torch.Generator().manual_seed(11)

    def random_bytes(n):
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.int32).to(torch.uint8)

    tensors = {}
    for name, (dtype, size) in ST_DTYPES.items():
        if name == "I16":
            continue  # not a dtype quantd reads
        for shape in ([3, 5], [7], [], [0, 4], [2, 3, 4]):
            n = int(np.prod(shape, dtype=np.int64))
            if dtype == torch.bool:
                t = (random_bytes(n) & 1).bool()
            else:
                t = random_bytes(n * size).view(dtype)
            tensors[f"{name.lower()}_{'x'.join(map(str, shape)) or 'scalar'}"] = t.reshape(shape)
    return tensors


def test_library_written_file_read_by_quantd(qd, tmp_path):
    src = tmp_path / "every_dtype.safetensors"
    tensors = every_dtype_tensors()
    save_file(tensors, str(src), metadata={"format": "pt", "note": "written by safetensors"})
    out = tmp_path / "copied.safetensors"
    qd.tool("copy", src, out)
    check_written_by_quantd(out)
    got, metadata = library_tensors(out)
    assert metadata == {"format": "pt", "note": "written by safetensors"}
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert tensor_bytes(got[name]) == tensor_bytes(t), name
    assert_same_file_contents(src, out)

    # quantd inspect reads the library's file as a one-shard checkpoint.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(src.read_bytes())
    (ckpt / "config.json").write_text("{}")
    assert_inspect_agrees(qd.inspect_json(ckpt), [ckpt / "model.safetensors"])


def assert_inspect_agrees(report, files):
    """`quantd inspect --json` counts the tensors and bytes of each dtype as the header says."""
    by_dtype = {}
    for path in files:
        for dtype, _, data in read_raw(path)[2].values():
            entry = by_dtype.setdefault(dtype, {"bytes": 0, "tensors": 0})
            entry["bytes"] += len(data)
            entry["tensors"] += 1
    assert report["by_dtype"] == by_dtype
    assert report["tensors"] == sum(e["tensors"] for e in by_dtype.values())
    assert report["tensor_bytes"] == sum(e["bytes"] for e in by_dtype.values())


def test_inspect_agrees_on_fixtures(qd, v4_fixture, v3_fixture):
    for fixture in (v4_fixture, v3_fixture):
        assert_inspect_agrees(qd.inspect_json(fixture), shards(fixture))


def test_damaged_file_is_rejected(qd, v4_fixture, tmp_path):
    """A truncated shard is an error that names the file, never a crash or a short read."""
    shard = shards(v4_fixture)[0]
    blob = shard.read_bytes()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(blob[: len(blob) - 3])
    err = qd.tool_fails("copy", bad, tmp_path / "out.safetensors")
    assert "truncated.safetensors" in err
    assert not (tmp_path / "out.safetensors").exists()
