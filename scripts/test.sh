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

echo "== GPU checks path (pack, unpack into a clean directory, correctness steps; no GPU here, so they skip)"
if [[ -x "$BUILD_DIR/tests/cuda_backend_test" ]]; then
  device_pack=$(mktemp -d)
  tests/gpu/pack_device_checks.sh "$BUILD_DIR" "$device_pack/checks.tar.xz"
  mkdir "$device_pack/unpacked"
  tar -xJf "$device_pack/checks.tar.xz" -C "$device_pack/unpacked"
  OUT="$device_pack/out" QUANTD_DEVICE_CHECKS=short LD_LIBRARY_PATH="$device_pack/unpacked/lib" \
    tests/gpu/run_device_checks.sh "$device_pack/unpacked/build"
  rm -rf "$device_pack"
else
  echo "skipped: $BUILD_DIR was built without CUDA"
fi

echo "== thread-safety analysis (clang -Wthread-safety; every package whose code carries annotations)"
# Only the annotated code is analysed, so this compiles the object files of the packages that
# hold ABSL_GUARDED_BY / ABSL_*LOCKS* annotations (and the generated proto headers they include),
# and of the kernels only the thread pool (its SIMD files need GCC's target strings).
cmake -G Ninja -S "$ROOT" -B "$ROOT/build-tsa" -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DQUANTD_CUDA=OFF -DQUANTD_BENCH=OFF \
  -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror=thread-safety" >/dev/null
mapfile -t TSA_OBJECTS < <(ninja -C "$ROOT/build-tsa" -t targets all |
  grep -E '^(server/(scheduler|api|calibration|evaluation|metrics|ops|pipeline)/CMakeFiles/[^:]*|kernels/CMakeFiles/[^:]*thread_pool\.cc)\.o:' |
  cut -d: -f1)
ninja -C "$ROOT/build-tsa" "${TSA_OBJECTS[@]}"

echo "== fuzz (4 libFuzzer targets, ${QUANTD_FUZZ_SECONDS:-60} s each)"
tests/fuzz/run_fuzz.sh "$ROOT/build-fuzz" "${QUANTD_FUZZ_SECONDS:-60}"

echo "== integration and interop tests (pytest)"
QUANTD_BUILD_DIR=$BUILD_DIR "$VENV/bin/python" -m pytest -q tests/integration tests/interop
