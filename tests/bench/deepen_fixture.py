#!/usr/bin/env python3
"""Writes a DeepSeek-V4 checkpoint with FACTOR times the decoder layers of SOURCE (a `quantd
mkfixture` output): layer N + k*L (k < FACTOR) is a byte copy of source layer N, except that the
copies of the hash-routed layers (the first num_hash_layers, which only the model's first layers
may be) take the first non-hash layer; config.json's num_hidden_layers and compress_ratios
follow, the MTP block and the other tensors are copied once. Byte-level safetensors: nothing is
decoded. For the calibration benchmark (run_calibrate_bench.sh) only.

usage: deepen_fixture.py SOURCE OUT FACTOR
"""

import json
import re
import shutil
import struct
import sys
from pathlib import Path

LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


def read_shard(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return header, data[8 + n:]


def main():
    source, out, factor = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    config = json.loads((source / "config.json").read_text())
    layers, hash_layers = config["num_hidden_layers"], config.get("num_hash_layers", 0)
    # Target layer -> its source layer.
    origin = [t if t < layers else max(t % layers, hash_layers) for t in range(layers * factor)]
    out.mkdir(parents=True)
    tensors = {}  # name -> (dtype, shape, bytes)
    for shard in sorted(source.glob("*.safetensors")):
        header, body = read_shard(shard)
        for name, t in header.items():
            start, end = t["data_offsets"]
            blob = body[start:end]
            m = LAYER.match(name)
            copies = [name] if m is None else [
                f"layers.{target}.{m.group(2)}" for target, n in enumerate(origin)
                if n == int(m.group(1))]
            for copy in copies:
                tensors[copy] = (t["dtype"], t["shape"], blob)
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape, blob = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    shard_name = "model-00001-of-00001.safetensors"
    with open(out / shard_name, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in sorted(tensors):
            f.write(tensors[name][2])
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": offset}, "weight_map": {n: shard_name for n in tensors}}))
    ratios = config["compress_ratios"]
    config["compress_ratios"] = [ratios[n] for n in origin] + ratios[layers:]
    config["num_hidden_layers"] = layers * factor
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / extra).exists():
            shutil.copy(source / extra, out / extra)


if __name__ == "__main__":
    main()
