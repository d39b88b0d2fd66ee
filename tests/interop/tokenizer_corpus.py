"""Deterministic test strings for the tokenizer oracle (test_tokenizer_peer.py) and the tokenizer
benchmark (tests/bench/run_tokenizer_bench.sh): each string joins a few fragments drawn from the
kinds of text a byte-level BPE tokenizer has to get right."""

import json
import random

WORDS = (
    "the quick brown fox jumps over lazy dog model weights quantize calibration layer expert "
    "attention tensor scale block of and to in is was it that for on with as at by from "
    "Hello World Transformer DeepSeek NVIDIA Aachen O'Brien don't we're they'll I'd it's "
    "café naïve façade Zürich Ærøskøbing São Paulo"
).split()

CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    '{"key": [1, 2.5, -3e10], "ok": true, "s": "a\\"b"}',
    "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "x=>x+1; y != z && w || !v; a::b->c",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
    "    if err != nil {\n        return fmt.Errorf(\"wrap: %w\", err)\n    }",
]

CJK = [
    "你好，世界！", "量化模型需要校准数据。", "深度求索", "こんにちは", "カタカナとひらがな",
    "東京都", "안녕하세요", "한국어 문장입니다.", "漢字かな混じり文", "中文English混合",
]

EMOJI = [
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇩🇪🇯🇵", "❤️", "🧑🏿‍💻", "✈️", "👩‍❤️‍💋‍👨", "🫠", "1️⃣", "©️",
]

UNUSUAL = [
    "e\u0301", "\u0915\u094d\u0937", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629", "\u05e9\u05dc\u05d5\u05dd",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35", "\U0001d518\U0001d52b\U0001d526", "\ufffd", "\ufeff", "\ue000",
    "\ufdd0", "\uffff", "\U0010fffd", "\x00", "\x07", "\x1b[0m", "\x7f", "\u00a0", "\u200b",
    "\u200d", "\u2028", "\u2029", "\u0085", "\u3000", "\u180e", "\u00ad", "\u2060", "\u00bd",
    "\u2153", "\u0660\u0661\u0662", "\u096a\u096b", "\uff11\uff12", "\u2460", "\u00b2", "\u216b",
    "\u0130", "\u03a3\u03c3\u03c2", "\u0410\u0411\u0412", "\u1e9e", "\u0149",
]

SPECIALS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁sep｜>", "<｜fim▁hole｜>", "<｜place▁holder▁no▁7｜>", "<｜▁pad▁｜>",
    # near misses: not tokens
    "<｜User", "｜Assistant｜>", "<｜end▁of▁sentence", "<|User|>", "<think>", "</think>",
]

WHITESPACE = [" ", "  ", "    ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\n\n\n\n", " " * 17,
              "\t \t", "\u00a0\u00a0", "\u3000", "\r", "\x0b", "\x0c"]


def _number(rng):
    kind = rng.randrange(5)
    if kind == 0:
        return str(rng.randrange(10 ** rng.randrange(1, 40)))
    if kind == 1:
        return f"{rng.uniform(-1e6, 1e6):.{rng.randrange(0, 8)}f}"
    if kind == 2:
        return f"{rng.randrange(1, 10 ** 9):,}"
    if kind == 3:
        return f"{rng.random():e}"
    return "".join(rng.choice("0123456789") for _ in range(rng.randrange(1, 80)))


def _fragment(rng):
    kind = rng.randrange(9)
    if kind == 0:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12))) + rng.choice(
            ["", ".", "!", "?", ",", ";", ":", "...", " —", "\""])
    if kind == 1:
        return rng.choice(CODE)
    if kind == 2:
        return rng.choice(CJK)
    if kind == 3:
        return "".join(rng.choice(EMOJI) for _ in range(rng.randrange(1, 4)))
    if kind == 4:
        return _number(rng)
    if kind == 5:
        return rng.choice(WHITESPACE)
    if kind == 6:
        return "".join(rng.choice(UNUSUAL) for _ in range(rng.randrange(1, 4)))
    if kind == 7:
        return rng.choice(SPECIALS)
    # random code points from assigned, long-stable blocks
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x9FA5),
              (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x2000, 0x206F), (0x1F300, 0x1F5FF)]
    lo, hi = rng.choice(ranges)
    return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randrange(1, 10)))


def corpus(count=5000, seed=20261201):
    """`count` strings, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        pieces = [_fragment(rng) for _ in range(rng.randrange(1, 9))]
        sep = rng.choice(["", " ", "\n", ""])
        out.append(sep.join(pieces))
    # Edge cases every run covers.
    out += ["", " ", "\n", "a", "0", "1234", " " * 1000, "\n" * 300, "a" * 5000, "9" * 1000,
            "<｜User｜><｜User｜>", "😀" * 200, "\t" * 64 + "x"]
    return out


def write_jsonl(strings, path):
    with open(path, "w", encoding="utf-8") as f:
        for s in strings:
            f.write(json.dumps(s) + "\n")
