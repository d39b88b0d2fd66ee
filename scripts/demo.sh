#!/usr/bin/env bash
# The main job on the built-in example, through the daemon: writes the tiny DeepSeek-V4-format
# checkpoint (FP8 attention, MXFP4 routed experts, a byte-level tokenizer), starts `quantd serve`
# on its unix socket (state in a SQLite file under $OUT/state, stopped with SIGTERM when the script
# exits), submits the W4A4 conversion of the routed experts to NVFP4 with NVIDIA's V4 recipe,
# calibrated inside the job on the built-in text (tests/data/calibration_sample.jsonl), follows it
# with `quantctl submit --watch`, prints the job's report, and checks the result against the export
# rules (every NVFP4 module has its calibrated input_scale).
# Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${QUANTD_BUILD_DIR:-$PWD/build}
QUANTD=$BUILD_DIR/server/quantd
QUANTCTL=$BUILD_DIR/client/quantctl
OUT=${1:-${TMPDIR:-/tmp}/quantd-demo}
rm -rf "$OUT"
mkdir -p "$OUT"
"$QUANTD" mkfixture --arch deepseek-v4 --preset tiny --seed 1 "$OUT/source"
"$QUANTD" inspect "$OUT/source"

# The daemon serves its unix socket $OUT/state/quantd.sock (this user is an admin there), picks a
# free metrics port (port 0) and writes both to serve.json once it is ready.
"$QUANTD" serve --state-dir "$OUT/state" --metrics-listen 127.0.0.1:0 2> "$OUT/serve.log" &
DAEMON=$!
stop_daemon() {
  kill -TERM "$DAEMON" 2> /dev/null && wait "$DAEMON" || true
}
trap stop_daemon EXIT
for _ in $(seq 300); do
  [[ -f "$OUT/state/serve.json" ]] && break
  if ! kill -0 "$DAEMON" 2> /dev/null; then
    cat "$OUT/serve.log" >&2
    echo "demo: quantd serve exited before it was ready" >&2
    exit 1
  fi
  sleep 0.1
done
if [[ ! -f "$OUT/state/serve.json" ]]; then
  cat "$OUT/serve.log" >&2
  echo "demo: quantd serve was not ready after 30 s" >&2
  exit 1
fi
read -r SERVER METRICS < <(python3 -c '
import json, sys
ready = json.load(open(sys.argv[1]))
print(ready["listen"][0], ready["metrics_listen"])' "$OUT/state/serve.json")
echo "quantd serve: gRPC on $SERVER, metrics on http://$METRICS/metrics, log in $OUT/serve.log"

# W4A4: the calibrate stage runs the native forward layer by layer over 32 samples of the built-in
# text and records max|x| at every expert's input; quantize writes input_scale = amax / 2688.
"$QUANTCTL" --server "$SERVER" submit --source "$OUT/source" --output "$OUT/nvfp4" \
  --recipe experts --weight-format nvfp4 --expert-cast lossless --export-format modelopt \
  --dataset "$PWD/tests/data/calibration_sample.jsonl" --num-samples 32 --seq-len 256 \
  --watch
JOB=$("$QUANTCTL" --server "$SERVER" -o json list | python3 -c '
import json, sys
print(json.load(sys.stdin)["jobs"][-1]["id"])')
"$QUANTCTL" --server "$SERVER" report "$JOB"
"$QUANTD" verify "$OUT/nvfp4"

# A clean shutdown exits 0.
trap - EXIT
kill -TERM "$DAEMON"
wait "$DAEMON"
