#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz/corpus/<harness>/ (committed; rerun after changing it).

Run from the repository root: python3 tests/fuzz/make_seeds.py. Protobuf seeds are encoded by
hand (the wire format of proto/specd/v1) so this needs no generated code.
"""
import json
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")


def write(harness, name, data):
    d = os.path.join(CORPUS, harness)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def varint(v):
    out = b""
    v &= (1 << 64) - 1
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(number, wire, payload):
    key = varint((number << 3) | wire)
    if wire == 0:
        return key + varint(payload)
    if wire == 2:
        return key + varint(len(payload)) + payload
    if wire == 5:
        return key + payload
    raise ValueError(wire)


def packed(number, values):
    return field(number, 2, b"".join(varint(v) for v in values))


def safetensors(tensors):
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# Text the cut-down tokenizers keep the characters and merges of; every seed of the JSON mode
# also encodes it (the part after the NUL).
SAMPLE = "Hello world, the cat's 123 naïve café\n\tdef f(x): return x  # 😀"


def cut_down(fixture, max_merges=24, sample=SAMPLE):
    """A fixture tokenizer.json reduced to the characters of `sample` and the first
    `max_merges` merges among them (in rank order, so ranks keep their order), with the
    fixture's added tokens, normalizer, pre-tokenizer, post-processor and decoder unchanged and
    its ids kept (the vocabulary has gaps, as a cut-down one may). A few hundred bytes of
    vocabulary instead of tens of KB: libFuzzer's input length follows the largest seed, and
    every text input is encoded at a cost proportional to its length."""
    with open(os.path.join(ROOT, "tests", "fixtures", "tokenizers", fixture, "tokenizer.json"),
              encoding="utf-8") as f:
        j = json.load(f)
    model = j["model"]
    vocab = model["vocab"]
    keep = {t["content"] for t in j.get("added_tokens", []) if t["content"] in vocab}
    if model.get("unk_token"):
        keep.add(model["unk_token"])
    if '"ByteLevel"' in json.dumps(j.get("pre_tokenizer")):
        table = bytes_to_unicode()
        chars = {table[b] for b in sample.encode()}
    else:
        chars = set(sample.replace(" ", "\u2581")) | {"\u2581"}
    keep |= {c for c in chars if c in vocab}
    if model.get("byte_fallback"):
        for c in chars - set(vocab):
            keep |= {f"<0x{b:02X}>" for b in c.encode()}
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in keep and b in keep and a + b in vocab:
            keep.add(a + b)
            merges.append(m)
            if len(merges) == max_merges:
                break
    model["vocab"] = {t: i for t, i in vocab.items() if t in keep}
    model["merges"] = merges
    return json.dumps(j, ensure_ascii=False, separators=(",", ":"))


def bpe_suffix_tokenizer():
    """What no fixture has: a BPE with a continuing-subword prefix and an end-of-word suffix
    (openai-gpt's and CLIP's scheme), Strip and NFD normalizers, Digits and WhitespaceSplit
    pre-tokenizers, BertProcessing, and Replace, Strip and Fuse decoders."""
    words = ["the", "cat", "caf", "na", "ive", "re", "turn"]
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2}
    for c in sorted(set("".join(words) + "0123456789,.'():#fxhelowrd")):
        for tok in (c, "##" + c, c + "</w>", "##" + c + "</w>"):
            vocab.setdefault(tok, len(vocab))
    merges = []
    for w in words:
        parts = [w[0]] + ["##" + c for c in w[1:]]
        parts[-1] += "</w>"
        while len(parts) > 1:
            a, b = parts[0], parts[1]
            merged = a + b[2:]
            vocab.setdefault(merged, len(vocab))
            merges.append([a, b])
            parts = [merged] + parts[2:]
    j = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for t, i in (("[UNK]", 0), ("[CLS]", 1), ("[SEP]", 2))],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Strip", "strip_left": True, "strip_right": True}, {"type": "NFD"}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"}, {"type": "Digits", "individual_digits": True}]},
        "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 2], "cls": ["[CLS]", 1]},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "##"}, "content": ""},
            {"type": "Replace", "pattern": {"String": "</w>"}, "content": " "},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 0, "stop": 1}]},
        "model": {"type": "BPE", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "end_of_word_suffix": "</w>", "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }
    return json.dumps(j, ensure_ascii=False, separators=(",", ":"))


# tokenizer_fuzzer's first byte modulo 6: 0 is a tokenizer.json (then NUL and the text to
# encode), 1 to 5 the text for that reference tokenizer (tests/fuzz/tokenizer_fuzzer.cc).
TOKENIZER_REFERENCES = 5


def tokenizer_seeds():
    text = SAMPLE.encode()
    for fixture in ("gpt2_bytelevel", "metaspace_bytefallback", "llama3_pattern",
                    "qwen2_pattern", "hfnode_added_flags", "hfnode_sp_llama2"):
        tail = text
        if fixture == "hfnode_added_flags":  # its added tokens, each flag in play
            tail = b"a <mask> b<sep> c cat concat [NL] x hello <|x|><|y|> <|x|>"
        write("tokenizer_fuzzer", "load_" + fixture, b"\0" + cut_down(fixture).encode() + b"\0" + tail)
    write("tokenizer_fuzzer", "load_bpe_suffix", b"\0" + bpe_suffix_tokenizer().encode() + b"\0"
          + "  The café re-turn 2024, na\u0131ve  ".encode())
    texts = {
        "code": b"def f(x):\n    return x * 2  # comment\n",
        "unicode": "Grüße, 世界! 😀 naïve café\t\r\n  spaces   and CAPS 12345".encode(),
        "invalid_utf8": b"ok \xff\xfe \xc3\x28 end",
    }
    for ref in range(TOKENIZER_REFERENCES):
        for name, t in texts.items():
            write("tokenizer_fuzzer", f"text{ref}_{name}", bytes([1 + ref]) + t)


def main():
    write("safetensors_header_fuzzer", "two_tensors",
          safetensors({"a": ("F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
                       "b": ("BF16", [3], b"\x80\x3f" * 3)}))
    write("safetensors_header_fuzzer", "scalar", safetensors({"s": ("I64", [], struct.pack("<q", 7))}))
    meta = json.dumps({"__metadata__": {"format": "pt"},
                       "x": {"dtype": "F16", "shape": [1, 2], "data_offsets": [0, 4]}}).encode()
    write("safetensors_header_fuzzer", "with_metadata", struct.pack("<Q", len(meta)) + meta + b"\0" * 4)

    for model in sorted(os.listdir(os.path.join(ROOT, "tests", "fixtures", "models"))):
        d = os.path.join(ROOT, "tests", "fixtures", "models", model)
        cfg = open(os.path.join(d, "config.json"), "rb").read()
        gen_path = os.path.join(d, "generation_config.json")
        gen = open(gen_path, "rb").read() if os.path.exists(gen_path) else b""
        write("model_config_fuzzer", model, cfg + b"\0" + gen)

    tokenizer_seeds()

    # GenerateRequest: prompt=1, prompt_ids=2 (TokenIds.ids=1), max_new_tokens=3,
    # temperature=4, top_p=5, top_k=6, seed=7, stop_token_ids=8, stop=9, draft_depth=12,
    # request_id=15.
    write("request_validation_fuzzer", "prompt",
          field(1, 2, b"def f(x):") + field(3, 0, 8) + field(15, 2, b"req-1"))
    write("request_validation_fuzzer", "ids_sampling",
          field(2, 2, packed(1, [5, 6, 7])) + field(3, 0, 20) + field(4, 5, struct.pack("<f", 0.7))
          + field(5, 5, struct.pack("<f", 0.9)) + field(6, 0, 40) + field(7, 0, 1234)
          + packed(8, [256]) + field(9, 2, b"\n\n") + field(12, 0, 4))
    write("request_validation_fuzzer", "invalid_utf8_stop",
          field(1, 2, b"hello") + field(9, 2, b"ok") + field(9, 2, b"\xc3\x28"))

    write("tree_validation_fuzzer", "chain", packed(1, [5, 6, 7]) + packed(2, [-1, 0, 1]))
    write("tree_validation_fuzzer", "branching",
          packed(1, [5, 6, 7, 8, 9]) + packed(2, [-1, -1, 0, 0, 2])
          + field(3, 2, struct.pack("<5f", -0.1, -0.5, -0.3, -0.9, -1.2)))

    bodies = {
        "completion": (0, {"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0.5,
                           "top_p": 0.9, "stop": ["\n"], "seed": 3, "stream": True,
                           "stream_options": {"include_usage": True}}),
        "completion_ids": (0, {"prompt": [1, 2, 3], "max_tokens": 4, "logit_bias": {"5": -100}}),
        "chat": (1, {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi"}],
                     "max_completion_tokens": 16}),
        "tokenize": (2, {"prompt": "Hello world", "add_special_tokens": False}),
        "detokenize": (3, {"tokens": [1, 2, 3]}),
    }
    for name, (endpoint, body) in bodies.items():
        write("http_json_fuzzer", name, bytes([endpoint]) + json.dumps(body).encode())


if __name__ == "__main__":
    main()
