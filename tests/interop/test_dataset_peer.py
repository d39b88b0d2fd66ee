"""`quantd dataset` on the built-in calibration data: the stored token ids of every selected sample
equal what the `tokenizers` library gives for that line (BOS + text, or the DeepSeek chat
rendering), truncated to seq_len; the report's counts and checksum match the file; a bad data set
is a clear error naming file and line."""

import hashlib
import json
import subprocess
from pathlib import Path

from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "tests" / "data" / "deepseek_v3_tokenizer"
SAMPLE = REPO / "tests" / "data" / "calibration_sample.jsonl"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def render(messages):
    """DeepSeek encode_messages for system/user/assistant turns (server/tokenizer/chat_encoding.h)."""
    thinking = any(m["role"] == "assistant" and m.get("reasoning_content") for m in messages)
    out, i = BOS, 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "system":
            out += m["content"]
        elif m["role"] == "user":
            out += "<｜User｜>" + m["content"]
            while i + 1 < len(messages) and messages[i + 1]["role"] == "user":
                i += 1
                out += "\n\n" + messages[i]["content"]
            if i + 1 == len(messages) or messages[i + 1]["role"] == "assistant":
                out += "<｜Assistant｜>" + ("<think>" if thinking else "</think>")
        else:
            if thinking:
                out += m.get("reasoning_content", "") + "</think>"
            out += m["content"] + EOS
        i += 1
    return out


def run_dataset(qd, tmp_path, calibration):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"source": str(TOKENIZER_DIR), "output": str(tmp_path / "out"),
                                "calibration": calibration}))
    out = tmp_path / "tokens.jsonl"
    proc = subprocess.run([qd.quantd, "dataset", "--spec", str(spec), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    return proc, out


def test_selected_tokens_equal_the_library(qd, tmp_path):
    proc, out = run_dataset(qd, tmp_path, {"datasets": [{"path": str(SAMPLE), "samples": 40}],
                                           "seq_len": 96, "seed": 3})
    assert proc.returncode == 0, proc.stderr
    library = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    lines = SAMPLE.read_text(encoding="utf-8").split("\n")
    stored = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(stored) == 40 and len({s["line"] for s in stored}) == 40
    for s in stored:
        sample = json.loads(lines[s["line"] - 1])
        if "text" in sample:
            expected = [0] + library.encode(sample["text"], add_special_tokens=False).ids
        else:
            expected = library.encode(render(sample["messages"]), add_special_tokens=False).ids
        assert s["input_ids"] == expected[:96], s["line"]
        assert s["source"] == str(SAMPLE)
    report = proc.stdout.splitlines()
    assert report[0].startswith(f"{SAMPLE}: 44 samples, 40 selected, 0 skipped (under 16 tokens), ")
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert report[-1] == f"wrote {out} (sha256 {digest})"
    total = sum(len(s["input_ids"]) for s in stored)
    assert report[1].startswith(f"total: 40 samples, {total} tokens")


def test_bad_data_set_names_file_and_line(qd, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"prompt": "no sample field"}\n')
    proc, out = run_dataset(qd, tmp_path, {"dataset": str(bad), "num_samples": 1})
    assert proc.returncode == 1
    assert proc.stderr == (f"quantd dataset: {bad}:2: a sample needs one of 'text', 'messages', "
                           "'input_ids'\n")
    assert not out.exists()
