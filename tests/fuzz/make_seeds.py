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

    tok = open(os.path.join(ROOT, "tests", "fixtures", "tokenizers", "hfnode_added_flags",
                            "tokenizer.json"), "rb").read()
    write("tokenizer_fuzzer", "load_added_flags", b"\0" + tok)
    write("tokenizer_fuzzer", "text_code", b"\1def f(x):\n    return x * 2  # comment\n")
    write("tokenizer_fuzzer", "text_unicode",
          "\x01Grüße, 世界! 😀 naïve café\t\r\n  spaces   and CAPS 12345".encode())
    write("tokenizer_fuzzer", "text_invalid_utf8", b"\x01ok \xff\xfe \xc3\x28 end")

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
