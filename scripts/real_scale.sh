#!/usr/bin/env bash
# A checkpoint of DeepSeek-V4-Pro's real shape through a calibrated, evaluated W4A4 job on this
# machine (issue 21, item 5): `quantd mkfixture --preset pro --layers 1` (real config, tensor
# shapes and encodings: about 18 GB), then one `experts` W4A4 job with calibration and
# evaluation through `quantd run`, then `quantd verify` on its output. Prints what the run took:
# peak RSS and peak anonymous memory (the forward's own memory: the mapped source's pages are
# file pages), per layer task the seconds of load / decode / forward / record, the quantize and
# verify GB/s, the work directory's bytes and whether any lease expired.
#
#   scripts/real_scale.sh [--preset pro|flash] [--layers N] [--experts N] [--vocab N]
#                         [--samples N] [--eval-samples N] [--seq-len N] [--threads N]
#                         [--dir DIR] [--keep]
#
# DIR (default /tmp/quantd-real-scale) takes the source and the output, about twice the source's
# size: mind the disk. --experts / --vocab cut the counts (dimensions stay real; the CI test
# tests/integration/test_real_scale.py runs this script that way). Not part of .ci/run at full
# size. Input ids are random (a fixed seed), so the script needs no tokenizer.
set -euo pipefail

preset=pro layers=1 experts="" vocab="" samples=16 eval_samples=4 seq_len=512 threads=0
dir=/tmp/quantd-real-scale keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) preset=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --experts) experts=$2; shift 2 ;;
    --vocab) vocab=$2; shift 2 ;;
    --samples) samples=$2; shift 2 ;;
    --eval-samples) eval_samples=$2; shift 2 ;;
    --seq-len) seq_len=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    *) echo "real_scale.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

repo=$(cd "$(dirname "$0")/.." && pwd)
quantd=${QUANTD_BIN:-${QUANTD_BUILD_DIR:-$repo/build}/server/quantd}
[ -x "$quantd" ] || { echo "real_scale.sh: no quantd at $quantd (build first)" >&2; exit 2; }
if [ ! -x /usr/bin/time ]; then
  echo "real_scale.sh: needs /usr/bin/time (apt install time)" >&2
  exit 2
fi

rm -rf "$dir"
mkdir -p "$dir"
src=$dir/source out=$dir/output state=$dir/state.db
cleanup() { [ "$keep" = 1 ] || rm -rf "$src" "$out"; }
trap cleanup EXIT

cut=()
[ -n "$experts" ] && cut+=(--experts "$experts")
[ -n "$vocab" ] && cut+=(--vocab "$vocab")
echo "== mkfixture --preset $preset --layers $layers ${cut[*]}"
/usr/bin/time -f "%e %M" -o "$dir/mkfixture.time" \
  "$quantd" mkfixture --arch deepseek-v4 --preset "$preset" --layers "$layers" "${cut[@]}" "$src"
read -r gen_s gen_kib < "$dir/mkfixture.time"
src_bytes=$(du -sb "$src" | cut -f1)
vocab_size=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" \
  "$src/config.json")

# Calibration and held-out samples: seq_len random ids each (the evaluate stage takes the lines
# calibration leaves).
python3 - "$dir/data.jsonl" "$((samples + eval_samples))" "$seq_len" "$vocab_size" <<'EOF'
import json, random, sys
path, lines, seq_len, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(1)
with open(path, "w") as f:
    for _ in range(lines):
        f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(seq_len)]}) + "\n")
EOF
cat > "$dir/spec.json" <<EOF
{"source": "$src", "output": "$out", "weight_format": "nvfp4", "recipe": "experts",
 "calibration": {"datasets": [{"path": "$dir/data.jsonl", "samples": $samples}],
                 "seq_len": $seq_len, "min_seq_len": $seq_len},
 "evaluate": {"num_samples": $eval_samples}}
EOF

