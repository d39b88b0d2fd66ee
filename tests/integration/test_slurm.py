"""Slurm placement of remote workers (issue 22 item 4): deploy/slurm/quantd-workers.sbatch parses
(`bash -n`), and run as Slurm would run one array task (its SLURM_* and CUDA_VISIBLE_DEVICES
variables, a stub `quantd` on PATH that records its argv) it builds exactly the expected
`quantd worker` command line, with only flags that `quantd worker --help` lists; it refuses a token
file (or TLS key) that group or others can read, and a job without a coordinator or a GPU, before
starting anything. No Slurm daemon runs here: sbatch's own part (allocation, array indices, gres)
is Slurm's and is not exercised.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "slurm" / "quantd-workers.sbatch"
HOST = subprocess.run(["hostname", "-s"], capture_output=True, text=True,
                      check=True).stdout.strip()

STUB = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_ARGV"
printf '%s' "${CUDA_VISIBLE_DEVICES-<unset>}" > "$STUB_CUDA"
"""


@pytest.fixture
def sandbox(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "quantd"
    stub.write_text(STUB)
    stub.chmod(0o755)
    token = tmp_path / "worker.token"
    token.write_text("worker-token-0123456789abcdef\n")
    token.chmod(0o600)
    return tmp_path


def run_task(sandbox, env, *args):
    """Runs the script as one array task; returns (process, argv or None, CUDA_VISIBLE_DEVICES)."""
    argv_file, cuda_file = sandbox / "argv", sandbox / "cuda"
    for f in (argv_file, cuda_file):
        f.unlink(missing_ok=True)
    full_env = {"PATH": f"{sandbox / 'bin'}:/usr/bin:/bin", "HOME": str(sandbox),
                "STUB_ARGV": str(argv_file), "STUB_CUDA": str(cuda_file), **env}
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=full_env, timeout=30)
    argv = argv_file.read_bytes().split(b"\0")[:-1] if argv_file.exists() else None
    cuda = cuda_file.read_text() if cuda_file.exists() else None
    return proc, [a.decode() for a in argv] if argv is not None else None, cuda


ARRAY_TASK = {"SLURM_JOB_ID": "4245", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "3",
              "SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "2,3",
              "QUANTD_COORDINATOR": "10.0.0.1:7400"}


def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text
    assert re.search(r"^#SBATCH --gres=gpu:\d+$", text, re.M)
    assert re.search(r"^#SBATCH --array=\d+-\d+$", text, re.M)


def test_array_task_command_line(sandbox):
    proc, argv, cuda = run_task(sandbox, {**ARRAY_TASK,
                                          "QUANTD_TOKEN_FILE": str(sandbox / "worker.token")})
    assert proc.returncode == 0, proc.stderr
    assert argv == ["worker", "--coordinator", "10.0.0.1:7400",
                    "--token-file", str(sandbox / "worker.token"),
                    "--devices", "cuda:0,cuda:1",
                    "--name", f"slurm-4242_3-{HOST}",
                    "--exit-when-idle", "600"]
    # Slurm's numbering is left to the CUDA runtime: the physical GPUs stay the visible ones.
    assert cuda == "2,3"


def test_defaults_arguments_and_overrides(sandbox):
    """The default token file under $HOME, the coordinator from argument 1, SLURM_JOB_GPUS
    alone (exported as CUDA_VISIBLE_DEVICES), a plain job's name, the idle time from the env."""
    (sandbox / ".config" / "quantd").mkdir(parents=True)
    token = sandbox / ".config" / "quantd" / "worker.token"
    (sandbox / "worker.token").rename(token)
    token.chmod(0o400)
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "5,6,7",
           "QUANTD_COORDINATOR": "ignored:1", "QUANTD_EXIT_WHEN_IDLE": "30"}
    proc, argv, cuda = run_task(sandbox, env, "unix:/run/quantd/quantd.sock")
    assert proc.returncode == 0, proc.stderr
    assert argv == ["worker", "--coordinator", "unix:/run/quantd/quantd.sock",
                    "--token-file", str(token), "--devices", "cuda:0,cuda:1,cuda:2",
                    "--name", f"slurm-77-{HOST}", "--exit-when-idle", "30"]
    assert cuda == "5,6,7"


