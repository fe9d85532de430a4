#!/usr/bin/env python3
"""Oracle fixtures from Hugging Face transformers and tokenizers, for specd's CPU tests.

Parts (--parts, comma-separated; default all):
  families    tests/fixtures/models/<family>/: a tiny random-weight model of each supported family
              (Llama-3.1 with llama3 RoPE scaling, Mistral, Qwen2 with QKV bias, Qwen3 with q/k
              norm; GQA, odd query-head counts) saved by transformers in fp32, and oracle.json with
              transformers' fp32 logits for fixed prompts and the greedy continuation.
  reference   tests/fixtures/reference_greedy.json: greedy continuations of code prompts by the
              committed reference models (models/pycoder-*), fp32 on the CPU.
  tokenizers  tests/fixtures/tokenizers/<name>/{tokenizer.json,cases.json}: tokenizers built and
              trained here with the `tokenizers` library, and its encodings/decodings of hard
              strings (encode with add_special_tokens=False, decode with skip_special_tokens=False).

Everything runs on the CPU in fp32 so that the numbers are those of the plain math.

Usage (from the repository root, on a machine with torch, transformers and tokenizers):
  python3 tools/oracle/make_fixtures.py --out tests/fixtures --models models
"""

import argparse
import json
import os
import random
import sys
import time
import traceback

T0 = time.time()


def log(msg):
    print(f"[fixtures {time.time() - T0:6.1f}s] {msg}", flush=True)


def f32_list(values):
    """fp32 values as JSON numbers with 9 significant digits (enough to round-trip fp32)."""
    return [float(f"{v:.9g}") for v in values]


def dump_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"), ensure_ascii=True)
        f.write("\n")


def versions():
    import tokenizers
    out = {"python": sys.version.split()[0], "tokenizers": tokenizers.__version__}
    try:
        import torch
        import transformers
        out["torch"] = torch.__version__
        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


# ----------------------------------------------------------------------------------------------
# (a) model families
# ----------------------------------------------------------------------------------------------

# Head counts are odd with one KV head (GQA with a group of 3 or 5); qwen3's head_dim differs from
# hidden/heads (5 * 16 = 80 != 64) and it ties its embeddings. llama31's RoPE scaling uses a small
# original_max_position_embeddings (32) so that, at head_dim 16 and theta 1e4, the three llama3
# branches (kept, smoothed, divided by factor) all occur and matter within 20 positions.
FAMILIES = {
    "llama31": dict(config="LlamaConfig", model="LlamaForCausalLM", model_type="llama",
                    hidden_size=48, intermediate_size=96, num_attention_heads=3,
                    num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
                    rope={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32},
                    tie=False),
    "mistral": dict(config="MistralConfig", model="MistralForCausalLM", model_type="mistral",
                    hidden_size=40, intermediate_size=96, num_attention_heads=5,
                    num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-5,
                    rope={"rope_type": "default", "rope_theta": 1000000.0},
                    tie=False, extra={"sliding_window": None}),
    "qwen2": dict(config="Qwen2Config", model="Qwen2ForCausalLM", model_type="qwen2",
                  hidden_size=48, intermediate_size=96, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                  rope={"rope_type": "default", "rope_theta": 1000000.0}, tie=False),
    "qwen3": dict(config="Qwen3Config", model="Qwen3ForCausalLM", model_type="qwen3",
                  hidden_size=64, intermediate_size=128, num_attention_heads=5,
                  num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                  rope={"rope_type": "default", "rope_theta": 1000000.0}, tie=True),
}
FAMILY_VOCAB = 320
FAMILY_LAYERS = 2
FAMILY_MAX_POS = 128
FAMILY_NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 12, 19)