echo "== quantd run (W4A4 experts, $samples x $seq_len calibration tokens, $eval_samples held out)"
/usr/bin/time -f "%e %M" -o "$dir/run.time" \
  "$quantd" run --state "$state" --device cpu --threads "$threads" "$dir/spec.json" \
  > "$dir/run.log" 2>&1 &
run_pid=$!
# Peak RssAnon of quantd (the child of time), sampled every 0.2 s.
peak_anon=0
while kill -0 "$run_pid" 2>/dev/null; do
  child=$(pgrep -P "$run_pid" | head -1 || true)
  if [ -n "$child" ]; then
    anon=$(awk '/^RssAnon:/ {print $2}' "/proc/$child/status" 2>/dev/null || echo 0)
    [ -n "$anon" ] && [ "$anon" -gt "$peak_anon" ] && peak_anon=$anon
  fi
  sleep 0.2
done
run_rc=0
wait "$run_pid" || run_rc=$?
read -r run_s run_kib < "$dir/run.time"
if [ "$run_rc" != 0 ] || ! grep -q "SUCCEEDED" "$dir/run.log"; then
  tail -20 "$dir/run.log" >&2
  echo "real_scale.sh: quantd run failed (exit $run_rc; log $dir/run.log)" >&2
  keep=1
  exit 1
fi

echo "== quantd verify"
verify_start=$(date +%s.%N)
"$quantd" verify "$out" > "$dir/verify.log" 2>&1 || {
  tail -20 "$dir/verify.log" >&2; echo "real_scale.sh: quantd verify failed" >&2; keep=1; exit 1; }
verify_s=$(python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.2f}')" \
  "$verify_start")
out_bytes=$(du -sb "$out" | cut -f1)
work_bytes=$(du -sb "$state.work" 2>/dev/null | cut -f1 || echo 0)

python3 - "$state" "$dir/run.log" <<EOF
import re, sqlite3, sys
state, log = sys.argv[1], open(sys.argv[2]).read()
gb = 1e9
print()
print(f"preset $preset, $layers layer(s), source {int('$src_bytes') / gb:.2f} GB "
      f"(mkfixture {float('$gen_s'):.1f} s, {int('$src_bytes') / float('$gen_s') / 1e6:.0f} MB/s, "
      f"peak RSS {int('$gen_kib') / 2**20:.2f} GiB)")
print(f"quantd run: {float('$run_s'):.1f} s, peak RSS {int('$run_kib') / 2**20:.2f} GiB, "
      f"peak anonymous {int('$peak_anon') / 2**20:.2f} GiB")
db = sqlite3.connect(state)
(expired,) = db.execute("SELECT COUNT(*) FROM events WHERE kind = 'lease_expired'").fetchone()
print(f"  leases expired: {expired}")
for kind, started, finished in db.execute(
        "SELECT kind, started_ms, finished_ms FROM stages ORDER BY ordinal"):
    if started is None or finished is None:
        continue
    seconds = (finished - started) / 1000
    (done,) = db.execute("SELECT COALESCE(SUM(t.bytes_total), 0) FROM tasks t JOIN stages s "
                         "ON t.stage_id = s.id WHERE s.kind = ?", (kind,)).fetchone()
    rate = f", {done / seconds / gb:.3f} GB/s" if kind == "quantize" and seconds > 0 else ""
    print(f"  stage {kind:<10} {seconds:8.1f} s{rate}")
print("  per layer task (seconds):")
for m in re.finditer(r"^((?:calibrate|evaluate) \S+) done[^(\n]*\(([^)]*)\)", log, re.M):
    print(f"    {m.group(1):<28} {m.group(2)}")
print(f"quantd verify: {float('$verify_s'):.1f} s, "
      f"{int('$out_bytes') / float('$verify_s') / gb:.3f} GB/s over "
      f"{int('$out_bytes') / gb:.2f} GB")
print(f"work directory: {int('$work_bytes')} bytes")
EOF
