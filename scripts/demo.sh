#!/usr/bin/env bash
# The main job on the built-in example: writes the tiny DeepSeek-V4-format checkpoint and shows
# what quantd sees in it and what each recipe would quantize. Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${QUANTD_BUILD_DIR:-$PWD/build}
OUT=${1:-${TMPDIR:-/tmp}/quantd-demo}
rm -rf "$OUT"
"$BUILD_DIR/server/quantd" mkfixture --arch deepseek-v4 --preset tiny --seed 1 "$OUT/source"
"$BUILD_DIR/server/quantd" inspect "$OUT/source"
