"""Slurm placement of remote workers (issue 22 item 4): deploy/slurm/quantd-workers.sbatch parses
(`bash -n`), and run as Slurm would run one array task (its SLURM_* and CUDA_VISIBLE_DEVICES
variables, a stub `quantd` on PATH that records its argv) it builds exactly the expected
`quantd worker` command line, with only flags that `quantd worker --help` lists; it refuses a token
file (or TLS key) that group or others can read, and a job without a coordinator or a GPU, before
starting anything.

With QUANTD_SLURM_ROOT (a directory where Debian's slurmctld, slurmd, slurm-client,
slurm-wlm-basic-plugins, munge, libmunge2, libhwloc15 and liblua5.1-0 packages were unpacked with
`dpkg -x`, nothing installed), a real one-node Slurm runs the script too: munged, slurmctld and
slurmd in the foreground, in a private mount namespace where the unpacked /usr overlays the
machine's (root needed), the node's two "GPUs" gres entries /dev/null and /dev/zero. An array of 2
workers (`--gres=gpu:1` each, quantd run on the CPU behind a wrapper that records what the script
passed) runs a job of a `--devices none` coordinator to SUCCEEDED and both array tasks COMPLETE
through --exit-when-idle. Without QUANTD_SLURM_ROOT, without root, or where Slurm's daemons
cannot start (no overlay mount, munged or the node never idle) that test is skipped, saying why.
scripts/setup.sh unpacks the packages into ~/.cache/quantd/slurm and .ci/run sets
QUANTD_SLURM_ROOT to it.
"""

import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from daemon import Daemon

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