def make_family_config(spec):
    import transformers
    cls = getattr(transformers, spec["config"])
    common = dict(vocab_size=FAMILY_VOCAB, hidden_size=spec["hidden_size"],
                  intermediate_size=spec["intermediate_size"],
                  num_hidden_layers=FAMILY_LAYERS,
                  num_attention_heads=spec["num_attention_heads"],
                  num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
                  max_position_embeddings=FAMILY_MAX_POS, rms_norm_eps=spec["rms_norm_eps"],
                  tie_word_embeddings=spec["tie"], bos_token_id=0,
                  eos_token_id=FAMILY_VOCAB - 1, hidden_act="silu", **spec.get("extra", {}))
    fields = config_fields(cls)
    if fields:
        # Qwen2Config has no head_dim field (its attention falls back to hidden/heads, which is
        # what we ask for); strict config classes reject unknown keyword arguments.
        for key in [k for k in common if k not in fields]:
            if key == "head_dim":
                assert spec["head_dim"] * spec["num_attention_heads"] == spec["hidden_size"]
            common.pop(key)
            log(f"{spec['config']} takes no {key}: left out")
    if not fields or "rope_parameters" in fields:
        return cls(rope_parameters=dict(spec["rope"]), **common)
    rope = dict(spec["rope"])  # transformers 4: rope_theta + rope_scaling
    theta = rope.pop("rope_theta")
    scaling = None if rope.get("rope_type") == "default" else rope
    return cls(rope_theta=theta, rope_scaling=scaling, **common)


def config_fields(cls):
    """Names a config class takes, or an empty set if that cannot be told."""
    import dataclasses
    import inspect
    names = set()
    try:
        names |= {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        pass
    try:
        params = inspect.signature(cls.__init__).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()) or not names:
            names |= {n for n in params if n != "self"}
    except (TypeError, ValueError):
        pass
    if "vocab_size" not in names:  # not a real answer
        return set()
    return names


