"""The native tokenizer against the `tokenizers` library (PyPI) on the real DeepSeek tokenizer
(tests/data/deepseek_v3_tokenizer): the same ids for 5,000+ varied strings, --decode gives the
strings back, chat rendering tokenizes as its documented text, and bad input is a clear error."""

import json
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tokenizer_corpus import corpus

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "tests" / "data" / "deepseek_v3_tokenizer"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def library():
    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


def tokenize(qd, lines, *flags, input_bytes=None):
    """Runs `quantd tokenize`; returns the CompletedProcess (stdout as text)."""
    data = input_bytes if input_bytes is not None else "".join(l + "\n" for l in lines).encode()
    proc = subprocess.run([qd.quantd, "tokenize", "--tokenizer", str(TOKENIZER_DIR), *flags],
                          input=data, capture_output=True, timeout=300)
    proc.stdout = proc.stdout.decode()
    proc.stderr = proc.stderr.decode()
    return proc


def tokenize_ok(qd, lines, *flags):
    proc = tokenize(qd, lines, *flags)
    assert proc.returncode == 0, proc.stderr
    # Lines end at "\n" only: decoded text may hold U+2028 or U+0085, which splitlines() splits at.
    out = [json.loads(l) for l in proc.stdout.split("\n")[:-1]]
    assert len(out) == len(lines)
    return out


@pytest.fixture(scope="module")
def strings():
    s = corpus()
    assert len(s) >= 5000
    return s


@pytest.fixture(scope="module")
def our_ids(qd, strings):
    return tokenize_ok(qd, [json.dumps(s) for s in strings])


def test_ids_equal_the_library_on_5000_strings(library, strings, our_ids):
    mismatches = []
    for s, ours in zip(strings, our_ids):
        expected = library.encode(s, add_special_tokens=False).ids
        if ours != expected:
            mismatches.append((s, expected, ours))
    assert not mismatches, f"{len(mismatches)} of {len(strings)} differ; first: {mismatches[0]!r}"
    # The corpus reaches the special tokens, multi-token words and long runs.
    all_ids = {i for ids in our_ids for i in ids}
    assert {0, 1, 128803, 128804} <= all_ids  # BOS, EOS, <｜User｜>, <｜Assistant｜>
    assert sum(len(ids) for ids in our_ids) > 100_000


def test_add_special_tokens_applies_the_post_processor(qd, library, strings):
    sample = strings[:200]
    ours = tokenize_ok(qd, [json.dumps(s) for s in sample], "--add-special-tokens")
    assert ours == [library.encode(s, add_special_tokens=True).ids for s in sample]


def test_decode_round_trips(qd, library, strings, our_ids):
    decoded = tokenize_ok(qd, [json.dumps(ids) for ids in our_ids], "--decode")
    assert decoded == strings
    for ids, text in zip(our_ids[:500], decoded):
        assert text == library.decode(ids, skip_special_tokens=False)


def test_decode_of_a_split_character_is_the_replacement_character(qd, library):
    ids = library.encode("😀", add_special_tokens=False).ids
    assert len(ids) > 1  # the emoji's four bytes are not one token
    partial = ids[:1]
    (text,) = tokenize_ok(qd, [json.dumps(partial)], "--decode")
    assert text == library.decode(partial, skip_special_tokens=False)
    assert text == "\ufffd"


def test_chat_renders_the_documented_text(qd, library):
    messages = [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"},
         {"role": "assistant", "content": "Hi"}],
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4", "reasoning_content": "two and two"}],
    ]
    texts = [
        f"{BOS}S<｜User｜>hello<｜Assistant｜></think>Hi{EOS}",
        f"{BOS}<｜User｜>2+2?<｜Assistant｜><think>two and two</think>4{EOS}",
    ]
    ours = tokenize_ok(qd, [json.dumps(m) for m in messages], "--chat")
    assert ours == [library.encode(t, add_special_tokens=False).ids for t in texts]
    assert ours[0][0] == 0 and ours[0][-1] == 1


def test_invalid_utf8_is_a_clear_error(qd):
    proc = tokenize(qd, None, input_bytes=b'"fine"\n"caf\xc3"\n"never read"\n')
    assert proc.returncode == 1
    assert proc.stdout == "[86453]\n"
    assert proc.stderr == "quantd tokenize: stdin line 2: not valid UTF-8 (byte 4)\n"


@pytest.mark.parametrize("line,flags,message", [
    ("[1, 2", (), "not valid JSON"),
    ("42", (), "must be a JSON string"),
    ('"text"', ("--chat",), "'messages' must be a non-empty array"),
    ('[{"role": "tool", "content": "x"}]', ("--chat",),
     'messages[0].role must be "system", "user" or "assistant"'),
    ("[99999999]", ("--decode",), "id 99999999 (position 0) has no token in this tokenizer"),
    ('"x"', ("--decode",), "must be a JSON array of token ids"),
])
def test_bad_lines_name_the_line(qd, line, flags, message):
    proc = tokenize(qd, ['"ok"' if "--decode" not in flags else "[1]", line], *flags) \
        if "--chat" not in flags else tokenize(qd, [line], *flags)
    assert proc.returncode == 1
    number = 1 if "--chat" in flags else 2
    assert proc.stderr == f"quantd tokenize: stdin line {number}: {message}\n"


def test_missing_tokenizer_is_a_usage_error(qd, tmp_path):
    proc = subprocess.run([qd.quantd, "tokenize", "--tokenizer", str(tmp_path)],
                          input=b"", capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert str(tmp_path / "tokenizer.json") in proc.stderr.decode()


def test_fixture_tokenizer_equals_the_library(qd, v4_fixture, strings):
    """mkfixture ships a cut-down DeepSeek tokenizer (one token per byte): the library loads it and
    gives the ids quantd gives, every id inside the fixture's vocabulary of 1024."""
    library = Tokenizer.from_file(str(v4_fixture / "tokenizer.json"))
    sample = strings[:1000]
    proc = subprocess.run([qd.quantd, "tokenize", "--tokenizer", str(v4_fixture)],
                          input="".join(json.dumps(s) + "\n" for s in sample).encode(),
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    ours = [json.loads(l) for l in proc.stdout.decode().split("\n")[:-1]]
    expected = [library.encode(s, add_special_tokens=False).ids for s in sample]
    assert ours == expected
    assert max(max(ids, default=0) for ids in ours) < 1024
    chat = f"{BOS}S<｜User｜>hello<｜Assistant｜></think>Hi{EOS}"
    assert library.encode(chat, add_special_tokens=False).ids == (
        [0, 3 + ord("S"), 259] + [3 + b for b in b"hello"] + [260] + [3 + b for b in b"</think>Hi"]
        + [1])
