"""Bad input reaching quantd's kernels and readers through quantd_interop_tool: exit status 1, one
message naming the file or tensor (and the element, for bad values), and no output file."""

import pytest
import torch
from safetensors.torch import save_file


def write(tmp_path, tensors, name="in.safetensors"):
    path = tmp_path / name
    save_file(tensors, str(path))
    return path


def fails(qd, tmp_path, *args):
    out = tmp_path / "out.safetensors"
    err = qd.tool_fails(*args, out)
    assert not out.exists(), "a failed run must not leave an output file"
    assert not (tmp_path / "out.safetensors.tmp").exists()
    return err


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nvfp4_non_finite_input(qd, tmp_path, bad):
    w = torch.ones(4, 32, dtype=torch.bfloat16)
    w[2, 17] = bad
    src = write(tmp_path, {"ok": torch.ones(2, 16), "layer.w": w})
    err = fails(qd, tmp_path, "nvfp4", src)
    assert "layer.w" in err and "[2, 17]" in err, err


def test_nvfp4_columns_not_multiple_of_16(qd, tmp_path):
    src = write(tmp_path, {"narrow": torch.ones(4, 24, dtype=torch.bfloat16)})
    err = fails(qd, tmp_path, "nvfp4", src)
    assert "narrow" in err and "16" in err, err


@pytest.mark.parametrize("group, needle", [
    ("a,missing", "missing"),
    ("a,vec", "vec"),
    ("a,b,a", "a"),
])
def test_nvfp4_bad_group(qd, tmp_path, group, needle):
    src = write(tmp_path, {"a": torch.ones(2, 16), "b": torch.ones(2, 16), "vec": torch.ones(16)})
    err = qd.tool_fails("nvfp4", src, tmp_path / "out.safetensors", "--group", group)
    assert needle in err and "--group" in err, err


def fp8_file(tmp_path, weight_bytes, scale, scale_name="m.scale"):
    return write(tmp_path, {"m.weight": weight_bytes.view(torch.float8_e4m3fn), scale_name: scale})


def test_decode_fp8_without_scale(qd, tmp_path):
    src = write(tmp_path, {"m.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)})
    err = fails(qd, tmp_path, "decode", src)
    assert "m.weight" in err and "scale" in err, err


def test_decode_fp8_scale_shape(qd, tmp_path):
    weight = torch.zeros(200, 300, dtype=torch.uint8)
    scale = torch.ones(2, 2, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # needs [2, 3]
    err = fails(qd, tmp_path, "decode", fp8_file(tmp_path, weight, scale))
    assert "m.scale" in err and "[2, 3]" in err, err


def test_decode_nan_codes(qd, tmp_path):
    weight = torch.zeros(130, 140, dtype=torch.uint8)
    weight[129, 131] = 0x7F  # E4M3 NaN
    scale = torch.full((2, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    err = fails(qd, tmp_path, "decode", fp8_file(tmp_path, weight, scale))
    assert "m.weight" in err and "[129, 131]" in err, err

    weight[129, 131] = 0
    bad_scale = torch.full((2, 2), 127, dtype=torch.uint8)
    bad_scale[1, 0] = 0xFF  # E8M0 NaN: covers rows 128.., columns 0..127
    err = fails(qd, tmp_path, "decode",
                fp8_file(tmp_path, weight, bad_scale.view(torch.float8_e8m0fnu)))
    assert "m.weight" in err and "[128, 0]" in err, err


def test_decode_v3_non_positive_scale(qd, tmp_path):
    weight = torch.zeros(4, 4, dtype=torch.uint8)
    err = fails(qd, tmp_path, "decode", fp8_file(tmp_path, weight, torch.zeros(1, 1),
                                                 scale_name="m.weight_scale_inv"))
    assert "m.weight" in err and "[0, 0]" in err, err


def test_mxfp4_nan_scale(qd, tmp_path):
    scale = torch.full((2, 2), 120, dtype=torch.uint8)
    scale[1, 1] = 0xFF
    src = write(tmp_path, {"e.weight": torch.zeros(2, 32, dtype=torch.int8),
                           "e.scale": scale.view(torch.float8_e8m0fnu)})
    for command in ("decode", "mxfp4-to-nvfp4"):
        err = fails(qd, tmp_path, command, src)
        assert "e.weight" in err and "[1, 32]" in err, (command, err)


def test_mxfp4_to_nvfp4_without_mxfp4(qd, tmp_path):
    src = write(tmp_path, {"x": torch.ones(2, 16)})
    err = fails(qd, tmp_path, "mxfp4-to-nvfp4", src)
    assert "no MXFP4 weight" in err, err


def test_missing_input(qd, tmp_path):
    err = fails(qd, tmp_path, "nvfp4", tmp_path / "nowhere.safetensors")
    assert "nowhere.safetensors" in err, err
