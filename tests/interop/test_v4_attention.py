"""The DeepSeek-V4 attention sub-block alone (server/model/v4_attention.h), layer type by layer
type, against two other implementations on the tiny config of v4_tiny_model.py (sliding, CSA,
HCA, CSA; S = 301, B = 2):

* `math` numerics against transformers' DeepseekV4Attention in float32;
* `official` numerics against DeepSeek's official inference/model.py `Attention`, run on the CPU
  with deepseek_cpu_kernels/ standing in for its tilelang kernels. The official code is not
  redistributed here: point $QUANTD_DEEPSEEK_INFERENCE at its `inference/` directory (for example
  from the DeepSeek-V4-Flash repository); without it that test skips.

Each test writes a case file (input, weights under their official names, the reference output of
every layer) and runs the unit test V4AttentionCaseTest on it, which asserts the tolerances (see
tests/unit/v4_attention_test.cc): 3e-4 of max|ref| for math, SQNR >= 50 dB and >= 90% bitwise
equal values for official.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from v4_tiny_model import CONFIG, LINEAR_NAMES, OTHER_NAMES, encode_fp8

REPO = Path(__file__).resolve().parents[2]
SEED = 4321
SEQUENCES, SEQ_LEN = 2, 301
LAYERS = CONFIG["num_hidden_layers"]


def bf16(t):
    return t.to(torch.bfloat16).float()


def run_case(case, tensors, numerics):
    """Saves the case and runs V4AttentionCaseTest on it; returns its report."""
    path = case / "case.safetensors"
    save_file({k: v.detach().float().contiguous() for k, v in tensors.items()}, str(path),
              metadata={"config": json.dumps(CONFIG), "numerics": numerics})
    build = Path(os.environ.get("QUANTD_BUILD_DIR", REPO / "build"))
    binary = build / "tests" / "v4_attention_test"
    if not os.access(binary, os.X_OK):
        pytest.fail(f"missing {binary} (build the unit tests)", pytrace=False)
    proc = subprocess.run(
        [str(binary), "--gtest_filter=V4AttentionCaseTest.*"],
        env={**os.environ, "QUANTD_V4_ATTENTION_CASE": str(path)},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[  PASSED  ] 1 test" in proc.stdout, proc.stdout[-4000:]
    return proc.stdout


def official_name(hf_param):
    """official name under layers.N.attn. of a DeepseekV4Attention parameter."""
    full = "self_attn." + hf_param
    if full.endswith(".weight") and full[: -len(".weight")] in LINEAR_NAMES:
        return LINEAR_NAMES[full[: -len(".weight")]][len("attn."):] + ".weight"
    return OTHER_NAMES[full][len("attn."):]


def test_math_attention_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4Attention, DeepseekV4RotaryEmbedding)

    torch.manual_seed(SEED)
    config = transformers.DeepseekV4Config(**CONFIG)
    config._attn_implementation = "eager"
    x = bf16(torch.randn(SEQUENCES, SEQ_LEN, CONFIG["hidden_size"]))
    positions = torch.arange(SEQ_LEN).unsqueeze(0)
    rotary = DeepseekV4RotaryEmbedding(config)
    embeddings = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    q, k = torch.arange(SEQ_LEN)[:, None], torch.arange(SEQ_LEN)[None, :]
    window = CONFIG["sliding_window"]
    mask = torch.where((k <= q) & (k > q - window), 0.0, float("-inf"))
    mask = mask.expand(SEQUENCES, 1, SEQ_LEN, SEQ_LEN)
    tensors = {"x": x}
    for layer in range(LAYERS):
        attn = DeepseekV4Attention(config, layer).float()
        with torch.no_grad():
            for name, p in attn.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(bf16(torch.rand_like(p) + 0.5))
                elif name == "sinks":
                    p.copy_(torch.randn_like(p))
                elif name.endswith("position_bias"):
                    p.copy_(torch.randn_like(p) * 0.5)
                else:
                    p.copy_(bf16(torch.randn_like(p) / math.sqrt(p.shape[1])))
                tensors[f"layers.{layer}.attn.{official_name(name)}"] = p
            out, _ = attn(x, position_embeddings=embeddings, position_ids=positions,
                          attention_mask=mask)
        tensors[f"layers.{layer}.attn.out"] = out
    print(run_case(tmp_path, tensors, "math"))


def load_official_model():
    """DeepSeek's inference/model.py with the CPU kernels, or a skip without it."""
    inference = os.environ.get("QUANTD_DEEPSEEK_INFERENCE")
    if not inference or not (Path(inference) / "model.py").is_file():
        pytest.skip("QUANTD_DEEPSEEK_INFERENCE does not name DeepSeek's inference/ directory")
    for name in ("model", "kernel", "fast_hadamard_transform"):
        sys.modules.pop(name, None)
    sys.path[:0] = [str(Path(__file__).parent / "deepseek_cpu_kernels"), inference]
    try:
        import fast_hadamard_transform  # noqa: F401  (model.py imports it lazily)
        import model
    finally:
        del sys.path[:2]
    return model


