#!/usr/bin/env python3
"""What hostile clients of the metrics endpoint cost a live `quantd serve` (issue 19 item 6): one
line per phase with the daemon's RSS, open descriptors and threads, the time of one scrape by a
prompt client (or how it failed) and of one `quantctl list` on the unix socket, both taken while
the phase's connections are still open.

  baseline          nothing else connected
  slowloris N       N connections that send a request header a byte every 0.5 s (each one the
                    daemon closes is opened again), sampled every 5 s for 20 s
  huge header       one request header of 200 MiB sent as fast as the daemon takes it
  huge body         GET announcing a 100 GB body, 500 MiB of it sent
  idle M            M connections that send nothing
  flood P           P complete scrapes at once (the seconds they take in all)

  QUANTD_BIN=path        the quantd binary (default: $QUANTD_BUILD_DIR/server/quantd)
  QUANTCTL=path          quantctl (default: next to it, ../client/quantctl)
  SLOW_N=300 IDLE_N=3000 FLOOD_N=500
"""

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUANTD = Path(os.environ.get("QUANTD_BIN") or
              Path(os.environ.get("QUANTD_BUILD_DIR", REPO / "build")) / "server" / "quantd")
QUANTCTL = Path(os.environ.get("QUANTCTL") or QUANTD.parents[1] / "client" / "quantctl")
SLOW_N, IDLE_N, FLOOD_N = (int(os.environ.get(k, d)) for k, d in
                           (("SLOW_N", 300), ("IDLE_N", 3000), ("FLOOD_N", 500)))


def main():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root = Path(tempfile.mkdtemp(prefix="qd-metrics-abuse-"))
    socket_path = root / "quantd.sock"
    proc = subprocess.Popen([str(QUANTD), "serve", "--state-dir", str(root / "state"), "--socket",
                             str(socket_path), "--listen", "none", "--metrics-listen",
                             "127.0.0.1:0", "--devices", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        serve = root / "state" / "serve.json"
        while not serve.exists():
            assert proc.poll() is None, "quantd serve exited"
            time.sleep(0.1)
        info = json.loads(serve.read_text())
        run(proc.pid, info["metrics_listen"], socket_path)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def run(pid, metrics, socket_path):
    host, port = metrics.rsplit(":", 1)
    port = int(port)

    def scrape():
        start = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
                r.read()
            return f"{time.monotonic() - start:7.3f} s"
        except OSError as e:
            return f"failed after {time.monotonic() - start:.1f} s ({type(e).__name__})"

    def status(phase):
        rss = next(int(l.split()[1]) // 1024 for l in open(f"/proc/{pid}/status")
                   if l.startswith("VmRSS:"))
        start = time.monotonic()
        listed = subprocess.run([str(QUANTCTL), "--server", f"unix:{socket_path}", "--timeout",
                                 "10", "list"], capture_output=True).returncode
        grpc = f"{time.monotonic() - start:.2f} s" if listed == 0 else f"exit {listed}"
        print(f"{phase:28} rss {rss:4d} MiB  fds {len(os.listdir(f'/proc/{pid}/fd')):5d}  "
              f"threads {len(os.listdir(f'/proc/{pid}/task')):3d}  scrape {scrape():28} "
              f"quantctl list {grpc}", flush=True)

    def connect(head=b""):
        s = socket.create_connection((host, port), timeout=5)
        if head:
            s.sendall(head)
        return s

    status("baseline")
    slow_head = b"GET /metrics HTTP/1.1\r\nX-Slow: "
    slow = [connect(slow_head) for _ in range(SLOW_N)]
    stop = threading.Event()

    def drip():
        while not stop.is_set():
            for i, s in enumerate(slow):
                try:
                    s.send(b"a")
                except OSError:  # closed by the daemon: the attacker opens another
                    s.close()
                    try:
                        slow[i] = connect(slow_head)
                    except OSError:
                        pass
            time.sleep(0.5)

    dripping = threading.Thread(target=drip)
    dripping.start()
    for t in range(5, 25, 5):
        time.sleep(5)
        status(f"slowloris {SLOW_N} at {t} s")
    stop.set()
    dripping.join()
    for s in slow:
        s.close()

    for phase, head, mib in (("huge header", b"GET /metrics HTTP/1.1\r\nX-Big: ", 200),
                             ("huge body",
                              b"GET /metrics HTTP/1.1\r\nContent-Length: 100000000000\r\n\r\n",
                              500)):
        sent = 0
        with connect(head) as s:
            try:
                for _ in range(mib):
                    s.sendall(b"a" * (1 << 20))
                    sent += 1
            except OSError:
                pass
        status(f"{phase}: {sent} of {mib} MiB taken")

    idle = []
    for _ in range(IDLE_N):
        try:
            idle.append(connect())
        except OSError:
            break
    status(f"idle {len(idle)} of {IDLE_N}")
    for s in idle:
        s.close()

    start = time.monotonic()
    threads = [threading.Thread(target=scrape) for _ in range(FLOOD_N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status(f"flood {FLOOD_N}: {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
