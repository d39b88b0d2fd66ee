"""The metrics endpoint of a CUDA build of `quantd serve` (issue 11: cuBLAS on the CUDA device).

Linking cuBLAS put libcublasLt's 92 KiB of thread-local storage into the static TLS block that
glibc carves out of every thread's stack, and civetweb (the metrics server) starts its threads
with 100 KiB stacks, so the exposer failed to start. cuBLAS is now loaded with dlopen when a CUDA
device opens (kernels/cuda/cublas_gemm.cc). Without a GPU this test checks that quantd does not
link cuBLAS and that its metrics endpoint answers a scrape; with one, the daemon also opens
cuda:0 (loading cuBLAS into the process) and the endpoint still answers.
"""

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def cuda_device_present():
    """True when nvidia-smi lists a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU " in out.stdout


def needed_libraries(binary):
    out = subprocess.run(["readelf", "-dW", str(binary)], capture_output=True, text=True,
                         timeout=60, check=True)
    return [line.split("[", 1)[1].rstrip("]") for line in out.stdout.splitlines()
            if "(NEEDED)" in line]


def serve_and_scrape(qd, tmp_path, devices):
    """Starts `quantd serve --devices <devices>` with metrics on port 0, scrapes /metrics once,
    stops it; returns (exposition, the process's mapped file names at scrape time)."""
    state = tmp_path / f"state-{devices.replace(':', '')}"
    log = tmp_path / f"quantd-{devices.replace(':', '')}.log"
    env = dict(os.environ)
    env.pop("QUANTD_TEST_KILL_AT", None)
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            qd.cmd("serve", "--state-dir", state, "--metrics-listen", "127.0.0.1:0",
                   "--devices", devices),
            stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        serve_json = state / "serve.json"
        deadline = time.monotonic() + 60
        while not serve_json.is_file():
            assert proc.poll() is None, f"quantd exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no serve.json after 60 s:\n{log.read_text()}"
            time.sleep(0.2)
        info = json.loads(serve_json.read_text())
        url = f"http://{info['metrics_listen']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            body = response.read().decode()
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0, f"quantd exited {rc} after SIGTERM:\n{log.read_text()}"
    return body, maps


def test_cuda_build_serves_metrics_without_linking_cublas(qd, tmp_path):
    needed = needed_libraries(qd.binary)
    if not [lib for lib in needed if lib.startswith("libcudart")]:
        pytest.skip("quantd was built without CUDA")
    assert not [lib for lib in needed if lib.startswith("libcublas")], needed
    body, _ = serve_and_scrape(qd, tmp_path, "cpu")
    assert "quantd_queue_depth 0" in body


def test_serve_with_a_cuda_device_loads_cublas_and_still_serves_metrics(qd, tmp_path):
    if not cuda_device_present():
        pytest.skip("no CUDA device")
    body, maps = serve_and_scrape(qd, tmp_path, "cuda:0")
    assert "libcublasLt.so" in maps, "cuda:0 opened without loading cuBLAS"
    assert "quantd_queue_depth 0" in body
