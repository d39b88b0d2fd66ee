"""quantd's NVFP4 activation fake-quantization (kernels/nvfp4_fake_quant.h) against ModelOpt.

ModelOpt's own NVFP4 activation fake-quant (`TensorQuantizer` with dynamic 16-blocks: the Triton
kernel `fp4_fake_quant_block` or the `cuda_ext_mx` extension) runs only on a GPU, and Triton's
CPU interpreter truncates its FP8 casts instead of rounding them, so it cannot serve as an oracle
here. The oracle is ModelOpt's NVFP4 quantizer, which runs on CPU tensors:
`NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=input_scale)` then `.dequantize`. It
computes the same per-block formula as the fake-quant kernel (block scale = fp8_e4m3(block_amax /
(6 * input_scale)) saturated at 448, value = e2m1(x / (S * input_scale)) * (S * input_scale), the
product S * input_scale formed once) except for blocks whose scale is tiny:
  - block_amax / (6 * input_scale) <= 2^-10: the quantizer clamps the scale to 2^-9 (a weight
    rule, ModelOpt >= 0.45); the fake-quant kernel and the runtimes' kernels round it to E4M3 0
    and zero the block. quantd zeroes it;
  - S * input_scale < 1e-5: the fake-quant kernel substitutes 1.0 (zeroing the block); the
    runtimes keep the scale, and so does quantd.
So every block outside those two sets must match exactly (bit for bit), and the blocks in the
first set must be zeros in quantd's output; the test asserts both and that each case has blocks
of the kind it was built for.
"""

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

E4M3_TINY = 2.0 ** -10


@pytest.fixture(scope="module")
def nvfp4_qtensor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    assert modelopt.__version__.startswith("0.47"), modelopt.__version__
    return NVFP4QTensor


def modelopt_fake_quant(qtensor, x, input_scale):
    scale_2 = torch.tensor(input_scale, dtype=torch.float32)
    q, scale, scale_2 = qtensor.quantize(x, 16, weights_scaling_factor_2=scale_2)
    return q.dequantize(torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})


def cases():
    g = torch.Generator().manual_seed(13)
    bf16 = lambda t: t.to(torch.bfloat16).float()  # activations of the official forward are BF16
    normal = bf16(torch.randn(96, 256, generator=g))
    outliers = normal.clone()
    outliers[::7, ::33] *= 40.0  # a few large entries per row, as in real activations
    mixed = bf16(torch.randn(64, 512, generator=g) * torch.logspace(-4, 2, 64).unsqueeze(1))
    amax = lambda t: float(t.abs().max())
    return {
        # input_scale from the tensor's own amax: every block scale <= 448.
        "normal_own_amax": (normal, amax(normal) / 2688.0),
        "outliers_own_amax": (outliers, amax(outliers) / 2688.0),
        # calibrated on a smaller amax than the tensor has: the largest blocks saturate at 448.
        "outliers_saturating": (outliers, amax(normal) / 2688.0 / 4.0),
        # constant input_scale 1.0 (calibration.mode constant) on rows from 1e-4 to 100: the small
        # rows' scales underflow to E4M3 0.
        "mixed_constant": (mixed, 1.0),
        "mixed_own_amax": (mixed, amax(mixed) / 2688.0),
    }


@pytest.fixture(scope="module")
def fake_quantized(qd, tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4_act")
    tensors = {}
    for name, (x, input_scale) in cases().items():
        tensors[name] = x.clone()
        tensors[name + ".input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    save_file(tensors, str(root / "in.safetensors"))
    qd.tool("nvfp4-act", root / "in.safetensors", root / "out.safetensors")
    return load_file(str(root / "out.safetensors"))


@pytest.mark.parametrize("name", list(cases()))
def test_equals_modelopt_nvfp4_on_every_block_with_a_representable_scale(
        nvfp4_qtensor, fake_quantized, name):
    x, input_scale = cases()[name]
    ours = fake_quantized[name]
    ref = modelopt_fake_quant(nvfp4_qtensor, x, input_scale)
    scale_2 = torch.tensor(input_scale, dtype=torch.float32)
    block_amax = x.view(x.shape[0], -1, 16).abs().amax(-1)
    s = block_amax / (6.0 * scale_2)
    stored = torch.clamp(s, max=448.0).to(torch.float8_e4m3fn).float() * scale_2
    underflow = s <= E4M3_TINY                   # E4M3 0: quantd (and the runtimes) zero the block
    kernel_floor = (stored < 1e-5) & ~underflow  # ModelOpt's fake-quant kernel would use 1.0 here
    exact = ~underflow & ~kernel_floor

    ours_b, ref_b = ours.view(x.shape[0], -1, 16), ref.view(x.shape[0], -1, 16)
    mismatch = (ours_b != ref_b).any(-1) & exact
    assert not mismatch.any(), (
        f"{name}: {int(mismatch.sum())} of {int(exact.sum())} blocks differ; first "
        f"{mismatch.nonzero()[0].tolist()}")
    assert (ours_b[underflow] == 0).all(), name
    assert int(exact.sum()) > 0
    if name == "mixed_constant":
        assert int(underflow.sum()) > 0, "the case must contain blocks whose scale underflows"
    if name == "outliers_saturating":
        assert int((s > 448).sum()) > 0, "the case must contain saturated blocks"
