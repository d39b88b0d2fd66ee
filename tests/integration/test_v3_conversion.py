"""`quantd run` end to end on the tiny DeepSeek-V3 fixture (HF names, F32 block scales, partial
FP8 edge blocks): both recipes, both export formats and the BF16 copy, each checked by
`quantd verify`, with the tensors each format must hold."""

import json

import pytest


@pytest.fixture(scope="module")
def v3_source(qd, tmp_path_factory):
    src = tmp_path_factory.mktemp("v3") / "tiny-v3"
    qd.run_ok("mkfixture", "--arch", "deepseek-v3", "--preset", "tiny", "--seed", 3, src)
    return src


@pytest.mark.parametrize("recipe", ["experts", "full"])
@pytest.mark.parametrize("export_format", ["modelopt", "compressed-tensors"])
def test_v3_converts_and_verifies(qd, v3_source, tmp_path, recipe, export_format):
    out, bf16 = tmp_path / "out", tmp_path / "bf16"
    spec = {"source": str(v3_source), "output": str(out), "recipe": recipe,
            "weight_format": "w4a16_nvfp4", "export_format": export_format,
            "materialize_bf16": str(bf16)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    qd.run_ok("run", "--state", tmp_path / "state.db", tmp_path / "spec.json")
    report = json.loads(qd.run_ok("verify", "--json", out).stdout)
    assert report["ok"], report["violations"]
    assert report["nvfp4_modules"] > 0

    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    config = json.loads((out / "config.json").read_text())
    # The MTP layer (index num_hidden_layers) stays out of NVFP4 under both recipes.
    main = [n for n in weight_map
            if not n.startswith(f"model.layers.{config['num_hidden_layers']}.")]
    packed = ".weight" if export_format == "modelopt" else ".weight_packed"
    experts = [n for n in main if ".mlp.experts." in n and n.endswith(packed)]
    assert experts and all(n[: -len(packed)] + ".weight_scale" in weight_map for n in experts)
    # No FP8 is left: quantized modules lose their scales, and the FP8 modules the recipe leaves
    # alone (attention under `experts`, the MTP layer) are BF16, which is what readers take a
    # module outside the NVFP4 config to be (quantd verify checked their dtype and values).
    assert not any(n.endswith("weight_scale_inv") for n in weight_map)
    attention = [n.rsplit(".", 1)[0] for n in main if ".self_attn." in n
                 and (n.endswith("_proj.weight") or n.endswith("_proj.weight_packed"))]
    assert attention
    nvfp4_attention = [m for m in attention if m + ".weight_scale" in weight_map]
    assert bool(nvfp4_attention) == (recipe == "full")  # `full` quantizes attention too

    method = config["quantization_config"]["quant_method"]
    assert method == ("modelopt" if export_format == "modelopt" else "compressed-tensors")
    bf16_map = json.loads((bf16 / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(n.endswith("weight_scale_inv") for n in bf16_map)
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
