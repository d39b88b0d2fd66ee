#!/usr/bin/env bash
# The long soak: tests/integration/test_soak.py for SECONDS (default 600 = 10 minutes) against the
# quantd in BUILD_DIR (default ./build), printing the RPC tally and the daemon's descriptor and
# memory figures. CI runs the same test for 60 s as part of the integration tier.
#
# Usage: tests/soak/run_soak.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${QUANTD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/quantd/venv}
QUANTD_SOAK_SECONDS=${1:-600} QUANTD_BUILD_DIR=${QUANTD_BUILD_DIR:-$PWD/build} \
  "$VENV/bin/python" -m pytest -q -s tests/integration/test_soak.py
