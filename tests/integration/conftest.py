"""Integration tier: the real `quantd run` binary on generated checkpoints.

The binary is $QUANTD_BIN, else $QUANTD_BUILD_DIR/server/quantd (default <repo>/build). A missing
binary is an error, never a skip.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from daemon import grpc_stubs

REPO = Path(__file__).resolve().parents[2]


class Quantd:
    def __init__(self, binary):
        self.binary = str(binary)

    def cmd(self, *args):
        return [self.binary, *[str(a) for a in args]]

    def run(self, *args, env_extra=None, timeout=300, cwd=None):
        env = dict(os.environ)
        env.pop("QUANTD_TEST_KILL_AT", None)
        env.update(env_extra or {})
        return subprocess.run(self.cmd(*args), capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd)

    def run_ok(self, *args, **kw):
        proc = self.run(*args, **kw)
        assert proc.returncode == 0, (proc.args, proc.returncode, proc.stdout, proc.stderr)
        return proc


@pytest.fixture(scope="session")
def qd():
    if "QUANTD_BIN" in os.environ:
        binary = Path(os.environ["QUANTD_BIN"])
    else:
        binary = Path(os.environ.get("QUANTD_BUILD_DIR", REPO / "build")) / "server" / "quantd"
    assert binary.is_file(), f"{binary} is missing: build quantd first (scripts/setup.sh)"
    return Quantd(binary)


@pytest.fixture(scope="session")
def source(qd, tmp_path_factory):
    """The tiny DeepSeek-V4 fixture (4 shards) and an amax file for its routed experts."""
    root = tmp_path_factory.mktemp("source")
    src = root / "tiny-v4"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "tiny", "--seed", 5, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    experts = sorted({name[: -len(".weight")] for name in index["weight_map"]
                      if re.fullmatch(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight", name)})
    assert experts
    # Exact binary fractions, distinct per module.
    amax = {m: 0.5 + i / 32 for i, m in enumerate(experts)}
    (root / "amax.json").write_text(json.dumps(amax))
    return {"dir": src, "amax": root / "amax.json",
            "shards": len(set(index["weight_map"].values()))}


@pytest.fixture(scope="session")
def stubs(tmp_path_factory):
    """The Python gRPC modules of our proto (daemon.grpc_stubs), generated once per session."""
    return grpc_stubs(tmp_path_factory.mktemp("stubs"))


@pytest.fixture
def model(source, tmp_path):
    """A private copy of the tiny fixture (tests may put things next to or inside it)."""
    dst = tmp_path / "model"
    shutil.copytree(source["dir"], dst)
    return dst