def randomise(model, seed):
    """Seeded weights with unit-scale activations, random (non-unit) norm weights and biases, so
    every parameter of the checkpoint influences the logits."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * r)
            elif name.endswith(".bias"):
                p.copy_(0.3 * r)
            elif "embed_tokens" in name:
                # Tied: the embedding is also the LM head, so keep logits at a few units.
                p.copy_((0.35 if tied else 1.0) * r)
            elif "lm_head" in name:
                p.copy_(2.0 / p.shape[1] ** 0.5 * r)
            else:  # Linear [out, in]
                p.copy_(r / p.shape[1] ** 0.5)


def set_eager(model):
    try:
        model.set_attn_implementation("eager")
    except Exception:
        try:
            model.config._attn_implementation = "eager"
        except Exception:
            pass
    return getattr(model.config, "_attn_implementation", "unknown")


def greedy_no_cache(model, ids, steps):
    """Plain argmax loop with a full forward each step (no KV cache): the reference."""
    import torch
    seq = list(ids)
    out, margins = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            top2 = torch.topk(logits, 2)
            nxt = int(top2.indices[0])
            out.append(nxt)
            margins.append(float(top2.values[0] - top2.values[1]))
            seq.append(nxt)
    return out, margins


def hf_generate(model, ids, steps):
    import torch
    x = torch.tensor([ids])
    with torch.no_grad():
        g = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=steps,
                           do_sample=False, pad_token_id=0)
    return g[0, len(ids):].tolist()


def make_families(out_dir):
    import torch
    import transformers
    from transformers import GenerationConfig
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    results = {}
    for fi, (name, spec) in enumerate(sorted(FAMILIES.items())):
        cfg = make_family_config(spec)
        torch.manual_seed(100 + fi)
        model = getattr(transformers, spec["model"])(cfg).float().eval()
        attn = set_eager(model)
        randomise(model, 1000 + fi)
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=FAMILY_VOCAB - 1,
                                                   pad_token_id=0)
        d = os.path.join(out_dir, "models", name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d)
        # Reload from the folder, so the oracle is computed from exactly the files we ship.
        model = getattr(transformers, spec["model"]).from_pretrained(d, dtype=torch.float32).eval()
        attn = set_eager(model)
        rng = random.Random(7 + fi)
        prompts = []
        for plen in PROMPT_LENGTHS:
            ids = [rng.randrange(FAMILY_VOCAB) for _ in range(plen)]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            positions = list(range(plen)) if plen == PROMPT_LENGTHS[0] else \
                sorted({0, plen // 2, plen - 1})
            greedy, margins = greedy_no_cache(model, ids, FAMILY_NEW_TOKENS)
            try:
                gen = hf_generate(model, ids, FAMILY_NEW_TOKENS)
            except Exception as e:
                traceback.print_exc()
                gen = None
            prompts.append({
                "ids": ids,
                "logit_positions": positions,
                "logits": [f32_list(logits[p].tolist()) for p in positions],
                "greedy": greedy,
                "greedy_min_margin": min(margins),
                "generate": gen,
                "generate_matches_greedy": gen is not None and gen == greedy[:len(gen)],
            })
        n_params = sum(p.numel() for p in model.parameters())
        oracle = {
            "family": name, "model_type": spec["model_type"], "model_class": spec["model"],
            "versions": versions(), "device": "cpu", "dtype": "float32",
            "attn_implementation": attn, "parameters": n_params,
            "greedy_note": f"greedy: {FAMILY_NEW_TOKENS} argmax steps of a full no-cache forward, "
                           "not stopping at EOS; generate: model.generate(do_sample=False), which "
                           "may stop early at eos_token_id",
            "logits_note": "logits[i] is the next-token logits row after prompt position "
                           "logit_positions[i] (0-based), fp32",
            "prompts": prompts,
        }
        dump_json(os.path.join(d, "oracle.json"), oracle)
        results[name] = {"params": n_params, "attn": attn,
                         "min_margin": min(p["greedy_min_margin"] for p in prompts),
                         "generate_matches": all(p["generate_matches_greedy"] for p in prompts)}
        log(f"family {name}: {results[name]}")
    return results


# ----------------------------------------------------------------------------------------------
# (b) reference models
# ----------------------------------------------------------------------------------------------

# Candidates in order; the first REFERENCE_CASES whose greedy continuation has no near-tie
# (top-1 minus top-2 logit >= MIN_MARGIN at every step, for both models) become fixtures, so an
# fp32 engine with another summation order must reproduce them exactly.
REFERENCE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for i in range(len(values)):\n        if values[i] is None:\n",
    "def read_json(path):\n    \"\"\"Read a JSON file and return its contents.\"\"\"\n",
    "try:\n    import numpy as np\nexcept ImportError:\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "def test_add():\n    assert add(1, 2) == 3\n\n\ndef test_sub():\n",
    "    parser = argparse.ArgumentParser()\n    parser.add_argument(",
    "        if not isinstance(value, str):\n            raise TypeError(",
    "with open(filename) as f:\n    for line in f:\n",
    "    def __repr__(self):\n        return ",
]
REFERENCE_CASES = 6
REFERENCE_NEW_TOKENS = 32
MIN_MARGIN = 1e-3


def make_reference(out_dir, models_dir):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    names = ("pycoder-target", "pycoder-draft")
    runs = {}
    for name in names:
        d = os.path.join(models_dir, name)
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        attn = set_eager(model)
        cases = []
        for text in REFERENCE_PROMPTS:
            ids = tok.encode(text, add_special_tokens=False).ids
            greedy, margins = greedy_no_cache(model, ids, REFERENCE_NEW_TOKENS)
            case = {"text": text, "prompt_ids": ids, "continuation_ids": greedy,
                    "continuation_text": tok.decode(greedy, skip_special_tokens=False),
                    "min_margin": min(margins),
                    "margins": [float(f"{m:.4g}") for m in margins]}
            try:
                gen = hf_generate(model, ids, REFERENCE_NEW_TOKENS)
                case["generate_matches_greedy"] = gen == greedy[:len(gen)]
            except Exception:
                traceback.print_exc()
            with torch.no_grad():
                last = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            case["last_logits"] = f32_list(last.tolist())
            cases.append(case)
        runs[name] = (attn, cases)
    robust = [i for i in range(len(REFERENCE_PROMPTS))
              if all(runs[n][1][i]["min_margin"] >= MIN_MARGIN for n in names)]
    chosen = (robust + [i for i in range(len(REFERENCE_PROMPTS)) if i not in robust])
    chosen = sorted(chosen[:REFERENCE_CASES])
    result = {"versions": versions(), "device": "cpu", "dtype": "float32",
              "note": "weights are stored in bf16 and upcast to fp32; continuation_ids: "
                      f"{REFERENCE_NEW_TOKENS} argmax steps of a full no-cache forward, not "
                      "stopping at EOS; prompt ids from the model's tokenizer.json without "
                      "special tokens; margins: top-1 minus top-2 logit at each step; "
                      f"cases chosen with every margin >= {MIN_MARGIN} where possible; "
                      "last_logits (fp32, after the prompt) only for the first cases",
              "min_margin_required": MIN_MARGIN, "models": {}}
    for name, n_logits in zip(names, (2, 1)):
        attn, cases = runs[name]
        kept = [dict(cases[i]) for i in chosen]
        for j, c in enumerate(kept):
            c["robust"] = c["min_margin"] >= MIN_MARGIN
            if j >= n_logits:
                del c["last_logits"]
        result["models"][name] = {"attn_implementation": attn, "cases": kept}
        log(f"reference {name}: margins {[round(c['min_margin'], 5) for c in kept]}, "
            f"continuation 0: {kept[0]['continuation_text']!r}")
    dump_json(os.path.join(out_dir, "reference_greedy.json"), result)
    return {"chosen": chosen, "robust_candidates": robust,
            "min_margins": {n: min(c["min_margin"] for c in result["models"][n]["cases"])
                            for n in names}}


# ----------------------------------------------------------------------------------------------
# (c) tokenizers
# ----------------------------------------------------------------------------------------------

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENGLISH = """\
Speculative decoding lets a small draft model propose several tokens that a large target model
then checks in a single forward pass. When the draft is right, many tokens are accepted at once;
when it is wrong, the target's own token is kept, so the output is exactly what the target alone
would have produced. It's a simple idea, and it's been rediscovered more than once. We'll test it
on code: functions, classes, loops, comments and strings, because code is repetitive and easy to
predict. They're fast; I'm sure you'd agree that we've seen the numbers. Don't trust a benchmark
you haven't run yourself! The quick brown fox jumps over the lazy dog 1234567 times in 2024.
Numbers like 3.14159, 2.71828, 1,000,000 and 0x7fffffff appear in programs; so do URLs such as
https://example.com/index.html?query=1&page=2 and e-mail addresses like someone@example.org.
A tokenizer splits text into pieces: words, numbers, punctuation and whitespace.   Tabs\tand
newlines\n matter too. THE END IS NEAR, said the sign; the end is near, said the echo.
"""
MULTILINGUAL = """\
Le café est très bon, naïve façade, garçon, élève, être. Über die Straße gehen Mädchen und Jungen.
Привет, как дела? Всё хорошо, спасибо. Γειά σου κόσμε. 中文分词是一个有趣的问题。日本語の文章です。
한국어 문장입니다. مرحبا بالعالم. नमस्ते दुनिया। שלום עולם. ¡Hola! ¿Qué tal? Ça va très bien.
"""


def tokenizer_corpus(multilingual):
    """A small deterministic corpus: English prose, a few standard-library sources (code), and,
    for the byte-level tokenizers, some non-Latin text so merges over multi-byte characters exist."""
    import collections
    import json as json_mod
    import string
    import textwrap
    texts = [ENGLISH] * 3
    for mod in (textwrap, string, json_mod, collections):
        path = mod.__file__
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    if multilingual:
        texts += [MULTILINGUAL] * 4
    return texts


def train_bpe(pre_tokenizer, specials, vocab_size, corpus, normalizer=None, ignore_merges=False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    if ignore_merges:
        spec = json.loads(tok.to_str())
        spec["model"]["ignore_merges"] = True
        tok = Tokenizer.from_str(json.dumps(spec))
    return tok


def build_gpt2():
    from tokenizers import pre_tokenizers, processors
    tok = train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                    ["<|endoftext|>"], 1000, tokenizer_corpus(True))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_llama3():
    from tokenizers import Regex, pre_tokenizers
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    return train_bpe(pre, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                           "<|end_header_id|>", "<|eot_id|>"], 1200, tokenizer_corpus(True),
                     ignore_merges=True)


def build_qwen2():
    from tokenizers import Regex, normalizers, pre_tokenizers
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    # Qwen2's tokenizer.json normalises to NFC before splitting.
    return train_bpe(pre, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 1200,
                     tokenizer_corpus(True), normalizer=normalizers.NFC())


def build_metaspace():
    """Llama-2-style SentencePiece BPE: '▁' for spaces, byte fallback to <0xXX> tokens, the
    Replace/ByteFallback/Fuse/Strip decoder. Trained on an ASCII-only corpus so that most
    non-ASCII text in the cases falls back to bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    specials = ["<unk>", "<s>", "</s>"]
    corpus = [t.encode("ascii", "ignore").decode("ascii") for t in tokenizer_corpus(False)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    # Train with a splitting Metaspace so merges stay within words, as SentencePiece does; the
    # shipped tokenizer below uses the Llama-2 normaliser form (no pre-tokenizer).
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=1000 - 256, min_frequency=2, special_tokens=specials,
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    spec = json.loads(tok.to_str())
    old = spec["model"]["vocab"]
    assert [t["id"] for t in spec["added_tokens"]] == [0, 1, 2], spec["added_tokens"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for s, i in sorted(old.items(), key=lambda kv: kv[1]):
        if s not in vocab:
            vocab[s] = len(vocab)
    spec["model"]["vocab"] = vocab
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    spec["model"]["unk_token"] = "<unk>"
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    spec["pre_tokenizer"] = None
    spec["post_processor"] = None
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(spec))


# {S0}, {S1}: the tokenizer's first and last special tokens.
HARD_STRINGS = [
    "Hello, world!",
    "  leading spaces",
    "trailing spaces   ",
    "\n\n  x",
    "tabs\tand\t\tmore\t",
    "line1\nline2\r\nline3\rline4",
    "multiple     spaces    inside",
    "   \n   \n",
    " \t \n",
    "I'M here, don't stop, 'S and 'll we'VE",
    "they're, it's, you'd, we'll, I've, I'm",
    "'s 't 're 've 'm 'll 'd",
    "ABC'S DON'T WON'T",
    "word\u2019s curly apostrophe",
    "1234567",
    "3.14159 and 1,000,000 and 0x1F",
    "digits mixed abc123def4567ghi",
    "\u0661\u0662\u0663 Arabic-Indic digits \u0664\u0665\u0666\u0667",
    "\u2460\u2461\u2462 circled and \u00bd fraction",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001\u30ab\u30bf\u30ab\u30ca",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "emoji \U0001F600 \U0001F44D\U0001F3FD \U0001F1FA\U0001F1F8",
    "family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 zwj",
    "wave \U0001F44B\U0001F3FF and keycap 1\ufe0f\u20e3",
    "combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323",
    "precomposed: \u00e9 \u00e4 \u00f1 \u1ed9",
    "Arabic: \u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "Devanagari: \u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "Hebrew: \u05e9\u05dc\u05d5\u05dd",
    "Cyrillic: \u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440",
    "Greek: \u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5",
    "Thai: \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
    "Math: \u2211 \u222b \u221a \u221e \u2260 \u2264",
    "a{S0}b",
    "{S0}",
    "{S0}{S1}",
    "x {S1} y",
    "<|not_a_special|> <s > </ s>",
    "def f(x):\n    return x + 1\n",
    "    indented\n        more\n",
    "if (a&&b)||c: pass  # comment",
    "x = [1, 2, 3]\nprint(f\"{x!r:>10}\")\n",
    "https://example.com/path?q=1&r=2#frag",
    "user@example.com",
    "\u00a0non-breaking\u00a0space",
    "\u3000ideographic space",
    "zero\u200bwidth\u200bspace",
    "\ufeffBOM at start",
    "replacement \ufffd char",
    "\x00 nul and \x7f del and \x1b[0m escape",
    "max code point \U0010ffff and noncharacter \uffff",
    "C1 control \x85 and \x9f",
    "mojibake \u00c3\u00a9 \u00c3\u00bc \u00e2\u20ac\u2122",
    "literal \\xff\\xfe backslash escapes",
    "",
    " ",
    "\n",
    "a" * 40,
    "!!!???...,,,;;;",
    "ALLCAPS Words MiXeD cAsE",
    "supercalifragilisticexpialidocious",
    "Ca va tr\u00e8s bien, na\u00efve caf\u00e9",
]


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table used by ByteLevel."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_token_ids(tok, data, metaspace):
    """Token ids of the single-byte tokens spelling `data`."""
    if metaspace:
        names = [f"<0x{b:02X}>" for b in data]
    else:
        table = bytes_to_unicode()
        names = [table[b] for b in data]
    ids = [tok.token_to_id(n) for n in names]
    assert all(i is not None for i in ids), (data, names)
    return ids


def make_cases(tok, specials, metaspace):
    encode = []
    for s in HARD_STRINGS:
        text = s.replace("{S0}", specials[0]).replace("{S1}", specials[-1])
        ids = tok.encode(text, add_special_tokens=False).ids
        encode.append({"text": text, "ids": ids})
    decode = []

    def add(ids):
        decode.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=False)})

    for case in encode[::3]:  # round trips
        add(case["ids"])
    sid = [tok.token_to_id(s) for s in specials]
    hi = tok.encode("hi there", add_special_tokens=False).ids
    add([sid[0]] + hi + [sid[-1]])
    add(hi + [sid[-1]] + hi)
    add([])
    euro = "\u20ac".encode("utf-8")  # e2 82 ac
    emoji = "\U0001F600".encode("utf-8")  # f0 9f 98 80
    add(byte_token_ids(tok, euro, metaspace))             # whole character
    add(byte_token_ids(tok, euro[:2], metaspace))         # truncated character
    add(byte_token_ids(tok, emoji[:3], metaspace) + hi)   # truncated, then text
    add(byte_token_ids(tok, b"\x80", metaspace))          # lone continuation byte
    add(byte_token_ids(tok, b"\xff\xfe", metaspace))      # never valid in UTF-8
    add(byte_token_ids(tok, b"a\xc3", metaspace) + byte_token_ids(tok, b"\xa9b", metaspace))
    add(byte_token_ids(tok, emoji[1:], metaspace))        # missing lead byte
    rng = random.Random(20261129)
    n = tok.get_vocab_size()
    for length in (1, 5, 12, 12, 30):
        add([rng.randrange(n) for _ in range(length)])
    if metaspace:
        sp = tok.token_to_id("\u2581")
        if sp is not None:
            add([sp, sp] + hi)
            add(hi + [sp])
    return {"encode": encode, "decode": decode}


