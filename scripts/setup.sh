#!/usr/bin/env bash
# Installs what quantd needs on Debian 12 and builds it. Idempotent and non-interactive: a second
# run installs nothing new and rebuilds only what changed.
#
#   scripts/setup.sh            Debian packages, the Python test virtualenv, configure + build
#   QUANTD_BUILD_DIR=...        build directory (default: ./build)
#   QUANTD_SKIP_VENV=1          skip the Python virtualenv (only needed for the interop tests)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD_DIR=${QUANTD_BUILD_DIR:-$ROOT/build}

# --- Debian packages --------------------------------------------------------------------------
PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libabsl-dev nlohmann-json3-dev libcli11-dev libsqlite3-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc   # the gRPC API
  prometheus-cpp-dev libspdlog-dev  # metrics and structured logs of quantd serve
  prometheus                        # promtool and a real Prometheus server for the metrics tests
  libboost-dev                      # Boost.Asio: the scheduler's io_context, timers and signals
  libpcre2-dev                      # the tokenizer's pre-tokenizer regexes (PCRE2 with JIT)
  libopenblas-dev                   # CPU GEMM of the model forward
  libsystemd-dev systemd            # sd_notify (Type=notify) and systemd-analyze for the unit files
  clang libclang-rt-14-dev          # libFuzzer for the bounded fuzz run
  python3 python3-venv python3-dev
  time procps                       # /usr/bin/time -v and pgrep for the pipeline benchmark
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- Python virtualenv for the interop tests (outside the clone, reused across clones) --------
if [ "${QUANTD_SKIP_VENV:-0}" != 1 ]; then
  VENV=${QUANTD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/quantd/venv}
  REQ=$ROOT/tests/interop/requirements.txt
  stamp=$VENV/.requirements.sha256
  want=$(sha256sum "$REQ" | cut -d' ' -f1)
  if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: creating the interop virtualenv at $VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -r "$REQ"
    echo "$want" > "$stamp"
  fi
fi

# --- Configure and build ----------------------------------------------------------------------
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -G Ninja -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$(nproc)"
echo "setup: built into $BUILD_DIR"
