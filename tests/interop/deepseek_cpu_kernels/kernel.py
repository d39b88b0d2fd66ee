"""CPU stand-ins for DeepSeek-V4's official inference/kernel.py (tilelang, GPU only), written from
its kernels so that inference/model.py runs on the CPU for test_v4_attention.py:

* act_quant / fp4_act_quant: per row and block, amax floored (1e-4 / 6 * 2^-126), power-of-two
  scale 2^ceil(log2(amax * fp32(1/max))), E4M3 / E2M1 round to nearest even; the in-place form
  rounds through FP8 (the current revision, deepseek_v4_format.md §7 "Other revision change").
* fp8_gemm: both operands dequantized, fp32 product, output in the default dtype (BF16).
* sparse_attn: online softmax over blocks of 64 key-list slots, fp32 scores and sums, P rounded to
  BF16 before P.V, the sink added to the denominator after the last block (outside the running max).
"""
import torch

FP4_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)


def _pow2_ceil(r):
    """2^ceil(log2(r)) for positive normal float32 r, exactly."""
    mantissa, exponent = torch.frexp(r)
    return torch.ldexp(torch.ones_like(r), torch.where(mantissa == 0.5, exponent - 1, exponent))


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    assert x.size(-1) % block_size == 0
    xf = x.float().unflatten(-1, (-1, block_size))
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    inv = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    s = _pow2_ceil(amax * inv) if scale_fmt is not None else amax * inv
    y = (xf / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((y.float() * s).flatten(-2).to(x.dtype))
        return x
    return y.flatten(-2), s.squeeze(-1).to(scale_dtype)


def fp4_act_quant(x, block_size=32, inplace=False):
    assert inplace and x.size(-1) % block_size == 0
    xf = x.float().unflatten(-1, (-1, block_size))
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0 ** -126)
    s = _pow2_ceil(amax * torch.tensor(1.0 / 6.0, dtype=torch.float32))
    q = (xf / s).clamp(-6, 6)
    m = q.abs()
    # E2M1 code of |q|, ties to the even code: 0.75 -> 1, 1.75 -> 2, 3.5 -> 4 round up;
    # 0.25, 1.25, 2.5, 5 round down.
    code = sum((m > b).int() for b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
    code = code + sum((m == t).int() for t in (0.75, 1.75, 3.5))
    v = FP4_VALUES[code] * torch.where(q < 0, -1.0, 1.0)
    x.copy_((v * s).flatten(-2).to(x.dtype))
    return x


def fp8_gemm(a, a_s, b, b_s, scale_dtype):
    af = (a.float().unflatten(-1, (-1, 128)) * a_s.float().unsqueeze(-1)).flatten(-2)
    bf = b.float().unflatten(0, (-1, 128)).unflatten(-1, (-1, 128)) * b_s.float()[:, None, :, None]
    return (af @ bf.flatten(2, 3).flatten(0, 1).T).to(torch.get_default_dtype())


def fp4_gemm(*args):
    raise NotImplementedError("routed experts are not part of the attention test")


def hc_split_sinkhorn(*args):
    raise NotImplementedError("mHC is not part of the attention test")


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    b, m, h, d = q.shape
    blocks = (topk_idxs.size(-1) + 63) // 64
    idx = torch.nn.functional.pad(topk_idxs.long(), (0, blocks * 64 - topk_idxs.size(-1)), value=-1)
    valid = idx != -1
    keys = kv[torch.arange(b)[:, None, None], idx.clamp(min=0)].float() * valid[..., None]
    s = torch.einsum("bmhd,bmtd->bmht", q.float(), keys) * softmax_scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf")).unflatten(-1, (blocks, 64))
    keys = keys.unflatten(2, (blocks, 64))
    acc = torch.zeros(b, m, h, d)
    total = torch.zeros(b, m, h)
    running_max = torch.full((b, m, h), float("-inf"))
    for t in range(blocks):
        new_max = torch.maximum(running_max, s[..., t, :].amax(-1))
        rescale = torch.exp(running_max - new_max)
        e = torch.exp(s[..., t, :] - new_max[..., None])
        total = total * rescale + e.sum(-1)
        p = e.to(torch.bfloat16).float()
        acc = acc * rescale[..., None] + torch.einsum("bmht,bmtd->bmhd", p, keys[:, :, t])
        running_max = new_max
    total = total + torch.exp(attn_sink.float() - running_max)
    return (acc / total[..., None]).to(torch.bfloat16)
