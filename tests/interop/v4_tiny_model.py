"""The tiny random DeepSeek-V4 of the forward oracle (v4_forward_crosscheck.md §3: 4 layers =
sliding+hash, CSA+hash, HCA+top-k, CSA+top-k; S = 301 tokens, B = 2), shared by
test_v4_forward.py, test_v4_attention.py and test_calibration_modelopt.py.

`build_tiny_model` makes transformers' own DeepseekV4ForCausalLM in float32 with non-trivial
norms, sinks, biases, mHC parameters, compressor position biases and a tid2eid table with distinct
experts per row (transformers' init zeroes all of these), writes its weights in the official
checkpoint layout (FP8 E4M3 + E8M0 128x128 blocks for the FP8 linears, MXFP4 + E8M0 1x32 for
routed experts, BF16 / F32 / I64 elsewhere, official names), gives the model exactly the decoded
values, and draws the token ids, all from one seed.
"""

import json

import torch
from safetensors.torch import save_file

SEED = 1234
SEQUENCES, SEQ_LEN = 2, 301

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "compress_ratios": [0, 4, 128, 4, 0],
    "num_hash_layers": 2,
    "sliding_window": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}

# transformers module (under model.layers.N.) -> official module (under layers.N.).
LINEAR_NAMES = {
    "self_attn.q_a_proj": "attn.wq_a",
    "self_attn.q_b_proj": "attn.wq_b",
    "self_attn.kv_proj": "attn.wkv",
    "self_attn.o_a_proj": "attn.wo_a",
    "self_attn.o_b_proj": "attn.wo_b",
    "self_attn.compressor.kv_proj": "attn.compressor.wkv",
    "self_attn.compressor.gate_proj": "attn.compressor.wgate",
    "self_attn.compressor.indexer.q_b_proj": "attn.indexer.wq_b",
    "self_attn.compressor.indexer.scorer.weights_proj": "attn.indexer.weights_proj",
    "self_attn.compressor.indexer.kv_proj": "attn.indexer.compressor.wkv",
    "self_attn.compressor.indexer.gate_proj": "attn.indexer.compressor.wgate",
    "mlp.shared_experts.gate_proj": "ffn.shared_experts.w1",
    "mlp.shared_experts.up_proj": "ffn.shared_experts.w3",
    "mlp.shared_experts.down_proj": "ffn.shared_experts.w2",
}
FP8_LINEARS = {"attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3"}
# Other per-layer tensors: transformers suffix -> official suffix.
OTHER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
}
F32_OFFICIAL = ("hc_attn_", "hc_ffn_", "attn_sink", ".ape", "gate.bias")
FP4_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)


def pow2_exponent(amax, max_code, floor):
    """ceil(log2(max(amax, floor) / max_code)) as DeepSeek's quantizers choose block scales."""
    return torch.ceil(torch.log2(amax.clamp(min=floor) / max_code))


def e8m0(exponent):
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def encode_fp8(w):
    """FP8 E4M3 + E8M0 128x128 block scales; returns (codes, scales, decoded)."""
    o, i = w.shape
    blocks = w.reshape(o // 128, 128, i // 128, 128)
    exp = pow2_exponent(blocks.abs().amax(dim=(1, 3)), 448.0, 1e-4)
    s = torch.exp2(exp)[:, None, :, None]
    q = (blocks / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(o, i), e8m0(exp), (q.float() * s).reshape(o, i)


def encode_mxfp4(w):
    """MXFP4 (two E2M1 per byte, even column in the low nibble) + E8M0 1x32 scales."""
    o, i = w.shape
    blocks = w.reshape(o, i // 32, 32)
    exp = pow2_exponent(blocks.abs().amax(dim=-1), 6.0, 6 * 2.0 ** -126)
    s = torch.exp2(exp)[..., None]
    v = (blocks / s).clamp(-6, 6)
    idx = (v.abs()[..., None] - FP4_VALUES).abs().argmin(dim=-1)
    negative = v < 0
    decoded = torch.where(negative, -FP4_VALUES[idx], FP4_VALUES[idx]) * s
    code = (idx | (negative.to(torch.int64) << 3)).reshape(o, i).to(torch.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8)
    return packed, e8m0(exp), decoded.reshape(o, i)


def randomize(model, generator):
    """Well-conditioned random weights where transformers' init leaves zeros or constants."""
    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=generator) * std + mean

    config = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.endswith(".weight") and "norm" not in name:
                p.copy_(normal(p.shape, 1.0 if "embed" in name else p.shape[1] ** -0.5))
            elif name.endswith("gate_up_proj") or name.endswith("down_proj"):
                p.copy_(normal(p.shape, p.shape[-1] ** -0.5))
            elif "norm" in name:
                p.copy_(normal(p.shape, 0.1, 1.0))
            elif name.endswith(".fn") or name.endswith("hc_fn"):
                p.copy_(normal(p.shape, p.shape[1] ** -0.5))
            elif name.endswith(".base") or name.endswith("hc_base"):
                p.copy_(normal(p.shape, 0.5))
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                p.copy_(normal(p.shape, 0.1, 0.7))
            elif name.endswith("sinks"):
                p.copy_(normal(p.shape, 1.0))
            elif name.endswith("position_bias"):
                p.copy_(normal(p.shape, 0.3))
            else:
                raise AssertionError(f"parameter {name} has no initialisation rule")
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b.shape, 0.3))
            elif name.endswith("tid2eid"):
                rows = [torch.randperm(config.n_routed_experts, generator=generator)
                        [:config.num_experts_per_tok] for _ in range(config.vocab_size)]
                b.copy_(torch.stack(rows))


