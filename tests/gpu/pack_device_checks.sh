#!/usr/bin/env bash
# Packs what tests/gpu/run_device_checks.sh runs into one compressed file that a device machine
# can take along (the `device` tool's `carry`, 64 MiB per call with the working tree). That
# machine has CUDA, cuBLAS and Python but none of the libraries our binaries link (Abseil,
# Google Benchmark, OpenSSL's libcrypto) nor OpenBLAS, which the CPU forward loads, and nothing
# can be installed there; building there would spend minutes of a 15-minute lease. So the test
# and benchmark binaries go stripped, with every shared library they need beyond the C and C++
# runtimes, the driver and cuBLAS, and libopenblas.so.0 with its own.
#
#   tests/gpu/pack_device_checks.sh [BUILD_DIR] [PACK]   (defaults: build, device-pack/checks.tar.xz)
#
# BUILD_DIR must be a CUDA build with benchmarks (-DQUANTD_CUDA=ON -DQUANTD_BENCH=ON). The pack
# holds build/tests/... (the layout run_device_checks.sh expects) and lib/. On the device, from
# the repository root (`carry: ["device-pack"]`; device-pack/ is ignored by git):
#
#   mkdir -p /tmp/p && tar -xJf device-pack/checks.tar.xz -C /tmp/p &&
#   LD_LIBRARY_PATH=/tmp/p/lib tests/gpu/run_device_checks.sh /tmp/p/build
set -euo pipefail

build="${1:-build}"
pack="${2:-device-pack/checks.tar.xz}"
binaries=(
  tests/cuda_backend_test tests/gemm_test tests/v4_cuda_blocks_test tests/backend_test
  tests/device_test tests/v4_cuda_moe_test tests/v4_cuda_attention_test tests/v4_cuda_cast_test
  tests/v4_cuda_ops_test tests/v4_cuda_layer_test tests/bench/quantd_kernels_bench
  tests/bench/quantd_v4_forward_bench
)
# Provided by the device machine's own system or driver, or too large to carry (cuBLAS, which
# quantd loads with dlopen; run_device_checks.sh finds the machine's own): never packed. The CUDA
# runtime our binaries were linked with goes along.
provided='/(ld-linux[^/]*|lib(c|m|dl|pthread|rt|gcc_s|stdc\+\+|cuda|cublas|cublasLt)\.so[^/]*)$'

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build/tests/bench" "$stage/lib"
for b in "${binaries[@]}"; do
  [[ -x "$build/$b" ]] || { echo "pack_device_checks: $build/$b is missing" >&2; exit 2; }
  strip -o "$stage/build/$b" "$build/$b"
done

# The shared libraries of the binaries and of OpenBLAS (loaded with dlopen, so ldd of the
# binaries does not list it), under their sonames.
# (awk reads ldconfig's whole output: an early exit would kill ldconfig with SIGPIPE, and under
# pipefail the script with it, silently, exit 141.)
openblas="$(ldconfig -p | awk '$1 == "libopenblas.so.0" && !found { print $NF; found = 1 }')"
[[ -n "$openblas" ]] || { echo "pack_device_checks: libopenblas.so.0 is not installed" >&2; exit 2; }
cp -L "$openblas" "$stage/lib/libopenblas.so.0"
for f in "${binaries[@]/#/$build/}" "$openblas"; do
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
done | sort -u | while read -r soname path; do
  [[ "/$soname" =~ $provided ]] && continue
  cp -L "$path" "$stage/lib/$soname"
done

mkdir -p "$(dirname "$pack")"
XZ_OPT="${XZ_OPT:--T0}" tar -C "$stage" -cJf "$pack" build lib
echo "packed ${#binaries[@]} binaries and $(ls "$stage/lib" | wc -l) libraries:" \
  "$(du -sh "$stage" | cut -f1) unpacked, $(du -h "$pack" | cut -f1) in $pack"
