#!/usr/bin/env bash
# End-to-end benchmark of `quantd run` (issue 3 §7, issue 8 §7), printed as one table in one run:
#
#   wall      `quantd run` on the bench fixture (~2 GiB, W4A16, `experts` and `full` recipes),
#             all its stages (inspect, quantize, export, verify), output on the same disk
#   GB/s      source bytes / wall
#   peak RSS  /usr/bin/time -v "Maximum resident set size"; also on the small fixture, to show
#             whether it grows with the number of shards
#   anon RSS  peak RssAnon (sampled from /proc every 50 ms): the same without the pages of the
#             memory-mapped source and output shards, which the kernel can drop at any time
#   I/O floor what a plain copy of the same bytes costs: `cp -r` of the source next to the output,
#             then `sync`, timed together (after a `sync` that flushes earlier writes). Nothing is
#             dropped from the page cache first (that needs root), so the read side is usually
#             served from memory, exactly as it is for `quantd run` here.
#   ratio     wall / I/O floor
#   compute   the same `quantd run` with source, output and state in /dev/shm (tmpfs): the same
#   floor     kernels over the same tensors, with no disk I/O (memory copies remain)
#
# Targets: wall <= 1.5 x the I/O floor; peak RSS <= 1 GiB + 2 x the largest tensor, and not
# growing from the small to the bench fixture.
#
#   QUANTD_BIN=path        the quantd binary (default: $QUANTD_BUILD_DIR/server/quantd)
#   QUANTD_BUILD_DIR=dir   (default: <repo>/build)
#   QUANTD_BENCH_DIR=dir   where fixtures and outputs go (default: a new dir under /var/tmp,
#                          removed at the end); an existing dir keeps its fixtures between runs
#   QUANTD_BENCH_ARGS=...  extra `quantd run` options (e.g. "--workers 4 --device cuda:0")
#   QUANTD_BENCH_REPEAT=N  runs per measurement, the fastest counts (default 2)
#   QUANTD_BENCH_RECIPES="experts full"  the recipes measured (default both)
#   QUANTD_BENCH_EXPERT_CAST=requantize  the spec's expert_cast (default requantize: the MXFP4
#                          experts decoded and quantized, the costlier path; lossless casts them)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
QUANTD=${QUANTD_BIN:-${QUANTD_BUILD_DIR:-$ROOT/build}/server/quantd}
die() { echo "run_pipeline_bench: $*" >&2; exit 2; }
[ -x "$QUANTD" ] || die "$QUANTD is missing (build quantd first)"
[ -x /usr/bin/time ] || die "/usr/bin/time is missing (apt-get install time)"
read -r -a RUN_ARGS <<< "${QUANTD_BENCH_ARGS:-}"
REPEAT=${QUANTD_BENCH_REPEAT:-2}
read -r -a RECIPES <<< "${QUANTD_BENCH_RECIPES:-experts full}"
EXPERT_CAST=${QUANTD_BENCH_EXPERT_CAST:-requantize}

if [ -n "${QUANTD_BENCH_DIR:-}" ]; then
  WORK=$QUANTD_BENCH_DIR
  mkdir -p "$WORK"
  KEEP=1
else
  WORK=$(mktemp -d /var/tmp/quantd-bench.XXXXXX)
  KEEP=0