def make_tokenizers(out_dir):
    builders = {
        "gpt2_bytelevel": (build_gpt2, ["<|endoftext|>"], False),
        "llama3_pattern": (build_llama3, ["<|begin_of_text|>", "<|eot_id|>"], False),
        "qwen2_pattern": (build_qwen2, ["<|im_start|>", "<|im_end|>"], False),
        "metaspace_bytefallback": (build_metaspace, ["<s>", "</s>"], True),
    }
    summary = {}
    for name, (build, specials, metaspace) in builders.items():
        tok = build()
        d = os.path.join(out_dir, "tokenizers", name)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        # Read it back: the cases must come from the file we ship.
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        cases = make_cases(tok, specials, metaspace)
        cases["versions"] = versions()
        cases["note"] = ("encode: Tokenizer.encode(text, add_special_tokens=False).ids; decode: "
                         "Tokenizer.decode(ids, skip_special_tokens=False); tokenizers library")
        # transformers' fast tokenizer wraps the same object; check it agrees where available.
        try:
            from transformers import PreTrainedTokenizerFast
            hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"))
            cases["transformers_agrees"] = all(
                hf.encode(c["text"], add_special_tokens=False) == c["ids"] for c in cases["encode"])
        except Exception as e:
            cases["transformers_agrees"] = f"not checked: {e!r}"
        dump_json(os.path.join(d, "cases.json"), cases)
        summary[name] = {"vocab": tok.get_vocab_size(), "encode": len(cases["encode"]),
                         "decode": len(cases["decode"]),
                         "transformers_agrees": cases["transformers_agrees"]}
        log(f"tokenizer {name}: {summary[name]}")
    return summary


def dir_size(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--models", default="models", help="folder holding pycoder-target/-draft")
    ap.add_argument("--parts", default="families,tokenizers,reference")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = [p for p in args.parts.split(",") if p]
    summary, failed = {}, []
    for part in parts:
        fn = {"families": lambda: make_families(args.out),
              "tokenizers": lambda: make_tokenizers(args.out),
              "reference": lambda: make_reference(args.out, args.models)}[part]
        try:
            summary[part] = fn()
        except Exception:
            traceback.print_exc()
            failed.append(part)
    summary["fixtures_bytes"] = dir_size(args.out)
    print("FIXTURES_SUMMARY " + json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
