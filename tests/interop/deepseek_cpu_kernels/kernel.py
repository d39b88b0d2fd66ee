"""CPU stand-ins for the official inference/kernel.py (tilelang), written from its kernels:
act_quant / fp4_act_quant (power-of-two scales, current revision: in-place rounds through FP8),
fp8_gemm (fp32 accumulate, default-dtype output) and sparse_attn (online softmax over blocks of 64
list slots, BF16 P before P.V, sink outside the running max)."""
import torch

def _pow2_ceil(r):
    m, e = torch.frexp(r)
    return torch.ldexp(torch.ones_like(r), torch.where(m == 0.5, e - 1, e))

def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    N = x.size(-1)
    assert N % block_size == 0
    xf = x.float().unflatten(-1, (-1, block_size))
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    inv = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    s = _pow2_ceil(amax * inv) if scale_fmt is not None else amax * inv
    y = (xf / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((y.float() * s).flatten(-2).to(x.dtype))
        return x
    return y.flatten(-2), s.squeeze(-1).to(scale_dtype)

_FP4 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)

def fp4_act_quant(x, block_size=32, inplace=False):
    assert inplace
    xf = x.float().unflatten(-1, (-1, block_size))
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0 ** -126)
    s = _pow2_ceil(amax * torch.tensor(1.0 / 6.0, dtype=torch.float32))
    q = (xf / s).clamp(-6, 6)
    m = q.abs()
    code = ((m > 0.25).int() + (m > 0.75).int() + (m > 1.25).int() + (m > 1.75).int() + (m > 2.5).int()
            + (m > 3.5).int() + (m > 5).int() + (m == 0.75).int() + (m == 1.75).int() + (m == 3.5).int())
    v = _FP4[code] * torch.where(q < 0, -1.0, 1.0)
    x.copy_((v * s).flatten(-2).to(x.dtype))
    return x

def fp8_gemm(a, a_s, b, b_s, scale_dtype):
    af = (a.float().unflatten(-1, (-1, 128)) * a_s.float().unsqueeze(-1)).flatten(-2)
    bf = b.float().unflatten(0, (-1, 128)).unflatten(-1, (-1, 128)) * b_s.float()[:, None, :, None]
    return (af @ bf.flatten(2, 3).flatten(0, 1).T).to(torch.get_default_dtype())

def fp4_gemm(*args):
    raise NotImplementedError

def hc_split_sinkhorn(*args):
    raise NotImplementedError

def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    b, m, h, d = q.shape
    topk = topk_idxs.size(-1)
    nb = (topk + 63) // 64
    idx = torch.nn.functional.pad(topk_idxs.long(), (0, nb * 64 - topk), value=-1)
    valid = idx != -1
    keys = kv[torch.arange(b)[:, None, None], idx.clamp(min=0)].float()  # [b, m, nb*64, d]
    keys = keys * valid[..., None]
    s = torch.einsum("bmhd,bmtd->bmht", q.float(), keys) * softmax_scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf")).unflatten(-1, (nb, 64))
    keys = keys.unflatten(2, (nb, 64))
    acc = torch.zeros(b, m, h, d)
    total = torch.zeros(b, m, h)
    mx = torch.full((b, m, h), float("-inf"))
    for t in range(nb):
        new = torch.maximum(mx, s[..., t, :].amax(-1))
        scale = torch.exp(mx - new)
        e = torch.exp(s[..., t, :] - new[..., None])
        total = total * scale + e.sum(-1)
        acc = acc * scale[..., None] + torch.einsum("bmht,bmtd->bmhd", e.to(torch.bfloat16).float(), keys[:, :, t])
        mx = new
    total = total + torch.exp(attn_sink.float() - mx)
    return (acc / total[..., None]).to(torch.bfloat16)
