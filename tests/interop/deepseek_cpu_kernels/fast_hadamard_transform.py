"""CPU stand-in for the fast_hadamard_transform package that DeepSeek's model.py imports: the
Sylvester-ordered Hadamard transform H[i][j] = (-1)^popcount(i & j) of the last dimension, times
`scale`, computed in float32 and returned in the input dtype."""
import torch


def hadamard_transform(x, scale=1.0):
    n = x.size(-1)
    i = torch.arange(n)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits = bits >> 1
    return ((x.float() @ (1.0 - 2.0 * parity.float())) * scale).to(x.dtype)
