#!/usr/bin/env bash
# Runs every test tier: unit (ctest), bounded fuzz (libFuzzer), integration (kill/resume of the
# real binary) and interop (pytest with real peer libraries).
# Expects scripts/setup.sh to have run.
#   QUANTD_FUZZ_SECONDS=N   fuzz time (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD_DIR=${QUANTD_BUILD_DIR:-$ROOT/build}
VENV=${QUANTD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/quantd/venv}

echo "== unit tests (ctest)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)"

echo "== fuzz (4 libFuzzer targets, ${QUANTD_FUZZ_SECONDS:-60} s each)"
tests/fuzz/run_fuzz.sh "$ROOT/build-fuzz" "${QUANTD_FUZZ_SECONDS:-60}"

echo "== integration and interop tests (pytest)"
QUANTD_BUILD_DIR=$BUILD_DIR "$VENV/bin/python" -m pytest -q tests/integration tests/interop
