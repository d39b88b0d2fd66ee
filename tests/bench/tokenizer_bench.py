"""Single-thread tokenizer throughput, quantd against the `tokenizers` library, on the same corpus
in the same run: the oracle strings of tests/interop/tokenizer_corpus.py plus the prose of the
built-in calibration data. Prints one line per tokenizer and the ratio.

Usage: tokenizer_bench.py BUILD_DIR [PASSES]   (run by tests/bench/run_tokenizer_bench.sh)
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"  # before `tokenizers` starts its thread pool
os.environ["TOKENIZERS_PARALLELISM"] = "false"

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "interop"))

from tokenizer_corpus import corpus, write_jsonl  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

TOKENIZER_DIR = REPO / "tests" / "data" / "deepseek_v3_tokenizer"


def calibration_texts():
    texts = []
    with open(REPO / "tests" / "data" / "calibration_sample.jsonl", encoding="utf-8") as f:
        for line in f:
            sample = json.loads(line)
            if "text" in sample:
                texts.append(sample["text"])
            else:
                texts += [m["content"] for m in sample["messages"]]
    return texts


def main():
    build = Path(sys.argv[1])
    passes = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    strings = corpus() + calibration_texts()
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))

    def run_library(encode_all):
        encode_all()  # warm-up, as quantd's tool does
        tokens, start = 0, time.perf_counter()
        for _ in range(passes):
            tokens += encode_all()
        return tokens, time.perf_counter() - start

    one = lambda: sum(len(tok.encode(s, add_special_tokens=False).ids) for s in strings)  # noqa: E731
    batch = lambda: sum(len(e.ids) for e in tok.encode_batch(strings, add_special_tokens=False))  # noqa: E731
    lib_tokens, lib_seconds = run_library(one)
    batch_tokens, batch_seconds = run_library(batch)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        write_jsonl(strings, path)
        out = subprocess.run([str(build / "tests" / "interop" / "quantd_tokenizer_bench"),
                              str(TOKENIZER_DIR), str(path), str(passes)],
                             check=True, capture_output=True, text=True).stdout
    ours = json.loads(out)
    assert ours["tokens"] == lib_tokens == batch_tokens, (ours["tokens"], lib_tokens, batch_tokens)

    chars = sum(len(s) for s in strings) * passes
    print(f"corpus: {len(strings)} strings, {chars // passes} characters, {lib_tokens // passes} "
          f"tokens; {passes} timed passes, one thread")
    print(f"quantd                          {ours['tokens_per_second']:>12,.0f} tokens/s")
    print(f"tokenizers encode() per string  {lib_tokens / lib_seconds:>12,.0f} tokens/s")
    print(f"tokenizers encode_batch()       {batch_tokens / batch_seconds:>12,.0f} tokens/s")
    print(f"quantd / tokenizers: {ours['tokens_per_second'] / (lib_tokens / lib_seconds):.2f}x "
          f"(per string), {ours['tokens_per_second'] / (batch_tokens / batch_seconds):.2f}x (batch)")


if __name__ == "__main__":
    main()
