"""Encoding with a byte-level BPE tokenizer.json in pure Python (plus the `regex` module for
\\p{L} / \\p{N}), for machines without the `tokenizers` package (Debian 12). It covers the
structure of the reference models' tokenizer and of GPT-2 / Llama-3 style ones: added tokens
split out first (leftmost, longest), then a Split pre-tokenizer with a regex (behaviour
Isolated) followed by ByteLevel(use_regex=false), or ByteLevel(use_regex=true) alone; BPE with
or without ignore_merges; no normalizer. Merges follow the `tokenizers` library's order (lowest
rank first, leftmost among equal ranks, re-evaluated after each merge), so ids match it exactly;
tests/tools/test_eagle_oracle.py checks that on the library's own encodings in
tests/fixtures/tokenizers.
"""

import heapq
import json

import regex

GPT2_PATTERN = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def bytes_to_unicode():
    """GPT-2's byte -> printable character map."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


class ByteLevelBPE:
    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            t = json.load(f)
        if t.get("normalizer") is not None:
            raise ValueError(f"{path}: normalizers are not supported")
        model = t["model"]
        if model.get("type") != "BPE" or model.get("byte_fallback"):
            raise ValueError(f"{path}: only byte-level BPE without byte fallback is supported")
        self.vocab = model["vocab"]
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
                  for m in model["merges"]]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.ignore_merges = bool(model.get("ignore_merges"))
        self.pattern = regex.compile(self._pattern(t["pre_tokenizer"], path))
        self.byte_map = bytes_to_unicode()
        self.added = {a["content"]: a["id"] for a in t.get("added_tokens", [])}
        self.added_re = (regex.compile("|".join(regex.escape(a) for a in
                                                sorted(self.added, key=len, reverse=True)))
                         if self.added else None)
        self.cache = {}

    @staticmethod
    def _pattern(pre, path):
        if pre["type"] == "ByteLevel" and pre.get("use_regex", True):
            return GPT2_PATTERN
        if pre["type"] == "Sequence":
            steps = pre["pretokenizers"]
            if (len(steps) == 2 and steps[0]["type"] == "Split"
                    and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
                    and steps[1]["type"] == "ByteLevel" and not steps[1].get("use_regex", True)
                    and not steps[1].get("add_prefix_space")):
                return steps[0]["pattern"]["Regex"]
        raise ValueError(f"{path}: pre-tokenizer {pre['type']} is not supported")

    def _bpe(self, word):
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        syms = list(word)
        nxt = list(range(1, len(syms))) + [-1]
        prv = list(range(-1, len(syms) - 1))
        heap = []
        for i in range(len(syms) - 1):
            r = self.ranks.get((syms[i], syms[i + 1]))
            if r is not None:
                heap.append((r, i))
        heapq.heapify(heap)
        while heap:
            r, i = heapq.heappop(heap)
            j = nxt[i] if syms[i] is not None else -1
            if j < 0 or self.ranks.get((syms[i], syms[j])) != r:
                continue  # stale: a neighbour merged since this pair was queued
            syms[i] += syms[j]
            syms[j] = None
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prv[nxt[j]] = i
            for a, b in ((prv[i], i), (i, nxt[i])):
                if a >= 0 and b >= 0:
                    rr = self.ranks.get((syms[a], syms[b]))
                    if rr is not None:
                        heapq.heappush(heap, (rr, a))
        return [self.vocab[s] for s in syms if s is not None]

    def _encode_plain(self, text, out):
        pos = 0
        pieces = []
        for m in self.pattern.finditer(text):
            if m.start() > pos:
                pieces.append(text[pos:m.start()])
            pieces.append(m.group())
            pos = m.end()
        if pos < len(text):
            pieces.append(text[pos:])
        for piece in pieces:
            ids = self.cache.get(piece)
            if ids is None:
                word = "".join(self.byte_map[b] for b in piece.encode("utf-8"))
                ids = self._bpe(word)
                if len(self.cache) < 1 << 20:
                    self.cache[piece] = ids
            out.extend(ids)

    def encode(self, text):
        """Token ids of `text` (no special tokens added; those inside the text are split out)."""
        out = []
        pos = 0
        if self.added_re is not None:
            for m in self.added_re.finditer(text):
                self._encode_plain(text[pos:m.start()], out)
                out.append(self.added[m.group()])
                pos = m.end()
        self._encode_plain(text[pos:], out)
        return out


def load_tokenizer(path):
    """The `tokenizers` library's encoder when it is installed (fast, parallel), else
    ByteLevelBPE; both give the same ids for the tokenizers this file supports. Returns a function
    [texts] -> [ids]."""
    try:
        import tokenizers
    except ImportError:
        bpe = ByteLevelBPE(path)
        return lambda texts: [bpe.encode(t) for t in texts]
    tok = tokenizers.Tokenizer.from_file(path)
    return lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
