"""Shared fixtures for the interop tier: quantd's binaries, fixture checkpoints, and quantd's NVFP4
output for the test tensors at every SIMD level this CPU runs.

The build directory comes from $QUANTD_BUILD_DIR (default <repo>/build). A missing binary is an
error, never a skip: this tier exists to prove interoperability, so it must not pass vacuously.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import save_file

from interop_helpers import (
    NVFP4_GROUPS,
    check_written_by_quantd,
    library_tensors,
    nvfp4_cases,
    nvfp4_group_cases,
)

REPO = Path(__file__).resolve().parents[2]


class Quantd:
    """Runs the quantd binary and quantd_interop_tool."""

    def __init__(self, quantd, tool, v4_forward_tool):
        self.quantd = str(quantd)
        self.tool_path = str(tool)
        self.v4_forward_tool = str(v4_forward_tool)

    @staticmethod
    def _run(cmd):
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)

    def _run_ok(self, cmd):
        proc = self._run(cmd)
        if proc.returncode != 0:
            pytest.fail(
                f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc.stdout

    def mkfixture(self, arch, out_dir, preset="tiny", seed=1):
        self._run_ok([self.quantd, "mkfixture", "--arch", arch, "--preset", preset,
                      "--seed", seed, out_dir])
        return Path(out_dir)

    def inspect_json(self, checkpoint_dir):
        return json.loads(self._run_ok([self.quantd, "inspect", "--json", checkpoint_dir]))

    def tool(self, *args):
        """Runs quantd_interop_tool, which must succeed; returns its stdout."""
        return self._run_ok([self.tool_path, *args])

    def tool_fails(self, *args):
        """Runs quantd_interop_tool, which must exit 1 with an error message; returns stderr."""
        proc = self._run([self.tool_path, *args])
        assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("quantd_interop_tool: "), proc.stderr
        return proc.stderr

    def v4_forward(self, *args):
        """Runs quantd_v4_forward_tool (the DeepSeek-V4 forward), which must succeed."""
        return self._run_ok([self.v4_forward_tool, *args])

    def simd_levels(self):
        return self.tool("simd-levels").split()

    def load_output(self, path):
        """A file quantd wrote, read by the safetensors library (bytes checked against the
        header) and checked for the writer's alignment rule."""
        check_written_by_quantd(path)
        tensors, _ = library_tensors(path)
        return tensors


@pytest.fixture(scope="session")
def qd():
    build = Path(os.environ.get("QUANTD_BUILD_DIR", REPO / "build"))
    quantd = build / "server" / "quantd"
    tool = build / "tests" / "interop" / "quantd_interop_tool"
    v4_forward_tool = build / "tests" / "interop" / "quantd_v4_forward_tool"
    missing = [str(p) for p in (quantd, tool, v4_forward_tool) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(
            f"the interop tests need quantd's binaries; missing: {', '.join(missing)} "
            "(build with scripts/setup.sh, or point QUANTD_BUILD_DIR at a build directory)",
            pytrace=False,
        )
    return Quantd(quantd, tool, v4_forward_tool)


@pytest.fixture(scope="session")
def v4_fixture(qd, tmp_path_factory):
    return qd.mkfixture("deepseek-v4", tmp_path_factory.mktemp("v4") / "ckpt")


@pytest.fixture(scope="session")
def v3_fixture(qd, tmp_path_factory):
    return qd.mkfixture("deepseek-v3", tmp_path_factory.mktemp("v3") / "ckpt")


@pytest.fixture(scope="session")
def simd_levels(qd):
    levels = qd.simd_levels()
    assert levels and levels[0] == "scalar", levels
    return levels


@pytest.fixture(scope="session")
def nvfp4_inputs():
    """The NVFP4 test tensors: (single tensors, fused-group tensors)."""
    return nvfp4_cases(), nvfp4_group_cases()


@pytest.fixture(scope="session")
def quantd_nvfp4(qd, simd_levels, nvfp4_inputs, tmp_path_factory):
    """{simd level: {output name: tensor}}: quantd's NVFP4 output for every test tensor, with the
    fused groups of NVFP4_GROUPS sharing their global amax."""
    cases, group_cases = nvfp4_inputs
    tmp = tmp_path_factory.mktemp("nvfp4")
    src = tmp / "in.safetensors"
    save_file({**cases, **group_cases}, str(src))
    groups = []
    for group in NVFP4_GROUPS:
        groups += ["--group", ",".join(group)]
    outputs = {}
    for level in simd_levels:
        out = tmp / f"out-{level}.safetensors"
        qd.tool("--simd", level, "nvfp4", src, out, *groups)
        outputs[level] = qd.load_output(out)
    return outputs
