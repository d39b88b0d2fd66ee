#!/usr/bin/env bash
# Runs the kernel benchmarks (tests/bench/kernels_bench.cc) and prints one line per operation,
# backend and thread count: throughput in GB/s of bytes read + written, and its ratio to memcpy
# moving as many bytes on as many threads in the same run; both per wall-clock second and per
# CPU-second of the process (the latter is what a run gets done per core it actually had, which
# matters on a machine where other work competes for the cores).
#
# Every benchmark runs several times in random order, and the table shows each one's best run:
# on a shared machine other load only ever slows a run down, and interleaving exposes the
# operations and memcpy to the same conditions.
#
# Usage: tests/bench/run_kernels_bench.sh [BENCH_BINARY] [--benchmark_* flags]
#   BENCH_BINARY defaults to build/tests/bench/quantd_kernels_bench.
set -euo pipefail

bench="build/tests/bench/quantd_kernels_bench"
if [[ $# -gt 0 && "$1" != --* ]]; then
  bench="$1"
  shift
fi
json="$(mktemp)"
trap 'rm -f "$json"' EXIT
"$bench" --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true \
  --benchmark_out="$json" --benchmark_out_format=json "$@" >&2

python3 - "$json" <<'PY'
import json
import sys

best = {}  # run name -> (best bytes per wall second, best bytes per CPU-second)
for r in json.load(open(sys.argv[1]))["benchmarks"]:
    if r.get("run_type", "iteration") == "iteration" and "bytes_per_second" in r:
        name = r.get("run_name", r["name"])
        wall = r["bytes_per_second"]
        cpu = wall * r["real_time"] / r["cpu_time"]
        old = best.get(name, (0.0, 0.0))
        best[name] = (max(old[0], wall), max(old[1], cpu))
memcpy = {}
ops = []
for name, rates in best.items():
    parts = name.split("/")  # op/<op>/<backend>/t<threads>/..., memcpy/<op>/t<threads>/...
    if parts[0] == "memcpy":
        memcpy[(parts[1], parts[2])] = rates
    elif parts[0] == "op":
        ops.append((parts[1], parts[2], parts[3], rates))
rank = {"scalar": 0, "avx2": 1, "avx512": 2}
ops.sort(key=lambda o: (int(o[2][1:]), o[0], rank.get(o[1], 3), o[1]))
print(f"{'op':32} {'backend':8} {'thr':>3} | {'GB/s':>6} {'memcpy':>6} {'ratio':>5} |"
      f" {'GB/cpu-s':>8} {'memcpy':>6} {'ratio':>5}")
for op, backend, threads, rates in ops:
    base = memcpy.get((op, threads))
    cells = []
    for k in range(2):
        if base:
            cells.append(f"{rates[k] / 1e9:{6 + 2 * k}.2f} {base[k] / 1e9:6.2f} {rates[k] / base[k]:5.2f}")
        else:
            cells.append(f"{rates[k] / 1e9:{6 + 2 * k}.2f} {'-':>6} {'-':>5}")
    print(f"{op:32} {backend:8} {threads[1:]:>3} | {cells[0]} | {cells[1]}")
PY
