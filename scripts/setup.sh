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

# --- Slurm for tests/integration/test_slurm.py's real one-node cluster -------------------------
# Debian's Slurm and munge packages unpacked (dpkg -x, nothing installed) into the cache;
# .ci/run points QUANTD_SLURM_ROOT at it. Optional: a download that fails warns and setup goes on
# (the test is skipped without it).
SLURM_PACKAGES=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge libmunge2 libhwloc15
                liblua5.1-0)
fetch_slurm() {
  local dest=$1 stamp=$1/.packages tmp
  [ "$(cat "$stamp" 2>/dev/null)" = "${SLURM_PACKAGES[*]}" ] && return 0
  command -v apt-get >/dev/null && command -v dpkg >/dev/null || return 1
  tmp=$(mktemp -d) || return 1
  # apt's _apt sandbox user cannot write a private temp dir: download as the caller.
  (cd "$tmp" && apt-get -q -o APT::Sandbox::User="$(id -un)" download "${SLURM_PACKAGES[@]}") \
    >"$tmp/download.log" 2>&1 || { tail -n 3 "$tmp/download.log" >&2; rm -rf "$tmp"; return 1; }
  mkdir "$tmp/root" || return 1
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$tmp/root" || { rm -rf "$tmp"; return 1; }; done
  echo "${SLURM_PACKAGES[*]}" > "$tmp/root/.packages"
  rm -rf "$dest" && mkdir -p "$(dirname "$dest")" && mv "$tmp/root" "$dest" || return 1
  rm -rf "$tmp"
  echo "setup: unpacked Slurm and munge into $dest"
}
SLURM_ROOT=${XDG_CACHE_HOME:-$HOME/.cache}/quantd/slurm
fetch_slurm "$SLURM_ROOT" ||
  echo "setup: warning: could not fetch Slurm's Debian packages into $SLURM_ROOT; the real" \
       "one-node Slurm test will be skipped" >&2

# --- Configure and build ----------------------------------------------------------------------
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -G Ninja -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$(nproc)"
echo "setup: built into $BUILD_DIR"
