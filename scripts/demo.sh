#!/usr/bin/env bash
# The main job on the built-in example: writes the tiny DeepSeek-V4-format checkpoint (FP8
# attention, MXFP4 routed experts), converts its routed experts to NVFP4 with NVIDIA's V4 recipe
# (resumable: state in a SQLite file), and checks the result against the export rules.
# Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${QUANTD_BUILD_DIR:-$PWD/build}
QUANTD=$BUILD_DIR/server/quantd
OUT=${1:-${TMPDIR:-/tmp}/quantd-demo}
rm -rf "$OUT"
mkdir -p "$OUT"
"$QUANTD" mkfixture --arch deepseek-v4 --preset tiny --seed 1 "$OUT/source"
"$QUANTD" inspect "$OUT/source"
# Weights-only NVFP4 (W4A16): W4A4 needs calibrated input amax, which the calibration stage will
# provide; until then `calibration.amax_file` supplies it.
cat > "$OUT/job.json" <<JSON
{"source": "$OUT/source", "output": "$OUT/nvfp4", "recipe": "experts",
 "weight_format": "w4a16_nvfp4", "expert_cast": "lossless", "export_format": "modelopt"}
JSON
"$QUANTD" run --state "$OUT/state.db" "$OUT/job.json"
"$QUANTD" verify "$OUT/nvfp4"
