#!/usr/bin/env bash
# Configures a clang build in BUILD_DIR, builds the libFuzzer targets (safetensors header, job
# spec, gRPC requests, tokenizer.json) and runs each for SECONDS. Exits non-zero when the fuzzer finds a crash (the input is left in
# BUILD_DIR/fuzz-work/artifacts/).
#
# Usage: tests/fuzz/run_fuzz.sh BUILD_DIR SECONDS
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 BUILD_DIR SECONDS" >&2
  exit 2
fi
build_dir=$1
seconds=$2
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

cmake -G Ninja -S "$src" -B "$build_dir" \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DQUANTD_FUZZ=ON -DQUANTD_CUDA=OFF -DQUANTD_BENCH=OFF >/dev/null
ninja -C "$build_dir" safetensors_header_fuzz

# New inputs go to a scratch corpus; the committed seeds are only read.
work=$build_dir/fuzz-work
mkdir -p "$work/corpus" "$work/artifacts"
"$build_dir/tests/fuzz/safetensors_header_fuzz" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -print_final_stats=1 \
  -dict="$src/tests/fuzz/safetensors.dict" -artifact_prefix="$work/artifacts/" \
  "$work/corpus" "$src/tests/fuzz/corpus"

# The job spec JSON parser and the gRPC request handlers, SECONDS each, with the same layout:
# committed seeds in tests/fuzz/corpus-NAME, new inputs in BUILD_DIR/fuzz-work/NAME.
run_target() {
  local target=$1 corpus=$2
  shift 2
  ninja -C "$build_dir" "$target"
  mkdir -p "$work/$corpus"
  "$build_dir/tests/fuzz/$target" \
    -max_total_time="$seconds" -timeout=30 -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/" "$@" "$work/$corpus" "$src/tests/fuzz/corpus-$corpus"
}
run_target job_spec_fuzz job-spec -max_len=4096 -dict="$src/tests/fuzz/job_spec.dict"
# Each run's job store and job paths stay under the work dir (the last run's are dropped).
rm -rf "$work"/grpc-fuzz-*
QUANTD_FUZZ_SCRATCH=$work run_target grpc_request_fuzz grpc-requests -max_len=2048
# The tokenizer.json loader, seeded with small DeepSeek-shaped tokenizers.
run_target tokenizer_json_fuzz tokenizer -max_len=8192 -rss_limit_mb=2048
