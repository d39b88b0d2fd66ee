"""`quantd mkfixture --preset pro|flash`: the real DeepSeek-V4 dimensions of
reference/deepseek_v4_format.md §1/§2 with small expert and vocabulary counts, as `quantd inspect`
and the shard headers see them."""

import json
import struct

# --preset pro --layers 1 --experts 8 --vocab 1024: reference §2's Pro shapes (stored ones: MXFP4
# weights are [out, in/2] I8).
PRO_SHAPES = {
    "embed.weight": ("BF16", [1024, 7168]),
    "head.weight": ("BF16", [1024, 7168]),
    "hc_head_fn": ("F32", [4, 28672]),
    "layers.0.hc_attn_fn": ("F32", [24, 28672]),
    "layers.0.attn.wq_a.weight": ("F8_E4M3", [1536, 7168]),
    "layers.0.attn.wq_a.scale": ("F8_E8M0", [12, 56]),
    "layers.0.attn.wq_b.weight": ("F8_E4M3", [65536, 1536]),
    "layers.0.attn.wkv.weight": ("F8_E4M3", [512, 7168]),
    "layers.0.attn.wo_a.weight": ("F8_E4M3", [16384, 4096]),
    "layers.0.attn.wo_a.scale": ("F8_E8M0", [128, 32]),
    "layers.0.attn.wo_b.weight": ("F8_E4M3", [7168, 16384]),
    "layers.0.attn.attn_sink": ("F32", [128]),
    "layers.0.attn.compressor.ape": ("F32", [128, 512]),
    "layers.0.attn.compressor.wkv.weight": ("BF16", [512, 7168]),
    "layers.0.ffn.gate.weight": ("BF16", [8, 7168]),
    "layers.0.ffn.gate.tid2eid": ("I64", [1024, 6]),
    "layers.0.ffn.experts.7.w1.weight": ("I8", [3072, 3584]),
    "layers.0.ffn.experts.7.w1.scale": ("F8_E8M0", [3072, 224]),
    "layers.0.ffn.experts.7.w2.weight": ("I8", [7168, 1536]),
    "layers.0.ffn.experts.7.w2.scale": ("F8_E8M0", [7168, 96]),
    "layers.0.ffn.shared_experts.w1.weight": ("F8_E4M3", [3072, 7168]),
    "layers.0.ffn.shared_experts.w2.weight": ("F8_E4M3", [7168, 3072]),
    "layers.0.ffn.shared_experts.w2.scale": ("F8_E8M0", [56, 24]),
}


def headers(model):
    """tensor name -> (dtype, shape), from every shard's safetensors header."""
    out = {}
    for shard in sorted(model.glob("*.safetensors")):
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out.update({k: (v["dtype"], v["shape"]) for k, v in header.items()})
    return out


def test_pro_layer_has_the_real_shapes(qd, tmp_path):
    model = tmp_path / "pro"
    qd.run_ok("mkfixture", "--preset", "pro", "--layers", 1, "--experts", 8, "--vocab", 1024,
              model, timeout=120)
    config = json.loads((model / "config.json").read_text())
    assert (config["hidden_size"], config["n_routed_experts"], config["vocab_size"]) == \
        (7168, 8, 1024)
    assert config["compress_ratios"] == [128, 0] and config["num_nextn_predict_layers"] == 0
    assert config["routed_scaling_factor"] == 2.5

    got = headers(model)
    for name, want in PRO_SHAPES.items():
        assert got.get(name) == (want[0], want[1]), name
    assert "layers.0.ffn.experts.8.w1.weight" not in got
    assert not [n for n in got if n.startswith("mtp.")]
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)

    report = json.loads(qd.run_ok("inspect", "--json", model).stdout)
    assert report["arch"] == "deepseek_v4"
    # 2 * 1024*7168*2 (embed, head) + 8 experts * 35094528 + 1024*6*8 (tid2eid) + the rest of the
    # layer 392435244 (reference §2's Pro shapes).
    assert report["tensor_bytes"] == index["metadata"]["total_size"] == 697210412
    assert report["tensors"] == len(got)


def test_cuts_are_refused_with_the_flag_named(qd, tmp_path):
    for args, message in [
        (["--preset", "pro", "--experts", 5], "--experts 5 is outside [6, 384]"),
        (["--preset", "flash", "--vocab", 100], "--vocab 100 is outside [261, 129280]"),
        (["--preset", "flash", "--layers", 44], "--layers 44 is outside [1, 43]"),
        (["--preset", "tiny", "--mtp"], "--mtp is only for --preset pro and --preset flash"),
        (["--arch", "deepseek-v3", "--preset", "pro"], "--preset pro is a DeepSeek-V4 model"),
    ]:
        proc = qd.run("mkfixture", *args, tmp_path / "x")
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert not (tmp_path / "x").exists()
