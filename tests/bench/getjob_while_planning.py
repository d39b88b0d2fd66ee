#!/usr/bin/env python3
"""GetJob latency while a Submit of a 64-shard source is being planned (issue 8).

Starts `quantd serve` (one CPU worker) on a fresh state dir, re-shards a `quantd mkfixture` source
into 64 shards (planning reads every shard header), and per round: `--pollers` threads call GetJob
back to back on an existing job while one client submits the 64-shard job A and, right after, a
second job B (in releases that plan on the scheduler thread, B's Submit waits for A's planning).
The window ends when A has a plan (its stages appear). Prints GetJob p50/p99/max over all rounds,
the Submit latencies of A and B, and the planning time. Figures only; nothing is asserted.

  getjob_while_planning.py --quantd BUILD/server/quantd --work DIR [--pollers 8] [--rounds 5]
"""

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from daemon import Daemon, grpc_stubs  # noqa: E402

SHARDS = 64


def reshard(src, dst, shards):
    """Copies checkpoint `src` to `dst` with its tensors spread over `shards` files."""
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    names = sorted(index["weight_map"])
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(src / shard)))
    weight_map = {}
    per = (len(names) + shards - 1) // shards
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[k * per:(k + 1) * per]}
        save_file(part, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index["weight_map"] = weight_map
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for extra in src.iterdir():
        if not extra.name.endswith(".safetensors") and extra.name != "model.safetensors.index.json":
            shutil.copy(extra, dst / extra.name)


def percentile(sorted_ms, p):
    return sorted_ms[min(len(sorted_ms) - 1, int(p * (len(sorted_ms) - 1) + 0.5))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantd", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--pollers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"src{SHARDS}"
    if not src.exists():
        small = work / "small"
        if not small.exists():
            subprocess.run([args.quantd, "mkfixture", "--preset", "small", str(small)], check=True,
                           stdout=subprocess.DEVNULL)
        reshard(small, src, SHARDS)
    pb, pb_grpc = grpc_stubs(work / "stubs")
    state = work / f"state-{time.monotonic_ns()}"
    latencies, submits, planning = [], [], []
    with Daemon(args.quantd, state) as daemon:
        stub = pb_grpc.QuantServiceStub(daemon.channel())

        def spec(out):
            return pb.JobSpec(source=str(src), output=str(work / out), weight_format="w4a16_nvfp4",
                              recipe="experts")

        first = stub.SubmitJob(pb.SubmitJobRequest(spec=spec("out-probe")))
        stub.CancelJob(pb.CancelJobRequest(id=first.id))
        for r in range(args.rounds):
            stop = threading.Event()
            lat = []
            lock = threading.Lock()

            def poll():
                mine = []
                while not stop.is_set():
                    t = time.perf_counter()
                    stub.GetJob(pb.GetJobRequest(id=first.id))
                    mine.append((time.perf_counter() - t) * 1000)
                with lock:
                    lat.extend(mine)

            threads = [threading.Thread(target=poll) for _ in range(args.pollers)]
            for t in threads:
                t.start()
            t0 = time.perf_counter()
            a = stub.SubmitJob(pb.SubmitJobRequest(spec=spec(f"out-a{r}")))
            t1 = time.perf_counter()
            b = stub.SubmitJob(pb.SubmitJobRequest(spec=spec(f"out-b{r}")))
            t2 = time.perf_counter()
            while not stub.GetJob(pb.GetJobRequest(id=a.id)).stages:
                time.sleep(0.001)
            t3 = time.perf_counter()
            stop.set()
            for t in threads:
                t.join()
            latencies.extend(lat)
            submits.append(((t1 - t0) * 1000, (t2 - t1) * 1000))
            planning.append((t3 - t0) * 1000)
            for job in (a, b):
                stub.CancelJob(pb.CancelJobRequest(id=job.id))
            while any(stub.GetJob(pb.GetJobRequest(id=j.id)).state not in (pb.CANCELLED,)
                      for j in (a, b)):
                time.sleep(0.01)
        daemon.stop()
    latencies.sort()
    print(f"quantd: {args.quantd}")
    print(f"GetJob while planning: {len(latencies)} calls, p50 {percentile(latencies, 0.5):.2f} ms,"
          f" p99 {percentile(latencies, 0.99):.2f} ms, max {latencies[-1]:.2f} ms")
    print("Submit A / Submit B (ms): " + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in submits))
    print("A submitted to planned (ms): " + ", ".join(f"{p:.0f}" for p in planning))


if __name__ == "__main__":
    main()