def test_official_attention_matches_the_official_code(tmp_path):
    M = load_official_model()
    torch.manual_seed(SEED)
    args = M.ModelArgs(
        max_batch_size=SEQUENCES, max_seq_len=512, dtype="fp8", scale_fmt="ue8m0",
        scale_dtype="fp8", dim=CONFIG["hidden_size"], n_layers=LAYERS,
        n_heads=CONFIG["num_attention_heads"], q_lora_rank=CONFIG["q_lora_rank"],
        head_dim=CONFIG["head_dim"], rope_head_dim=CONFIG["qk_rope_head_dim"],
        norm_eps=CONFIG["rms_norm_eps"], o_groups=CONFIG["o_groups"],
        o_lora_rank=CONFIG["o_lora_rank"], window_size=CONFIG["sliding_window"],
        compress_ratios=tuple(CONFIG["compress_ratios"]),
        compress_rope_theta=float(CONFIG["compress_rope_theta"]),
        original_seq_len=CONFIG["rope_scaling"]["original_max_position_embeddings"],
        rope_theta=float(CONFIG["rope_theta"]), rope_factor=CONFIG["rope_scaling"]["factor"],
        beta_fast=CONFIG["rope_scaling"]["beta_fast"],
        beta_slow=CONFIG["rope_scaling"]["beta_slow"],
        index_n_heads=CONFIG["index_n_heads"], index_head_dim=CONFIG["index_head_dim"],
        index_topk=CONFIG["index_topk"])
    # What Transformer.__init__ sets for an FP8 checkpoint with E8M0 scales.
    M.default_dtype, M.scale_fmt, M.scale_dtype = torch.float8_e4m3fn, "ue8m0", torch.float8_e8m0fnu
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as generate.py
    try:
        x = torch.randn(SEQUENCES, SEQ_LEN, CONFIG["hidden_size"]).to(torch.bfloat16)
        tensors = {"x": x}
        for layer in range(LAYERS):
            attn = M.Attention(layer, args)
            with torch.no_grad():
                for name, p in attn.named_parameters():
                    if name.endswith(".scale"):
                        continue
                    if p.dtype == torch.float8_e4m3fn:
                        w = torch.randn(p.shape) / math.sqrt(p.shape[1])
                        codes, scale, value = encode_fp8(w)
                        module = attn.get_submodule(name[: -len(".weight")])
                        p.data = codes
                        module.scale.data = scale
                        module.weight.scale = module.scale
                    else:
                        if name == "wo_a.weight":  # FP8 on disk, BF16 after convert.py
                            value = encode_fp8(torch.randn(p.shape) / math.sqrt(p.shape[1]))[2]
                        elif name.endswith("norm.weight"):
                            value = bf16(torch.rand(p.shape) + 0.5)
                        elif name == "attn_sink":
                            value = torch.randn(p.shape)
                        elif name.endswith("ape"):
                            value = torch.randn(p.shape) * 0.5
                        else:  # compressor wkv / wgate, indexer weights_proj: BF16 on disk
                            value = bf16(torch.randn(p.shape) / math.sqrt(p.shape[1]))
                        p.data = value.to(p.dtype)
                    tensors[f"layers.{layer}.attn.{name}"] = value
            with torch.inference_mode():
                tensors[f"layers.{layer}.attn.out"] = attn(x.clone(), 0)
    finally:
        torch.set_default_dtype(previous_dtype)
    print(run_case(tmp_path, tensors, "official"))
