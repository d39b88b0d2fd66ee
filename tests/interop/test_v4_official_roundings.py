"""The exact values of tests/unit/v4_rounding_test.cc against the official code's semantics in
torch: the q_norm output (model.py `RMSNorm`: float32, one cast to BF16), the per-head q
normalisation of `Attention.forward` on a BF16 tensor, the
indexer's BF16 score sum of `Indexer.forward`, and its Hadamard transform + FP4 simulation through
deepseek_cpu_kernels/ (CPU stand-ins written from fast_hadamard_transform and kernel.py). The C++
test asserts that quantd's official numerics produce these numbers; this one that DeepSeek's
semantics do, so the two pin the same constants from both sides.

One CPU quirk is named rather than followed: torch's CPU rsqrt of a BF16 tensor rounds twice on
its scalar tail path (bf16(1 / bf16(sqrt(x))); its vectorized body and the CUDA kernel that the
official code runs round once, bf16(rsqrt(float(x)))), and 1.0078125 is exactly where the two
differ (1.0 against 255/256). The reference below takes the rsqrt in float32 and rounds once, as
on the GPU.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "deepseek_cpu_kernels"))
from fast_hadamard_transform import hadamard_transform  # noqa: E402
from kernel import fp4_act_quant  # noqa: E402

BF16 = torch.bfloat16
EPS = 1e-6


def values(t):
    return t.float().flatten().tolist()


def test_q_norm_output_is_rounded_once():
    x = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=BF16)
    weight = torch.tensor([1 + 3 * 2 ** -9, 2.0, 0.5, 1 + 2 ** -8], dtype=torch.float32)
    xf = x.float()  # model.py RMSNorm.forward
    y = (weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS))).to(BF16)
    assert values(y) == [1.0078125, -2.0, 0.5, -1.0]


def test_per_head_q_norm_on_bf16():
    q = torch.tensor([[1.0, 1 + 2 ** -7], [3.0, -0.5]], dtype=BF16)
    mean = q.square().mean(-1, keepdim=True) + EPS  # BF16 ops, as model.py
    scale = torch.rsqrt(mean.float()).to(BF16)  # one rounding, as the CUDA kernel
    assert values(q * scale) == [255 / 256, 1.0, 1.390625, -0.232421875]
    # The CPU tail path differs exactly here (see the module docstring).
    assert values(torch.rsqrt(mean[:1])) == [1.0]
    assert values(torch.rsqrt(torch.full((64,), 1.0078125, dtype=BF16))[:1]) == [255 / 256]


def test_indexer_score_sum_on_bf16():
    # [batch, query, heads, entries] as `index_score` before the head sum.
    dots = torch.tensor([[1 + 2 ** -9, 1.0], [-3.0, 2 ** -7], [1 + 2 ** -7, 0.25]])
    dots = dots.reshape(1, 1, 3, 2).to(BF16)
    weights = torch.tensor([1.0, 1.0, 1 + 2 ** -7], dtype=BF16).reshape(1, 1, 3)
    score = (dots.relu() * weights.unsqueeze(-1)).sum(dim=2)
    assert values(score) == [2.015625, 1.2578125]


def test_indexer_hadamard_and_fp4_simulation():
    x = torch.zeros(3, 32)
    x[0, 0] = 1
    x[1, 0] = x[1, 1] = 1
    x[2, 0], x[2, 1] = 3, 1
    y = hadamard_transform(x.to(BF16), scale=32 ** -0.5)  # model.py rotate_activation
    assert set(values(y[0])) == {0.1767578125}
    fp4_act_quant(y, 32, inplace=True)
    assert values(y[0]) == [0.1875] * 32
    assert values(y[1]) == [0.375, 0.0] * 16
    assert values(y[2]) == [0.75, 0.375] * 16