fi
SHM=$(mktemp -d /dev/shm/quantd-bench.XXXXXX)
cleanup() {
  rm -rf "$SHM"
  if [ "$KEEP" = 0 ]; then
    rm -rf "$WORK"
  else
    rm -rf "$WORK"/out-* "$WORK"/*.db* "$WORK"/copy
  fi
}
trap cleanup EXIT

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# Fixtures (kept between runs with QUANTD_BENCH_DIR: a stamp marks a complete one).
for preset in small bench; do
  if [ ! -f "$WORK/src-$preset/.complete" ]; then
    rm -rf "$WORK/src-$preset"
    echo "bench: writing the $preset fixture" >&2
    "$QUANTD" mkfixture --preset "$preset" --seed 1 "$WORK/src-$preset" >&2
    touch "$WORK/src-$preset/.complete"
  fi
done

# Bytes of tensor data in a checkpoint, its shard count and its largest tensor.
checkpoint_facts() {
  python3 - "$1" <<'EOF'
import json, struct, sys
from pathlib import Path
d = Path(sys.argv[1])
total = largest = 0
shards = sorted(d.glob("*.safetensors"))
for p in shards:
    with open(p, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    for name, t in header.items():
        if name == "__metadata__":
            continue
        size = t["data_offsets"][1] - t["data_offsets"][0]
        total += size
        largest = max(largest, size)
print(total, len(shards), largest)
EOF
}

write_spec() {  # source output recipe file
  printf '{"source": "%s", "output": "%s", "recipe": "%s", "weight_format": "w4a16_nvfp4", %s}\n' \
    "$1" "$2" "$3" "\"expert_cast\": \"$EXPERT_CAST\"" > "$4"
}

# Peak RssAnon (KiB) of process $1 until it exits, sampled every 50 ms: RSS without the pages of
# memory-mapped files (the source and output shards), which /usr/bin/time's figure includes.
ANON=0
sample_anon() {
  local pid=$1 key value
  ANON=0
  while [ -r "/proc/$pid/status" ]; do
    while read -r key value _; do
      if [ "$key" = RssAnon: ] && [ "$value" -gt "$ANON" ]; then ANON=$value; fi
    done < "/proc/$pid/status" 2>/dev/null || true
    sleep 0.05
  done
}

# Runs quantd under /usr/bin/time -v; sets WALL (s), RSS (KiB, /usr/bin/time) and ANON (KiB).
timed_run() {  # state spec
  local log=$WORK/time.log t0 t1 tpid qpid=""
  t0=$(now)
  /usr/bin/time -v -o "$log" "$QUANTD" run --state "$1" "${RUN_ARGS[@]}" "$2" 2>"$WORK/run.log" &
  tpid=$!
  while [ -z "$qpid" ] && kill -0 "$tpid" 2>/dev/null; do
    qpid=$(pgrep -P "$tpid" || true)
    sleep 0.01
  done
  if [ -n "$qpid" ]; then sample_anon "$qpid"; fi
  if ! wait "$tpid"; then
    cat "$WORK/run.log" >&2
    exit 1
  fi
  t1=$(now)
  WALL=$(elapsed "$t0" "$t1")
  RSS=$(awk -F': ' '/Maximum resident set size/ { print $2 }' "$log")
}

# Seconds each stage took in the state file $1: "inspect 0.1 quantize 3.4 ...".
stage_times() {
  python3 - "$1" <<'EOF'
import sqlite3, sys
con = sqlite3.connect(sys.argv[1])
rows = con.execute("SELECT kind, (finished_ms - started_ms) / 1000.0 FROM stages ORDER BY ordinal")
print(" ".join(f"{kind} {secs:.1f}" for kind, secs in rows))
EOF
}

# A fresh job (state and output removed first), REPEAT times: WALL = the fastest, RSS and ANON =
# the largest, STAGES = stage times of the fastest run. The last run's output stays.
best_run() {  # state spec output
  local best="" rss=0 anon=0 stages="" i
  for ((i = 0; i < REPEAT; i++)); do
    rm -rf "$3" "$1" "$1"-wal "$1"-shm "$1".lock
    timed_run "$1" "$2"
    if [ -z "$best" ] || awk -v a="$WALL" -v b="$best" 'BEGIN { exit !(a < b) }'; then
      best=$WALL
      stages=$(stage_times "$1")
    fi
    if [ "$RSS" -gt "$rss" ]; then rss=$RSS; fi
    if [ "$ANON" -gt "$anon" ]; then anon=$ANON; fi
  done
  WALL=$best RSS=$rss ANON=$anon STAGES=$stages
}

read -r BENCH_BYTES BENCH_SHARDS LARGEST <<< "$(checkpoint_facts "$WORK/src-bench")"
read -r SMALL_BYTES SMALL_SHARDS _ <<< "$(checkpoint_facts "$WORK/src-small")"
RSS_LIMIT_KIB=$(( (1024 * 1024 * 1024 + 2 * LARGEST) / 1024 ))

# The source copy in /dev/shm for the compute floor (not timed).
cp -r "$WORK/src-bench" "$SHM/src"

STAGE_LINES=()
ROW='%-8s %-7s %6s %7s %5s %9s %9s %8s %6s %9s %s\n'
# shellcheck disable=SC2059
printf "$ROW" fixture recipe shards wall_s GB/s peak_RSS anon_RSS io_floor ratio cpu_floor verdict
for recipe in "${RECIPES[@]}"; do
  for preset in small bench; do
    src=$WORK/src-$preset
    out=$WORK/out-$preset-$recipe
    write_spec "$src" "$out" "$recipe" "$WORK/spec-$preset-$recipe.json"
    best_run "$WORK/$preset-$recipe.db" "$WORK/spec-$preset-$recipe.json" "$out"
    wall=$WALL rss=$RSS anon=$ANON
    if [ "$preset" = bench ]; then bytes=$BENCH_BYTES shards=$BENCH_SHARDS; else
      bytes=$SMALL_BYTES shards=$SMALL_SHARDS; fi
    gbs=$(awk -v b="$bytes" -v w="$wall" 'BEGIN { printf "%.2f", b / w / 1e9 }')
    rss_gib=$(awk -v k="$rss" 'BEGIN { printf "%.2fGiB", k / 1048576 }')
    anon_mib=$(awk -v k="$anon" 'BEGIN { printf "%.0fMiB", k / 1024 }')
    rss_ok=$([ "$rss" -le "$RSS_LIMIT_KIB" ] && echo ok || echo over)
    io=- cpu=- ratio=- wall_ok=""
    if [ "$preset" = bench ]; then
      STAGE_LINES+=("$preset $recipe disk:  $STAGES")

      # I/O floor: cp -r of the source on the same disk, then sync (fastest of REPEAT).
      io=""
      for ((i = 0; i < REPEAT; i++)); do
        rm -rf "$WORK/copy"
        sync
        t0=$(now)
        cp -r "$src" "$WORK/copy"
        sync
        t1=$(now)
        t=$(elapsed "$t0" "$t1")
        if [ -z "$io" ] || awk -v a="$t" -v b="$io" 'BEGIN { exit !(a < b) }'; then io=$t; fi
      done
      rm -rf "$WORK/copy"

      # Compute floor: the same run, everything in tmpfs.
      write_spec "$SHM/src" "$SHM/out" "$recipe" "$SHM/spec.json"
      best_run "$SHM/state.db" "$SHM/spec.json" "$SHM/out"
      cpu=$WALL
      STAGE_LINES+=("$preset $recipe tmpfs: $STAGES")
      rm -rf "$SHM/out"

      ratio=$(awk -v w="$wall" -v a="$io" 'BEGIN { printf "%.2f", w / a }')
      wall_ok="wall:$(awk -v r="$ratio" 'BEGIN { print (r <= 1.5) ? "ok" : "slow" }') "
    fi
    rm -rf "$out"
    # shellcheck disable=SC2059
    printf "$ROW" "$preset" "$recipe" "$shards" "$wall" "$gbs" "$rss_gib" "$anon_mib" "$io" \
      "$ratio" "$cpu" "${wall_ok}rss:$rss_ok"
  done
done
echo "stage seconds (fastest run):"
printf '  %s\n' "${STAGE_LINES[@]}"
printf 'source bytes: bench %d (%d shards), small %d (%d shards); largest tensor %d bytes\n' \
  "$BENCH_BYTES" "$BENCH_SHARDS" "$SMALL_BYTES" "$SMALL_SHARDS" "$LARGEST"
printf 'RSS limit (1 GiB + 2 x largest tensor) %.2f GiB; quantd run %s; expert_cast %s; best of %d; ' \
  "$(awk -v k="$RSS_LIMIT_KIB" 'BEGIN { print k / 1048576 }')" "${QUANTD_BENCH_ARGS:-(defaults)}" \
  "$EXPERT_CAST" "$REPEAT"
printf '%d CPUs; ' "$(nproc)"
printf 'load %s; %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)" "$(df --output=fstype "$WORK" | tail -1)"
