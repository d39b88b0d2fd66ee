#!/usr/bin/env bash
# Configures a clang build in BUILD_DIR, builds the safetensors header fuzzer and runs it for
# SECONDS. Exits non-zero when the fuzzer finds a crash (the input is left in
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

# The tokenizer.json loader, for the same time, seeded with small DeepSeek-shaped tokenizers.
ninja -C "$build_dir" tokenizer_json_fuzz
mkdir -p "$work/tokenizer_corpus"
"$build_dir/tests/fuzz/tokenizer_json_fuzz" \
  -max_total_time="$seconds" -max_len=8192 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$work/artifacts/tokenizer-" \
  "$work/tokenizer_corpus" "$src/tests/fuzz/tokenizer_corpus"
