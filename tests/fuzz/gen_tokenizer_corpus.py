#!/usr/bin/env python3
"""Writes the seed corpus of the tokenizer.json fuzzer (small valid byte-level BPE tokenizers in
the shape of DeepSeek's) into tests/fuzz/tokenizer_corpus/. The files are committed; rerun only
when the seeds change."""
import json
import pathlib


def byte_level_alphabet():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def tokenizer(pre_tokenizers, post_processor=None, normalizer=None, merges_as_lists=False):
    chars = byte_level_alphabet()
    vocab = {chars[b]: b for b in range(256)}
    pairs = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]
    for a, b in pairs:
        vocab.setdefault(a + b, len(vocab))
    merges = [[a, b] if merges_as_lists else f"{a} {b}" for a, b in pairs]
    return {
        "version": "1.0",
        "added_tokens": [
            {"id": len(vocab), "content": "<s>", "special": True, "normalized": False,
             "lstrip": False, "rstrip": False, "single_word": False},
            {"id": len(vocab) + 1, "content": "<｜User｜>", "special": False, "normalized": True,
             "lstrip": False, "rstrip": False, "single_word": False},
        ],
        "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }


DEEPSEEK_SPLITS = [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
    {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": False},
    {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": False},
]
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
TEMPLATE = {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [261], "tokens": ["<s>"]}}}

SEEDS = {
    "deepseek_like": tokenizer(DEEPSEEK_SPLITS + [BYTE_LEVEL], {"type": "ByteLevel"},
                               {"type": "Sequence", "normalizers": []}),
    "gpt2_like": tokenizer([{"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}], TEMPLATE,
                           merges_as_lists=True),
    "behaviours": tokenizer([
        {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
        {"type": "Split", "pattern": {"Regex": "l+"}, "behavior": "Contiguous", "invert": True},
        BYTE_LEVEL], {"type": "Sequence", "processors": [{"type": "ByteLevel"}, TEMPLATE]},
        {"type": "Sequence", "normalizers": [{"type": "Replace", "pattern": {"String": "x"}, "content": "y"},
                                             {"type": "Prepend", "prepend": "▁"}]}),
}

out = pathlib.Path(__file__).resolve().parent / "tokenizer_corpus"
out.mkdir(exist_ok=True)
for name, seed in SEEDS.items():
    (out / f"{name}.json").write_text(json.dumps(seed, ensure_ascii=False))