SLURM_CONF = """ClusterName=quantd-test
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
GresTypes=gpu
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:2 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""

# Runs inside `unshare -m`: the unpacked packages overlay /usr in this namespace only; the daemons
# end with the script (trap), whatever happens.
# Exit status 77: Slurm could not start on this machine (no overlay mount, munged or the node
# never idle); the test is skipped then, with the reason on stderr.
DRIVER = """set -euo pipefail
pids=()
trap 'kill "${{pids[@]}}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
cannot() {{ echo "$1" >&2; tail -n 5 {d}/*.log >&2 2>/dev/null || true; exit 77; }}
mount -t overlay overlay -o lowerdir={root}/usr:/usr /usr || cannot "no overlay mount of /usr"
export SLURM_CONF={d}/slurm.conf
munged -F --force --key-file={d}/munge.key --socket={d}/munge.sock --pid-file={d}/munged.pid \\
  --log-file={d}/munged.log --seed-file={d}/munge.seed & pids+=($!)
for _ in $(seq 50); do [[ -S {d}/munge.sock ]] && break; sleep 0.1; done
[[ -S {d}/munge.sock ]] || cannot "munged did not start"
slurmctld -D -i & pids+=($!)
slurmd -D & pids+=($!)
for _ in $(seq 100); do sinfo -h -o %t 2>/dev/null | grep -qx idle && break; sleep 0.2; done
sinfo -h -o %t 2>/dev/null | grep -qx idle || cannot "slurmctld and slurmd did not bring the node up"
QUANTD_BIN={d}/quantd-wrap QUANTD_COORDINATOR={coordinator} QUANTD_TOKEN_FILE={token} \\
  QUANTD_EXIT_WHEN_IDLE=3 sbatch --parsable --array=0-1 --cpus-per-task=1 --gres=gpu:1 \\
  -o {d}/worker-%a.log {script} > {d}/array.id
for _ in $(seq 300); do squeue -h | grep -q . || break; sleep 0.5; done
scontrol -o show job > {d}/jobs.txt
"""

WRAPPER = """#!/bin/bash
# What the sbatch script passed and what Slurm set; then quantd on the CPU (no GPU here).
printf '%s\\n' "$*" "${{CUDA_VISIBLE_DEVICES-unset}}" > {d}/argv-$SLURM_ARRAY_TASK_ID
args=(); prev=""
for a in "$@"; do
  if [[ "$prev" == "--devices" ]]; then args+=(cpu); else args+=("$a"); fi
  prev="$a"
done
exec {quantd} "${{args[@]}}" --cpu-threads 1
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not os.environ.get("QUANTD_SLURM_ROOT"),
                    reason="QUANTD_SLURM_ROOT (Slurm's Debian packages unpacked) is not set")
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="a private mount namespace for the unpacked /usr needs root and unshare")
def test_real_one_node_slurm_runs_a_job_to_succeeded(qd, source, tmp_path):
    root = Path(os.environ["QUANTD_SLURM_ROOT"]).resolve()
    quantctl = Path(qd.binary).parents[1] / "client" / "quantctl"
    assert quantctl.is_file(), f"{quantctl} is missing: build quantctl first"
    for name in ("slurmctld", "slurmd", "slurmstepd"):  # update-alternatives' links
        link = root / "usr" / "sbin" / name
        if not link.exists():
            link.symlink_to(f"{name}-wlm")
    d = Path(tempfile.mkdtemp(prefix="qs"))  # short: the munge socket's path
    try:
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        (d / "munge.key").write_bytes(os.urandom(1024))
        (d / "munge.key").chmod(0o400)
        host = HOST
        (d / "slurm.conf").write_text(SLURM_CONF.format(
            host=host, d=d, cpus=os.cpu_count(), ctld_port=free_port(), slurmd_port=free_port()))
        (d / "gres.conf").write_text(f"NodeName={host} Name=gpu File=/dev/null\n"
                                     f"NodeName={host} Name=gpu File=/dev/zero\n")
        (d / "quantd-wrap").write_text(WRAPPER.format(d=d, quantd=qd.binary))
        (d / "quantd-wrap").chmod(0o755)
        token = tmp_path / "worker.token"
        token.write_text("worker-token-0123456789abcdef\n")
        token.chmod(0o600)
        admin = tmp_path / "admin.token"
        admin.write_text("admin-token-0123456789abcdef\n")
        admin.chmod(0o600)
        (tmp_path / "access.json").write_text(
            f'{{"callers": [{{"token_file": "{token}", "role": "worker"}}]}}')
        with Daemon(qd.binary, tmp_path / "state", "--listen", f"127.0.0.1:{free_port()}",
                    "--token-file", admin, "--access-config", tmp_path / "access.json",
                    devices="none") as coordinator:
            subprocess.run([quantctl, "--server", coordinator.address, "submit",
                            "--source", source["dir"], "--output", tmp_path / "out",
                            "--recipe", "experts", "--weight-format", "w4a16_nvfp4",
                            "--expert-cast", "lossless", "--export-format", "modelopt"],
                           check=True, capture_output=True, timeout=30)
            (d / "driver.sh").write_text(DRIVER.format(
                root=root, d=d, coordinator=coordinator.tcp_address, token=token, script=SCRIPT))
            driver = subprocess.run(["unshare", "-m", "--propagation", "private", "bash",
                                     d / "driver.sh"], capture_output=True, text=True,
                                    timeout=240, cwd=d)
            if driver.returncode == 77:
                pytest.skip(f"Slurm's daemons cannot run here: {driver.stderr.strip()}")
            assert driver.returncode == 0, (driver.stdout, driver.stderr)
            watch = subprocess.run([quantctl, "--server", coordinator.address, "watch", "1"],
                                   capture_output=True, text=True, timeout=60)
            assert watch.returncode == 0, (watch.stdout, watch.stderr)  # SUCCEEDED
            coordinator.stop()
        array = (d / "array.id").read_text().strip()
        jobs = (d / "jobs.txt").read_text().splitlines()
        assert len(jobs) == 2, jobs
        for line in jobs:
            assert "JobState=COMPLETED" in line and "ExitCode=0:0" in line, line
        seen = {}
        for task in (0, 1):
            argv, cuda = (d / f"argv-{task}").read_text().splitlines()
            seen[cuda] = argv
            assert argv == (f"worker --coordinator {coordinator.tcp_address} --token-file {token}"
                            f" --devices cuda:0 --name slurm-{array}_{task}-{host}"
                            " --exit-when-idle 3"), argv
            log = (d / f"worker-{task}.log").read_text()
            assert "idle for 3 s; exiting" in log, log
        # Each array task got one of the node's two GPUs, seen as cuda:0 by the runtime.
        assert sorted(seen) == ["0", "1"]
    finally:
        shutil.rmtree(d, ignore_errors=True)
