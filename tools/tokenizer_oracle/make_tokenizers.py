#!/usr/bin/env python3
"""Writes small tokenizer.json files covering the pipelines specd's tokenizer supports.

The vocabularies come from a tiny deterministic BPE trainer run on an embedded corpus, so
the files are reproducible without downloads. Which tokens the merges make does not matter
for the tests: specd must reproduce whatever the Hugging Face `tokenizers` library does with
the same file (tools/tokenizer_oracle/oracle.js computes that).

Usage: python3 tools/tokenizer_oracle/make_tokenizers.py OUT_DIR
  writes OUT_DIR/hfnode_<name>/tokenizer.json and OUT_DIR/hfnode_<name>/strings.json
"""
import collections
import json
import os
import random
import re
import sys

CORPUS = """
The quick brown fox jumps over the lazy dog. I'M sure it's what we'd do; they'll see, we've won.
Don't stop: isn't it 2024 already? Prices rose 12.5% to $1,234,567.89 in Q3 (up from 987).
def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text if not c.isspace()]  # comment
class Foo(Bar):
    def __init__(self, x=42, y=None):
        self.x, self.y = x, y
        if x >= 10 and y is not None:\r\n            print(f"{x!r} -> {y}")
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }   // dot product
SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name;
中文分词是自然语言处理的基础任务。我们今天去北京天安门。
日本語のテキストも少し含めます。東京は大きい都市です。
한국어 문장도 조금 넣습니다. 안녕하세요 여러분.
Русский текст тоже нужен: привет, мир! Ελληνικά γράμματα. עברית. العربية ١٢٣.
Emoji: 😀 😃 👍🏽 👨‍👩‍👧 🇫🇷 ❤️ ✨ — naïve café résumé Ångström ﬁnance ½ ² Ⅻ.
    indented    with    tabs\tand\tspaces   \n\n\n   trailing   
""".strip()


def byte_level_map():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_MAP = byte_level_map()


def train(words, n_merges, base_symbols):
    """Greedy BPE over word -> frequency; ties broken by the pair's text for determinism."""
    vocab = {}
    for s in base_symbols:
        vocab.setdefault(s, len(vocab))
    seqs = {w: list(w) for w in words}
    merges = []
    for _ in range(n_merges):
        counts = collections.Counter()
        for w, f in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                counts[(a, b)] += f
        if not counts:
            break
        (a, b), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
        for w in words:
            s = seqs[w]
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return vocab, merges


def words_of(text, mapper):
    # Rough pre-tokenization for training only.
    pieces = re.findall(r" ?\w+| ?[^\w\s]+|\s+", text)
    return collections.Counter(mapper(p) for p in pieces)


def byte_level_word(p):
    return "".join(BYTE_MAP[b] for b in p.encode("utf-8"))


def added(id_, content, special=True, lstrip=False, rstrip=False, single_word=False,
          normalized=None):
    return {"id": id_, "content": content, "single_word": single_word, "lstrip": lstrip,
            "rstrip": rstrip, "normalized": (not special) if normalized is None else normalized,
            "special": special}


def bpe_model(vocab, merges, legacy_merges, **kw):
    m = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
         "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
         "ignore_merges": False, "vocab": vocab,
         "merges": [f"{a} {b}" for a, b in merges] if legacy_merges else [[a, b] for a, b in merges]}
    m.update(kw)
    return m


def tokenizer(model, normalizer=None, pre=None, post=None, decoder=None, added_tokens=()):
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": list(added_tokens), "normalizer": normalizer,
            "pre_tokenizer": pre, "post_processor": post, "decoder": decoder, "model": model}


GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level_tok(n_merges, legacy):
    words = words_of(CORPUS, byte_level_word)
    return train(words, n_merges, [BYTE_MAP[b] for b in range(256)])


def template(bos, bos_id):
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def sentencepiece_vocab(n_merges):
    words = words_of(CORPUS.replace(" ", "\u2581"), lambda p: "\u2581" + p.strip("\u2581"))
    chars = sorted({c for w in words for c in w})
    base = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + chars
    return train(words, n_merges, base)


