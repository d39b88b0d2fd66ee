#!/usr/bin/env bash
# The daemon under read load (issue 4 §6): starts `quantd serve` on a fresh state dir and runs
# tests/bench/daemon_bench.cc against it on the small fixture (W4A16, `experts`): GetJob latency
# p50/p99 under 200 concurrent pollers while a job runs, and that job's slowdown against the same
# job with no pollers. Prints the table; the targets (p99 < 5 ms, slowdown < 5%) are reported, not
# enforced. The pollers run on the same machine as the daemon, so on a small machine they compete
# with the job for the CPUs: the back-to-back row (interval 0) is the worst case.
#
#   QUANTD_BIN=path          the quantd binary (default: $QUANTD_BUILD_DIR/server/quantd)
#   QUANTD_DAEMON_BENCH=path the bench binary (default: $QUANTD_BUILD_DIR/tests/bench/quantd_daemon_bench)
#   QUANTD_BUILD_DIR=dir     (default: <repo>/build)
#   QUANTD_BENCH_DIR=dir     where the fixture, outputs and the daemon's state go (default: a new dir
#                            under /var/tmp, removed at the end); an existing dir keeps its fixtures
#                            (shared with run_pipeline_bench.sh)
#   QUANTD_SERVE_ARGS=...    extra `quantd serve` options (e.g. "--devices cuda:0")
#   QUANTD_DAEMON_CPUS=list  pin the daemon to these CPUs (taskset -c), and
#   QUANTD_CLIENT_CPUS=list  the pollers to these, so that the slowdown shows the daemon's own cost
#                            of serving the calls rather than the clients' CPU use
# Arguments are passed to the bench binary, e.g. --pollers 200 --interval-ms 0,10,100 --rounds 3.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${QUANTD_BUILD_DIR:-$ROOT/build}
QUANTD=${QUANTD_BIN:-$BUILD/server/quantd}
BENCH=${QUANTD_DAEMON_BENCH:-$BUILD/tests/bench/quantd_daemon_bench}
die() { echo "run_daemon_bench: $*" >&2; exit 2; }
[ -x "$QUANTD" ] || die "$QUANTD is missing (build quantd first)"
[ -x "$BENCH" ] || die "$BENCH is missing (build quantd_daemon_bench first)"
read -r -a SERVE_ARGS <<< "${QUANTD_SERVE_ARGS:-}"
DAEMON_PIN=()
CLIENT_PIN=()
if [ -n "${QUANTD_DAEMON_CPUS:-}" ]; then DAEMON_PIN=(taskset -c "$QUANTD_DAEMON_CPUS"); fi
if [ -n "${QUANTD_CLIENT_CPUS:-}" ]; then CLIENT_PIN=(taskset -c "$QUANTD_CLIENT_CPUS"); fi

if [ -n "${QUANTD_BENCH_DIR:-}" ]; then
  WORK=$QUANTD_BENCH_DIR
  mkdir -p "$WORK"
  KEEP=1
else
  WORK=$(mktemp -d /var/tmp/quantd-bench.XXXXXX)
  KEEP=0
fi
STATE=$WORK/daemon-state
DAEMON=""
cleanup() {
  if [ -n "$DAEMON" ] && kill -0 "$DAEMON" 2>/dev/null; then
    kill -TERM "$DAEMON"
    wait "$DAEMON" || true
  fi
  if [ "$KEEP" = 0 ]; then rm -rf "$WORK"; else rm -rf "$STATE" "$WORK"/out-*; fi
}
trap cleanup EXIT

# The fixture (a stamp marks a complete one, as in run_pipeline_bench.sh).
SRC=$WORK/src-small
if [ ! -f "$SRC/.complete" ]; then
  rm -rf "$SRC"
  echo "bench: writing the small fixture" >&2
  "$QUANTD" mkfixture --preset small --seed 1 "$SRC" >&2
  touch "$SRC/.complete"
fi

rm -rf "$STATE"
"${DAEMON_PIN[@]}" "$QUANTD" serve --state-dir "$STATE" --metrics-listen none \
  "${SERVE_ARGS[@]}" 2> "$WORK/daemon.log" &
DAEMON=$!
for _ in $(seq 300); do
  [ -f "$STATE/serve.json" ] && break
  kill -0 "$DAEMON" 2>/dev/null || { cat "$WORK/daemon.log" >&2; die "quantd serve exited"; }
  sleep 0.1
done
[ -f "$STATE/serve.json" ] || die "quantd serve did not write $STATE/serve.json within 30 s"
ADDR=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["listen"][0])' \
  "$STATE/serve.json")

"${CLIENT_PIN[@]}" "$BENCH" --server "$ADDR" --source "$SRC" --output-dir "$WORK" "$@"
printf 'quantd serve %s; daemon CPUs %s, client CPUs %s; load %s\n' \
  "${QUANTD_SERVE_ARGS:-(defaults)}" "${QUANTD_DAEMON_CPUS:-all}" "${QUANTD_CLIENT_CPUS:-all}" \
  "$(cut -d' ' -f1-3 /proc/loadavg)"