def save_official(model, path, config=None):
    """Writes the official checkpoint layout and gives `model` exactly the decoded weights."""
    tensors = {}
    sd = model.state_dict()
    n_layers = model.config.num_hidden_layers

    def bf16(official, hf_name):
        t = sd[hf_name].to(torch.bfloat16)
        tensors[official] = t.contiguous()
        sd[hf_name].copy_(t.float())

    def f32(official, hf_name):
        tensors[official] = sd[hf_name].float().contiguous()

    def fp8(official_module, hf_name):
        q, s, deq = encode_fp8(sd[hf_name].float())
        tensors[official_module + ".weight"], tensors[official_module + ".scale"] = q, s
        sd[hf_name].copy_(deq)

    with torch.no_grad():
        bf16("embed.weight", "model.embed_tokens.weight")
        bf16("head.weight", "lm_head.weight")
        bf16("norm.weight", "model.norm.weight")
        for leaf in ("fn", "base", "scale"):
            f32(f"hc_head_{leaf}", f"model.hc_head.hc_{leaf}")
        for n in range(n_layers):
            hp, op = f"model.layers.{n}.", f"layers.{n}."
            for hf_leaf, off_leaf in OTHER_NAMES.items():
                if hp + hf_leaf not in sd:
                    continue
                if off_leaf.endswith("tid2eid"):
                    tensors[op + off_leaf] = sd[hp + hf_leaf].to(torch.int64).contiguous()
                elif any(k in off_leaf for k in F32_OFFICIAL):
                    f32(op + off_leaf, hp + hf_leaf)
                else:
                    bf16(op + off_leaf, hp + hf_leaf)
            for hf_mod, off_mod in LINEAR_NAMES.items():
                hf_name = f"{hp}{hf_mod}.weight"
                if hf_name not in sd:
                    continue
                if off_mod in FP8_LINEARS:
                    fp8(op + off_mod, hf_name)
                else:
                    bf16(op + off_mod + ".weight", hf_name)
            gate_up, down = sd[hp + "mlp.experts.gate_up_proj"], sd[hp + "mlp.experts.down_proj"]
            inter = down.shape[2]
            for e in range(gate_up.shape[0]):
                for leaf, w in (("w1", gate_up[e, :inter]), ("w3", gate_up[e, inter:]),
                                ("w2", down[e])):
                    packed, scale, decoded = encode_mxfp4(w.float())
                    tensors[f"{op}ffn.experts.{e}.{leaf}.weight"] = packed
                    tensors[f"{op}ffn.experts.{e}.{leaf}.scale"] = scale
                    w.copy_(decoded)
        model.load_state_dict(sd)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config or CONFIG, indent=1))


def build_tiny_model(ckpt_dir, overrides=None, sequences=SEQUENCES, seq_len=SEQ_LEN):
    """The seeded tiny model (CONFIG, with `overrides` applied: a larger model of the same
    construction for the benchmarks), its official checkpoint written to `ckpt_dir`, and token
    ids [sequences, seq_len]: (model, ids). Needs transformers."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    values = {**CONFIG, **(overrides or {})}
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    config = DeepseekV4Config(**values)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).float().eval()
    randomize(model, generator)
    save_official(model, ckpt_dir, values)
    ids = torch.randint(0, values["vocab_size"], (sequences, seq_len), generator=generator)
    return model, ids