def build_all():
    out = {}
    # GPT-2: ByteLevel pre-tokenizer with its built-in regex, legacy "a b" merges.
    v, m = byte_level_tok(500, True)
    eot = len(v)
    out["gpt2"] = tokenizer(
        bpe_model(v, m, legacy_merges=True),
        pre={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        post={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        decoder={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        added_tokens=[added(eot, "<|endoftext|>")])
    v2 = dict(v)
    v2["<|endoftext|>"] = eot
    out["gpt2"]["model"]["vocab"] = v2

    # GPT-2 style with add_prefix_space and [a, b] merges.
    out["gpt2_prefix"] = tokenizer(
        bpe_model(v, m, legacy_merges=False),
        pre={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        decoder={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True})

    # Llama-3: Split(regex) + ByteLevel(use_regex=false), ignore_merges, BOS template.
    v, m = byte_level_tok(700, False)
    n = len(v)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    toks = [added(n + i, s) for i, s in enumerate(specials)]
    out["llama3"] = tokenizer(
        bpe_model(v, m, legacy_merges=False, ignore_merges=True),
        pre={"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        post={"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            template("<|begin_of_text|>", n)]},
        decoder={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        added_tokens=toks)

    # Qwen2: NFC normalizer, Split(regex) + ByteLevel, legacy merges, chat specials.
    v, m = byte_level_tok(600, True)
    n = len(v)
    toks = [added(n, "<|endoftext|>"), added(n + 1, "<|im_start|>"), added(n + 2, "<|im_end|>"),
            added(n + 3, "<tool_call>", special=False, normalized=False)]
    out["qwen2_nfc"] = tokenizer(
        bpe_model(v, m, legacy_merges=True),
        normalizer={"type": "NFC"},
        pre={"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        post={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        decoder={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        added_tokens=toks)

    # Llama-2 / SentencePiece legacy: Prepend + Replace normalizer, byte fallback, fused unk.
    v, m = sentencepiece_vocab(500)
    sp_added = [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")]
    out["sp_llama2"] = tokenizer(
        bpe_model(v, m, legacy_merges=True, unk_token="<unk>", fuse_unk=True, byte_fallback=True),
        normalizer={"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        post=template("<s>", 1),
        decoder={"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        added_tokens=sp_added)

    # Metaspace pre-tokenizer, prepend_scheme "first", no split (newer Llama/Mistral files).
    out["metaspace_first"] = tokenizer(
        bpe_model(v, m, legacy_merges=False, unk_token="<unk>", byte_fallback=True),
        pre={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
        decoder={"type": "Sequence", "decoders": [
            {"type": "ByteFallback"},
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}]},
        added_tokens=sp_added)

    # Metaspace with split and prepend "always"; a byte-fallback-free unk model.
    out["metaspace_split"] = tokenizer(
        bpe_model({k: i for k, i in v.items()}, m, legacy_merges=True, unk_token="<unk>"),
        pre={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        decoder={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        added_tokens=sp_added)

    # Added-token flags: lstrip, rstrip, single_word, normalized, non-special.
    v, m = byte_level_tok(300, True)
    n = len(v)
    toks = [added(n, "<mask>", lstrip=True), added(n + 1, "<sep>", rstrip=True),
            added(n + 2, "cat", special=False, single_word=True),
            added(n + 3, "[NL]", special=False, lstrip=True, rstrip=True),
            added(n + 4, " hello", special=False, normalized=True),
            added(n + 5, "<|x|>"), added(n + 6, "<|x|><|y|>")]
    out["added_flags"] = tokenizer(
        bpe_model(v, m, legacy_merges=True),
        pre={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        decoder={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        added_tokens=toks)
    return out


HARD = [
    "", " ", "  ", "   x", "\n", "\n\n  x", "a  b", "a \n b", "x   ", "trailing spaces   ",
    "\t\tindent", "\r\n\r\n", " \r\n x", "I'M", "I'm", "you'RE", "they'LL", "we'VE", "it'S",
    "she'd", "'s", "'sup", "don't", "'", "''", "12345", "1234567", "3.14159", "x2y3z4",
    "١٢٣٤", "²³", "ⅫⅣ", "中文分词", "日本語のテキスト", "한국어", "😀", "👍🏽", "👨‍👩‍👧",
    "🇫🇷", "e\u0301", "a\u0308\u0323", "\u0301start", "Å", "A\u030a", "ſ", "'ſ", "\u00a0x",
    "\u3000y", "x\u2028y", "\u200bz", "ﬁ", "Hello world", " Hello", "Hello, World!",
    "  leading", "<|endoftext|>", "a<|endoftext|>b", "<s>Hello</s>", " <s> x", "<unk>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|im_start|>system\nYou are<|im_end|>", "the <mask> sat", "a<sep>  b", "cat", "cats",
    "a cat.", "concat", "x [NL] y", "say hello there", "<|x|><|y|>", "<|x|><|x|>",
    "def f(x):\n    return x**2\n", "((()))", "...", "!!!???", "#include <stdio.h>",
    "C:\\path\\to", "tab\there", "mixed中文and English", "Ωmega ω", "ǅemal", "ÅNGSTRÖM",
    "\ufeffBOM", "\x00 nul \x7f del \x1b[0m", "max \U0010ffff and \uffff", "C1 \x85 \x9f",
    "mojibake \u00c3\u00a9 \u00e2\u20ac\u2122", "keycap 1\ufe0f\u20e3",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35", "\u0645\u0631\u062d\u0628\u0627",
    "word\u2019s", "\u2460\u2461 \u00bd", "o\u0302\u0323 \u1ed9", "\u1100\u1161\u11a8",
    "\ufffd", "x" * 300, " " * 50 + "y", "\n" * 20,
]

FRAGMENTS = [
    "Hello", " world", "I", "'M", "'s", "'S", "'ll", "'d", "don't", " ", "  ", "   ", "\n",
    "\n\n", "\r\n", "\t", "12345", "7", "3.14", "١٢", "²", "Ⅻ", "中文", "日本", "한국",
    "😀", "👍🏽", "👨‍👩‍👧", "e\u0301", "a\u0308", "\u0323", "Å", "ſ", "\u00a0", "\u3000",
    "\u2028", "\u200b", "ﬁ", "#", "...", "!!", "(x)", "_", "-", "=>", "the", " the", "ing",
    "café", "naïve", "Ωmega", "<|endoftext|>", "<s>", "</s>", "<unk>", "<|im_start|>",
    "<|eot_id|>", "<mask>", "<sep>", "cat", "[NL]", " hello", "<|x|>", "<|y|>", "\u2581",
    "▁▁", "<0x41>", "def", "return", "{", "}", ";", "\"", "'",
]


def strings_for(rng):
    out = list(HARD)
    for _ in range(220):
        k = rng.randint(1, 10)
        out.append("".join(rng.choice(FRAGMENTS) for _ in range(k)))
    return out


def main():
    out_dir = sys.argv[1]
    for name, tok in build_all().items():
        d = os.path.join(out_dir, "hfnode_" + name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tok, f, ensure_ascii=False, indent=1)
        rng = random.Random(sum(map(ord, name)))
        with open(os.path.join(d, "strings.json"), "w", encoding="utf-8") as f:
            json.dump(strings_for(rng), f, ensure_ascii=False)


if __name__ == "__main__":
    main()