def test_tls_client_certificate(sandbox):
    key = sandbox / "worker.key"
    key.write_text("key\n")
    key.chmod(0o600)
    env = {**ARRAY_TASK, "CUDA_VISIBLE_DEVICES": "GPU-0d1c,GPU-77aa",
           "QUANTD_TLS_CA": "/etc/quantd/ca.pem", "QUANTD_TLS_CERT": "/etc/quantd/worker.pem",
           "QUANTD_TLS_KEY": str(key), "QUANTD_DEVICES": "cuda:1"}
    proc, argv, _ = run_task(sandbox, env)
    assert proc.returncode == 0, proc.stderr
    assert argv == ["worker", "--coordinator", "10.0.0.1:7400",
                    "--tls-cert", "/etc/quantd/worker.pem", "--tls-key", str(key),
                    "--tls-ca", "/etc/quantd/ca.pem",
                    "--devices", "cuda:1", "--name", f"slurm-4242_3-{HOST}",
                    "--exit-when-idle", "600"]
    key.chmod(0o640)
    proc, argv, _ = run_task(sandbox, env)
    assert proc.returncode == 2 and argv is None
    assert f"TLS key {key} has mode 0640" in proc.stderr, proc.stderr


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_refuses_a_token_others_can_reach(sandbox, mode):
    token = sandbox / "worker.token"
    token.chmod(mode)
    proc, argv, _ = run_task(sandbox, {**ARRAY_TASK, "QUANTD_TOKEN_FILE": str(token)})
    assert proc.returncode == 2 and argv is None, (proc.returncode, argv)
    assert proc.stderr == (f"quantd-workers.sbatch: token file {token} has mode {mode:04o}: group "
                           f"or others can read or write it; run chmod 600 {token}\n")


def test_refuses_a_missing_or_linked_token(sandbox):
    link = sandbox / "link.token"
    link.symlink_to(sandbox / "worker.token")
    for path, why in ((sandbox / "absent.token", "does not exist"),
                      (link, "is not a regular file")):
        proc, argv, _ = run_task(sandbox, {**ARRAY_TASK, "QUANTD_TOKEN_FILE": str(path)})
        assert proc.returncode == 2 and argv is None
        assert proc.stderr == f"quantd-workers.sbatch: token file {path} {why}\n"


def test_refuses_no_coordinator_or_no_gpu(sandbox):
    token = {"QUANTD_TOKEN_FILE": str(sandbox / "worker.token")}
    no_coordinator = {k: v for k, v in ARRAY_TASK.items() if k != "QUANTD_COORDINATOR"}
    proc, argv, _ = run_task(sandbox, {**no_coordinator, **token})
    assert proc.returncode == 2 and argv is None
    assert "no coordinator" in proc.stderr
    no_gpu = {k: v for k, v in ARRAY_TASK.items()
              if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS")}
    proc, argv, _ = run_task(sandbox, {**no_gpu, **token})
    assert proc.returncode == 2 and argv is None
    assert "--gres=gpu:N" in proc.stderr
    # A CPU-only worker, said explicitly.
    proc, argv, _ = run_task(sandbox, {**no_gpu, **token, "QUANTD_DEVICES": "cpu"})
    assert proc.returncode == 0 and argv[argv.index("--devices") + 1] == "cpu"


def worker_flags(qd):
    """The long options `quantd worker --help` lists."""
    help_text = qd.run_ok("worker", "--help").stdout
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", help_text))


def test_flags_exist(qd, sandbox):
    """Every flag the script passes, with a token and with a client certificate, is one that
    `quantd worker --help` lists."""
    key = sandbox / "worker.key"
    key.write_text("key\n")
    key.chmod(0o600)
    used = set()
    for env in ({"QUANTD_TOKEN_FILE": str(sandbox / "worker.token")},
                {"QUANTD_TLS_CA": "ca.pem", "QUANTD_TLS_CERT": "c.pem",
                 "QUANTD_TLS_KEY": str(key)}):
        proc, argv, _ = run_task(sandbox, {**ARRAY_TASK, **env})
        assert proc.returncode == 0, proc.stderr
        used |= {a for a in argv if a.startswith("--")}
    assert used == {"--coordinator", "--token-file", "--tls-cert", "--tls-key", "--tls-ca",
                    "--devices", "--name", "--exit-when-idle"}
    assert used <= worker_flags(qd), used - worker_flags(qd)
