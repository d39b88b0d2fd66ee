"""Container (issue 14 §2): no image can be pulled here, so deploy/docker/Dockerfile is checked
as text against scripts/setup.sh (the build stage installs setup.sh's packages less the test-only
ones and configures CMake the same way, with CUDA on), its runtime stage's promises are checked
(CUDA runtime base, non-root user, the state dir as a volume, the ports of its config, the
healthcheck), the config files it and the systemd unit ship are accepted by `quantd serve`, and
the healthcheck script answers 0 against a live daemon and 1 once it stopped.
"""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from daemon import Daemon

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
CONFIG = REPO / "deploy" / "docker" / "serve.json"
HEALTHCHECK = REPO / "deploy" / "docker" / "healthcheck.py"
SETUP = REPO / "scripts" / "setup.sh"
# setup.sh packages that only its test tiers (or benchmarks) use.
TEST_ONLY = {"prometheus", "clang", "libclang-rt-14-dev", "python3", "python3-venv",
             "python3-dev", "time", "procps", "libbenchmark-dev", "systemd"}


def setup_packages():
    text = SETUP.read_text()
    block = re.search(r"^PACKAGES=\((.*?)^\)", text, re.MULTILINE | re.DOTALL).group(1)
    words = []
    for line in block.splitlines():
        words += line.split("#", 1)[0].split()
    return words


def instructions():
    """[(stage name, INSTRUCTION, arguments)] with continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out, stage = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        if op == "FROM":
            stage = args.split()[-1]
        out.append((stage, op, args.strip()))
    return out


def stage_args(stage, op):
    return [a for s, o, a in instructions() if s == stage and o == op]


def test_stages_use_cuda_devel_then_runtime_images():
    froms = [a for _, o, a in instructions() if o == "FROM"]
    assert froms == ["nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build",
                     "nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime"], froms


def test_build_stage_installs_setup_packages_less_test_only():
    installs = " ".join(stage_args("build", "RUN"))
    m = re.search(r"apt-get install -y --no-install-recommends (.*?)&&", installs)
    assert m, installs
    docker = m.group(1).split()
    setup = setup_packages()
    assert TEST_ONLY <= set(setup), sorted(TEST_ONLY - set(setup))
    want = [p for p in setup if p not in TEST_ONLY]
    assert sorted(docker) == sorted(want), (sorted(set(want) - set(docker)),
                                            sorted(set(docker) - set(want)))


def test_build_stage_configures_like_setup_and_builds_the_binaries():
    runs = " ".join(stage_args("build", "RUN"))
    setup_configure = re.search(r"cmake -G Ninja -S \"\$ROOT\" -B \"\$BUILD_DIR\" ([^>]*)>",
                                SETUP.read_text()).group(1).split()
    assert "-DCMAKE_BUILD_TYPE=RelWithDebInfo" in setup_configure
    configure = re.search(r"cmake -G Ninja -S \. -B build (.*?)&&", runs).group(1).split()
    # Setup's flags, plus CUDA required (a devel image has nvcc) and no benchmarks.
    assert sorted(configure) == sorted(setup_configure + ["-DQUANTD_CUDA=ON",
                                                          "-DQUANTD_BENCH=OFF"]), configure
    assert "cmake --build build --target quantd quantctl" in runs
    for target, cmake in (("quantd", "server"), ("quantctl", "client")):
        assert f"add_executable({target} " in (REPO / cmake / "CMakeLists.txt").read_text()
        assert f"build/{cmake}/{target}" in runs


def test_runtime_stage_runs_serve_as_non_root_with_state_volume():
    config = json.loads(CONFIG.read_text())
    user = stage_args("runtime", "USER")
    assert user == ["quantd"], user
    assert "useradd --system --uid 10001" in " ".join(stage_args("runtime", "RUN"))
    volumes = [json.loads(v) for v in stage_args("runtime", "VOLUME")]
    assert volumes == [[config["state_dir"]]], volumes
    ports = {a.rsplit(":", 1)[1] for a in config["listen"] + [config["metrics_listen"]]}
    assert set(" ".join(stage_args("runtime", "EXPOSE")).split()) == ports
    entry = json.loads(stage_args("runtime", "ENTRYPOINT")[0])
    assert entry == ["quantd", "serve", "--config", "/etc/quantd/serve.json"], entry
    health = stage_args("runtime", "HEALTHCHECK")[0]
    assert health.startswith("--interval=") and "CMD" in health, health
    command = json.loads(health.split("CMD", 1)[1])
    assert command == ["python3", "/opt/quantd/bin/quantd-healthcheck", config["listen"][0]
                       .replace("0.0.0.0", "127.0.0.1")], command
    # Every file the image copies from the build context exists.
    for args in stage_args("runtime", "COPY") + stage_args("build", "COPY"):
        if args.startswith("--from="):
            continue
        src = shlex.split(args)[0]
        assert (REPO / src).exists(), src


def with_test_token(config, tmp_path):
    """A copy of `config` whose token_file (the secret a deployment mounts) is a test token."""
    settings = json.loads(config.read_text())
    if "token_file" not in settings:
        return config
    token = tmp_path / "token"
    token.write_text("test-token-0123456789abcdef\n")
    token.chmod(0o600)
    settings["token_file"] = str(token)
    copy = tmp_path / f"{config.parent.name}-serve.json"
    copy.write_text(json.dumps(settings))
    return copy


def test_shipped_configs_are_accepted_by_serve(qd, tmp_path):
    """deploy/docker/serve.json and deploy/systemd/serve.json parse; the harness's flags override
    their addresses and state dir, so the daemon starts here."""
    for config in (CONFIG, REPO / "deploy" / "systemd" / "serve.json"):
        state = tmp_path / config.parent.name / "state"
        with Daemon(qd.binary, state, "--config", with_test_token(config, tmp_path)) as daemon:
            daemon.stop()


def test_healthcheck_reports_serving_then_down(qd, tmp_path):
    daemon = Daemon(qd.binary, tmp_path / "state")
    with daemon:
        up = subprocess.run([sys.executable, str(HEALTHCHECK), daemon.address],
                            capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, (up.stdout, up.stderr)
        address = daemon.address
        daemon.stop()
    down = subprocess.run([sys.executable, str(HEALTHCHECK), address], capture_output=True,
                          text=True, timeout=60)
    assert down.returncode == 1, (down.stdout, down.stderr)
    assert "UNAVAILABLE" in down.stderr, down.stderr
