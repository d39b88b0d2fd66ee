#!/usr/bin/env bash
# Tokenizer throughput, one thread: quantd against the `tokenizers` library on the same corpus in
# the same run (tests/bench/tokenizer_bench.py).
# Usage: tests/bench/run_tokenizer_bench.sh [BUILD_DIR] [PASSES]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${1:-build}
VENV=${QUANTD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/quantd/venv}
ninja -C "$BUILD_DIR" quantd_tokenizer_bench >/dev/null
exec "$VENV/bin/python" tests/bench/tokenizer_bench.py "$BUILD_DIR" "${2:-5}"
