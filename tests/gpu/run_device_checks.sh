#!/usr/bin/env bash
# The GPU checks of the DeepSeek-V4 forward and the CUDA kernels, in one go on a machine with a
# CUDA device (about 6 minutes on an H200; every step has its own time limit). Builds nothing:
# run it from the repository root with a build directory made elsewhere with CUDA
# (cmake -DQUANTD_CUDA=ON -DQUANTD_BENCH=ON) and carried along, usually as the pack of
# tests/gpu/pack_device_checks.sh (its header has the command).
#
#   tests/gpu/run_device_checks.sh [BUILD_DIR]     (default: build; results under $OUT)
#
# QUANTD_DEVICE_CHECKS=short runs the correctness steps only (unit_cuda, cuda_layer): scripts/test.sh
# runs the unpacked pack that way on every CI run, where the CUDA tests skip for want of a device,
# so the path from pack to run is proven before a GPU is ever lent. The exit status is 1 when a
# step failed, else 0.
#
# QUANTD_DEVICE_SECONDS (default 560) caps the whole run below the device tool's 10 minutes per
# command: a step whose limit would pass it is skipped and says so in the summary. cuBLAS is
# loaded by soname; when the loader cannot find libcublas.so.13, the machine's CUDA and Python
# package folders are searched for it and the first one found goes on LD_LIBRARY_PATH.
#
# Steps (each one's output in $OUT/<step>.log, its exit status in $OUT/summary.txt; a failing
# step does not stop the others):
#   gpu            nvidia-smi: the device it ran on
#   unit_cuda      the CUDA unit tests, run as binaries (ctest files hold build-machine paths):
#                  the CUDA backend, cuBLAS (gemm_test), the V4 CUDA blocks against the CPU
#                  blocks, the backend-agnostic kernel tests and the device seam, the V4 router,
#                  MoE combine, compressor pooling, mHC pre/head and embedding CUDA blocks, the
#                  V4 attention CUDA blocks (sparse attention, indexer)
#   cuda_layer     v4_cuda_cast_test (the device forward's own kernels: q head norm, BF16 steps),
#                  v4_cuda_ops_test (the CUDA ops against the host ops, op by op) and
#                  v4_cuda_layer_test: the one forward graph on the CUDA ops against the host ops,
#                  whole decoder layers, the head and the MTP block (prints each layer's worst
#                  relative difference)
#   forward_cuda   quantd_v4_forward_bench --table cuda: whole layers of the small4 model on the
#                  device, tokens/s and TFLOP/s against the cuBLAS peak of the same run
#   forward_cublas quantd_v4_forward_bench --table cublas: the forward's products on cuBLAS
#   kernels_bench  tests/bench/run_kernels_bench.sh (conversion kernels, CPU and CUDA)
#   forward_cpu    quantd_v4_forward_bench --table small4: the CPU forward on this machine's cores
# (correctness first, then the benchmarks, so that a short lease still answers whether it works)
set -uo pipefail

build="${1:-build}"
out="${OUT:-$PWD/device-checks}"
mkdir -p "$out"
scratch="$(mktemp -d /tmp/fwd-gpu-XXXXXX)"
trap 'rm -rf "$scratch"' EXIT
summary="$out/summary.txt"
: > "$summary"
budget="${QUANTD_DEVICE_SECONDS:-560}"

# grep -c, not -q: -q stops reading at the first match and ldconfig dies of SIGPIPE, which
# pipefail would report as "not found".
if [[ "$(ldconfig -p | grep -c 'libcublas\.so\.13 ')" == 0 ]]; then
  cublas="$(find /usr/local /opt /usr/lib -name 'libcublas.so.13*' -print -quit 2>/dev/null || true)"
  if [[ -n "$cublas" ]]; then
    export LD_LIBRARY_PATH="$(dirname "$cublas")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  echo "libcublas.so.13: ${cublas:-not found}" | tee -a "$summary"
fi

# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, output to $out/NAME.log.
step() {
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS
  if ((SECONDS + limit > budget)); then
    printf '%-16s skipped: %d s left of QUANTD_DEVICE_SECONDS=%d\n' "$name" "$((budget - SECONDS))" \
      "$budget" | tee -a "$summary"
    return
  fi
  if declare -F "$1" > /dev/null; then
    # timeout runs programs, not shell functions: a function step runs in a child bash.
    export -f "$1"
    export build
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" > "$out/$name.log" 2>&1
  else
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  fi
  local rc=$?
  ((rc == 0)) || failed=1
  printf '%-16s rc %3d  %4d s\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$summary"
}
failed=0

unit_cuda() {
  local rc=0 t
  for t in "cuda_backend_test:*" "gemm_test:Cublas*" "v4_cuda_blocks_test:*" \
           "backend_test:*" "device_test:*" "v4_cuda_moe_test:*" \
           "v4_cuda_attention_test:*"; do
    local bin="$build/tests/${t%%:*}"
    echo "== $bin --gtest_filter=${t#*:}"
    "$bin" --gtest_filter="${t#*:}" --gtest_brief=1 || rc=1
  done
  return $rc
}

cuda_layer() {
  "$build/tests/v4_cuda_cast_test" --gtest_brief=1 &&
    "$build/tests/v4_cuda_ops_test" --gtest_brief=1 && "$build/tests/v4_cuda_layer_test"
}
if [[ "${QUANTD_DEVICE_CHECKS:-full}" == short ]]; then
  step unit_cuda 120 unit_cuda
  step cuda_layer 60 cuda_layer
  exit $failed
fi
step gpu 30 nvidia-smi
step unit_cuda 120 unit_cuda
step cuda_layer 60 cuda_layer
step forward_cuda 90 "$build/tests/bench/quantd_v4_forward_bench" --dir "$scratch" --table cuda
step forward_cublas 120 "$build/tests/bench/quantd_v4_forward_bench" --dir "$scratch" \
  --table cublas
step kernels_bench 150 tests/bench/run_kernels_bench.sh "$build/tests/bench/quantd_kernels_bench"
step forward_cpu 120 "$build/tests/bench/quantd_v4_forward_bench" --dir "$scratch" \
  --table small4
cat "$summary"
exit $failed
