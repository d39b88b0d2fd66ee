import torch

def hadamard_transform(x, scale=1.0):
    n = x.size(-1)
    i = torch.arange(n)
    bits = (i[:, None] & i[None, :])
    sign = torch.zeros_like(bits)
    while bits.any():
        sign ^= bits & 1
        bits = bits >> 1
    H = 1.0 - 2.0 * sign.float()
    return ((x.float() @ H) * scale).to(x.dtype)
