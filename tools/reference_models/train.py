#!/usr/bin/env python3
"""Trains specd's reference models on the GPU host: a byte-level BPE tokenizer, a Llama target
(~8 M parameters) and a standalone Llama draft (~1.6 M parameters) on Python source code.

The corpus is the host's own Python installation (standard library and site-packages), so the run
needs no download. Files are deduplicated by content and split into train / held-out by a hash of
their path, so the held-out split is stable across runs on the same installation.

Usage (on the host, from the repository root):
  PYTHONUNBUFFERED=1 python3 tools/reference_models/train.py --out /tmp/refmodels

Writes, under --out:
  models/pycoder-target/   HF folder: config.json, model.safetensors (bf16), tokenizer.json,
                           tokenizer_config.json, generation_config.json
  models/pycoder-draft/    the same for the draft
  bench/prompts/code_prompts.json   16 code prompts cut from held-out files (for benchmarks)
  train_summary.json       parameter counts, held-out losses, agreement, timings

Training length is set by a wall-clock budget: the script times the first steps and fixes the
number of steps from that (printed); pass --target-steps / --draft-steps to repeat a run exactly.
"""

import argparse
import hashlib
import json
import math
import os
import site
import sys
import sysconfig
import time
import traceback

import numpy as np

# Llama-3's pre-tokenizer split pattern (tokenizer.json of Meta-Llama-3), verbatim.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]  # ids 0 and 1

TARGET_DIMS = dict(hidden_size=320, intermediate_size=864, num_hidden_layers=5,
                   num_attention_heads=5, num_key_value_heads=1, head_dim=64)
DRAFT_DIMS = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)

T0 = time.time()


def log(msg):
    print(f"[train {time.time() - T0:7.1f}s] {msg}", flush=True)


def path_hash(key):
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:12], 16)


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------

def corpus_roots():
    """(label, root) pairs of the Python installation, most specific first."""
    roots = []
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            roots.append((key, paths[key]))
    try:
        for i, p in enumerate(site.getsitepackages()):
            roots.append((f"site{i}", p))
    except AttributeError:  # virtualenv's old site.py
        pass
    seen, out = set(), []
    for label, root in roots:
        real = os.path.realpath(root)
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        out.append((label, real))
    return out


def gather_corpus(max_bytes):
    """Returns (train, val): lists of (key, text) in a deterministic order."""
    files = {}  # realpath -> key
    roots = corpus_roots()
    root_set = {r for _, r in roots}
    for label, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            # A root nested in another (site-packages inside the stdlib folder) is walked as
            # itself, so every file gets one key whatever the layout.
            dirnames[:] = sorted(
                d for d in dirnames if d != "__pycache__"
                and os.path.realpath(os.path.join(dirpath, d)) not in root_set)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                full = os.path.join(dirpath, name)
                real = os.path.realpath(full)
                if real in files:
                    continue
                files[real] = f"{label}/{os.path.relpath(full, root)}"
    log(f"found {len(files)} .py files under {[r for _, r in corpus_roots()]}")
    seen_content = set()
    docs = []
    skipped = {"size": 0, "utf8": 0, "dup": 0, "special": 0}
    for real in sorted(files, key=lambda r: files[r]):
        try:
            data = open(real, "rb").read()
        except OSError:
            continue
        if len(data) < 64 or len(data) > 400_000:
            skipped["size"] += 1
            continue
        digest = hashlib.sha1(data).digest()
        if digest in seen_content:
            skipped["dup"] += 1
            continue
        seen_content.add(digest)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped["utf8"] += 1
            continue
        # A literal special token inside source would be encoded as the special token itself.
        if any(s in text for s in SPECIAL_TOKENS):
            skipped["special"] += 1
            continue
        docs.append((files[real], text))
    # Mix packages (sorted paths would put one library's files together) deterministically.
    docs.sort(key=lambda kv: path_hash(kv[0]))
    train, val, total = [], [], 0
    for key, text in docs:
        if path_hash("split:" + key) % 1000 < 20:  # 2% of files held out
            val.append((key, text))
        else:
            if total >= max_bytes:
                continue
            train.append((key, text))
            total += len(text)
    log(f"corpus: {len(train)} train files ({sum(len(t) for _, t in train) / 1e6:.1f} M chars), "
        f"{len(val)} held-out files ({sum(len(t) for _, t in val) / 1e6:.1f} M chars); "
        f"skipped {skipped}")
    return train, val, skipped


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    # Structured exactly as Llama-3's tokenizer.json: a Split on the Llama-3 pattern, then
    # ByteLevel without its own regex; a ByteLevel decoder; BPE with ignore_merges.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter(texts), trainer=trainer, length=len(texts))
    spec = json.loads(tok.to_str())
    spec["model"]["ignore_merges"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def encode_docs(tok, docs, eos_id):
    """Concatenates [EOS] + ids of every document into one uint16 array."""
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    parts, n_chars = [], 0
    chunk = 2048
    for i in range(0, len(docs), chunk):
        texts = [t for _, t in docs[i:i + chunk]]
        n_chars += sum(len(t) for t in texts)
        for enc in encode(texts, add_special_tokens=False):
            ids = enc.ids
            arr = np.empty(len(ids) + 1, dtype=np.uint16)
            arr[0] = eos_id
            arr[1:] = ids
            parts.append(arr)
    out = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    return out, n_chars


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

def make_config(dims, vocab_size, seq_len, eos_id):
    from transformers import LlamaConfig
    common = dict(vocab_size=vocab_size, max_position_embeddings=seq_len, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id,
                  attention_bias=False, mlp_bias=False, hidden_act="silu",
                  initializer_range=0.02, **dims)
    try:
        return LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    except TypeError:  # transformers 4: rope_theta is a top-level field
        return LlamaConfig(rope_theta=10000.0, **common)


def param_count(model):
    return sum(p.numel() for p in model.parameters())


def train_model(model, tokens, args, budget_s, fixed_steps, lr, seed, label):
    import torch
    import torch.nn.functional as F
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    n, seq, batch = tokens.numel(), args.seq_len, args.batch
    ar = torch.arange(seq + 1, device="cuda")
    vocab = model.config.vocab_size
    warmup = 150
    total = fixed_steps if fixed_steps else None
    min_ratio = 0.1

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        t = total if total else 10 ** 9
        frac = min(1.0, (step - warmup) / max(1, t - warmup))
        return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    t_start = time.time()
    calib_a = calib_b = None
    step = 0
    losses = []
    while True:
        if total is not None and step >= total:
            break
        if time.time() - t_start > budget_s * 1.15:
            log(f"{label}: stopping at step {step}: over the time budget")
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        off = torch.randint(0, n - seq - 1, (batch,), device="cuda", generator=gen)
        b = tokens[off[:, None] + ar[None, :]].long()
        x, y = b[:, :-1], b[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if total is None and step == 20:
            torch.cuda.synchronize()
            calib_a = time.time()
        if total is None and step == 60:
            torch.cuda.synchronize()
            calib_b = time.time()
            step_s = (calib_b - calib_a) / 40
            total = max(warmup + 50, 60 + int((budget_s - (calib_b - t_start)) / step_s))
            log(f"{label}: {step_s * 1000:.1f} ms/step, {batch * seq / step_s / 1e6:.2f} M tok/s "
                f"-> {total} steps in the {budget_s:.0f} s budget")
        if step % 250 == 0:
            lv = loss.item()
            losses.append((step, lv))
            log(f"{label}: step {step}/{total} loss {lv:.4f} lr {lr_at(step):.2e}")
    torch.cuda.synchronize()
    elapsed = time.time() - t_start
    return dict(steps=step, seconds=round(elapsed, 1), tokens_seen=step * batch * seq,
                batch=batch, seq_len=seq, peak_lr=lr, warmup_steps=warmup,
                loss_curve=losses[-8:])


def eval_models(models, val_tokens, seq_len, max_windows):
    """Held-out loss of each model and top-1 agreement of draft with target (teacher forcing)."""
    import torch
    import torch.nn.functional as F
    n_win = min(max_windows, (val_tokens.numel() - 1) // seq_len)
    ar = torch.arange(seq_len + 1, device="cuda")
    sums = {k: 0.0 for k in models}
    agree = 0
    count = 0
    with torch.no_grad():
        for i in range(0, n_win, 16):
            starts = torch.arange(i, min(i + 16, n_win), device="cuda") * seq_len
            b = val_tokens[starts[:, None] + ar[None, :]].long()
            x, y = b[:, :-1], b[:, 1:]
            preds = {}
            for name, m in models.items():
                logits = m(input_ids=x, use_cache=False).logits.float()
                sums[name] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                              reduction="sum").item()
                preds[name] = logits.argmax(-1)
            if "target" in preds and "draft" in preds:
                agree += (preds["target"] == preds["draft"]).sum().item()
            count += y.numel()
    out = {f"{k}_val_loss": round(v / count, 4) for k, v in sums.items()}
    out["val_tokens_scored"] = count
    if "target" in models and "draft" in models:
        out["top1_agreement_heldout_text"] = round(agree / count, 4)
    return out


def chain_stats(matches, k):
    """Greedy chain speculation with k draft tokens over one match sequence (True where the
    draft's argmax equals the target's greedy token): (tokens emitted, target steps, accepted)."""
    j = steps = emitted = accepted = 0
    n = len(matches)
    while j < n:
        a = 0
        while a < k and j + a < n and matches[j + a]:
            a += 1
        accepted += a
        emitted += min(a + 1, n - j)
        j += a + 1
        steps += 1
    return emitted, steps, accepted


def greedy_agreement(target, draft, val_tokens, eos_id, pad_id, n_prompts=32, prompt_len=128,
                     new_tokens=128):
    """Runs the target greedily on held-out prompts, then asks how often the draft's argmax matches
    each generated token: exactly what greedy speculative decoding accepts."""
    import torch
    total_tokens = val_tokens.numel()
    stride = max(prompt_len, (total_tokens - prompt_len - 1) // n_prompts)
    starts = [i * stride for i in range(n_prompts) if i * stride + prompt_len < total_tokens]
    x = torch.stack([val_tokens[s:s + prompt_len] for s in starts]).long()
    with torch.no_grad():
        out = target.generate(input_ids=x, attention_mask=torch.ones_like(x),
                              max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                              eos_token_id=eos_id)
        dl = draft(input_ids=out, use_cache=False).logits
        dpred = dl[:, prompt_len - 1:-1].argmax(-1)
    cont = out[:, prompt_len:]
    all_matches = []
    for r in range(cont.shape[0]):
        row = cont[r].tolist()
        valid = len(row)
        for j, t in enumerate(row):
            if t == eos_id:
                valid = j + 1
                break
        all_matches.append((dpred[r, :valid] == cont[r, :valid]).tolist())
    flat = [m for ms in all_matches for m in ms]
    res = {"greedy_path_top1_agreement": round(sum(flat) / max(1, len(flat)), 4),
           "greedy_path_tokens": len(flat)}
    for k in (1, 2, 4, 8):
        e = s = a = 0
        for ms in all_matches:
            e1, s1, a1 = chain_stats(ms, k)
            e, s, a = e + e1, s + s1, a + a1
        res[f"chain{k}_tokens_per_target_step"] = round(e / s, 3)
        res[f"chain{k}_acceptance_rate"] = round(a / (k * s), 3)
    return res


def save_hf(model, tok, out_dir, eos_id, pad_id, seq_len):
    """Saves a bf16 copy of `model` (the fp32 master is left as it is: converting a live model
    with .to(bf16) would also round its RoPE inv_freq buffer, which a reload recomputes in fp32)."""
    import copy
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig
    os.makedirs(out_dir, exist_ok=True)
    half = copy.deepcopy(model).to(torch.bfloat16)
    half.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id,
                                              pad_token_id=pad_id)
    half.save_pretrained(out_dir)
    if not os.path.exists(os.path.join(out_dir, "generation_config.json")):
        half.generation_config.save_pretrained(out_dir)
    del half
    try:
        from transformers import PreTrainedTokenizerFast
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(tok.to_str()), eos_token=EOS_TOKEN,
            bos_token=EOS_TOKEN, pad_token=PAD_TOKEN, model_max_length=seq_len,
            clean_up_tokenization_spaces=False)
        hf_tok.save_pretrained(out_dir)
    except Exception:  # keep going: the folder is still usable with a hand-written config
        traceback.print_exc()
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
                       "bos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
                       "model_max_length": seq_len, "clean_up_tokenization_spaces": False},
                      f, indent=2)
    # Our tokenizer.json exactly as trained (transformers may re-serialise or adjust its copy).
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    sizes = {f: os.path.getsize(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir))}
    log(f"saved {out_dir}: {sizes}")
    return sizes


def load_folder(out_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16).to("cuda").eval()


def verify_folder(out_dir, loaded, master, tok, sample_text):
    """Checks the folder loaded back by AutoModelForCausalLM holds exactly the bf16 rounding of the
    trained fp32 weights, and that AutoTokenizer encodes like our tokenizer."""
    import torch
    from transformers import AutoTokenizer
    res = {"reload_class": type(loaded).__name__}
    if master is not None:
        ref = master.state_dict()
        got = loaded.state_dict()
        mismatched = [k for k, v in ref.items()
                      if k not in got or not torch.equal(got[k], v.to(torch.bfloat16))]
        res["reload_tensors"] = len(ref)
        res["reload_mismatched_tensors"] = mismatched[:5]
        res["reload_ok"] = not mismatched
    try:
        t2 = AutoTokenizer.from_pretrained(out_dir)
        ids2 = t2(sample_text, add_special_tokens=False)["input_ids"]
        ids1 = tok.encode(sample_text, add_special_tokens=False).ids
        res["autotokenizer_class"] = type(t2).__name__
        res["autotokenizer_matches"] = ids1 == ids2
        res["autotokenizer_decode_matches"] = t2.decode(ids1) == tok.decode(ids1)
    except Exception as e:
        traceback.print_exc()
        res["autotokenizer_matches"] = False
        res["autotokenizer_error"] = repr(e)
    log(f"verify {out_dir}: {res}")
    return res


def make_prompts(val_docs, tok, n=16, min_chars=600, max_tokens=400):
    """Cuts n prompts from held-out files: lines starting a third of the way into the file (past
    licence headers and imports) until at least min_chars characters, ending with a newline."""
    prompts = []
    used_top = set()
    for strict_distinct in (True, False):
        for key, text in val_docs:
            if len(prompts) >= n:
                break
            if len(text) < 3 * min_chars or key in {p["source"] for p in prompts}:
                continue
            top = "/".join(key.split("/")[:2])
            if strict_distinct and top in used_top:
                continue
            lines = text.splitlines(keepends=True)
            start = len(lines) // 3
            chunk = ""
            for line in lines[start:]:
                chunk += line
                if len(chunk) >= min_chars:
                    break
            if len(chunk) < min_chars or not chunk.endswith("\n") or not chunk.strip():
                continue
            ids = tok.encode(chunk, add_special_tokens=False).ids
            if len(ids) > max_tokens:
                continue
            used_top.add(top)
            prompts.append({"id": len(prompts), "source": key, "text": chunk, "ids": ids})
    return prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-corpus-mb", type=float, default=250)
    ap.add_argument("--tokenizer-train-mb", type=float, default=64)
    ap.add_argument("--target-seconds", type=float, default=190)
    ap.add_argument("--draft-seconds", type=float, default=65)
    ap.add_argument("--target-steps", type=int, default=0, help="fixed step count (0: budget)")
    ap.add_argument("--draft-steps", type=int, default=0)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--total-seconds", type=float, default=380,
                    help="wall-clock budget of the whole script; training budgets shrink to fit")
    ap.add_argument("--eval-only", action="store_true",
                    help="skip training: evaluate the folders already under --out/models "
                         "(writes eval_summary.json)")
    args = ap.parse_args()

    import torch
    import transformers
    import tokenizers
    from transformers import LlamaForCausalLM

    summary = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "seed": args.seed,
               "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                            "transformers": transformers.__version__,
                            "tokenizers": tokenizers.__version__},
               "device": torch.cuda.get_device_name(0),
               "timings_s": {}}
    out_models = os.path.join(args.out, "models")
    os.makedirs(out_models, exist_ok=True)
    target_dir = os.path.join(out_models, "pycoder-target")
    draft_dir = os.path.join(out_models, "pycoder-draft")
    summary_path = os.path.join(args.out,
                                "eval_summary.json" if args.eval_only else "train_summary.json")

    def write_summary():
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=2)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    t = time.time()
    train_docs, val_docs, skipped = gather_corpus(int(args.max_corpus_mb * 1e6))
    summary["corpus"] = {
        "source": "every .py file of the host's Python installation (sysconfig stdlib/purelib/"
                  "platlib and site.getsitepackages()), deduplicated by content, 64 B..400 KB, "
                  "UTF-8, files holding a special-token string skipped; held-out = 2% of files "
                  "by SHA-1 of their path",
        "roots": [r for _, r in corpus_roots()],
        "train_files": len(train_docs), "val_files": len(val_docs),
        "train_chars": sum(len(x) for _, x in train_docs),
        "val_chars": sum(len(x) for _, x in val_docs), "skipped": skipped}
    summary["timings_s"]["corpus"] = round(time.time() - t, 1)

    if args.eval_only:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(target_dir, "tokenizer.json"))
        eos_id, pad_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
        val_arr, _ = encode_docs(tok, val_docs, eos_id)
        val_tokens = torch.from_numpy(val_arr.astype(np.int32)).to("cuda")
        sample_text = val_docs[0][1][:2000]
        summary["tokens"] = {"val": int(val_arr.size)}
        summary.update(evaluate_pair(args, tok, val_tokens, eos_id, pad_id, target_dir,
                                     draft_dir, None, None, sample_text))
        summary["timings_s"]["total"] = round(time.time() - T0, 1)
        write_summary()
        print("SUMMARY_JSON " + json.dumps(summary), flush=True)
        return 0

    t = time.time()
    tok_texts, nbytes = [], 0
    for _, text in train_docs:
        if nbytes >= args.tokenizer_train_mb * 1e6:
            break
        tok_texts.append(text)
        nbytes += len(text)
    tok = train_tokenizer(tok_texts, args.vocab_size)
    eos_id, pad_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    vocab = tok.get_vocab_size()
    summary["tokenizer"] = {"vocab_size": vocab, "trained_on_chars": nbytes,
                            "pre_tokenizer": "Split(Llama-3 pattern) + ByteLevel(use_regex=False)",
                            "ignore_merges": True, "eos": [EOS_TOKEN, eos_id],
                            "pad": [PAD_TOKEN, pad_id]}
    summary["timings_s"]["tokenizer_train"] = round(time.time() - t, 1)
    log(f"tokenizer: vocab {vocab} trained on {nbytes / 1e6:.1f} M chars")

    t = time.time()
    train_arr, train_chars = encode_docs(tok, train_docs, eos_id)
    val_arr, val_chars = encode_docs(tok, val_docs, eos_id)
    summary["tokens"] = {"train": int(train_arr.size), "val": int(val_arr.size),
                         "chars_per_token": round(train_chars / max(1, train_arr.size), 3)}
    summary["timings_s"]["encode"] = round(time.time() - t, 1)
    log(f"tokens: train {train_arr.size / 1e6:.1f} M, val {val_arr.size / 1e6:.2f} M, "
        f"{summary['tokens']['chars_per_token']} chars/token")
    write_summary()

    prompts = make_prompts(val_docs, tok)
    os.makedirs(os.path.join(args.out, "bench", "prompts"), exist_ok=True)
    with open(os.path.join(args.out, "bench", "prompts", "code_prompts.json"), "w") as f:
        json.dump({"description": "Code prompts cut from held-out files of the reference models' "
                                  "corpus (tools/reference_models/train.py make_prompts); ids are "
                                  "models/pycoder-target/tokenizer.json without special tokens.",
                   "prompts": prompts}, f, indent=1, ensure_ascii=True)
    log(f"wrote {len(prompts)} prompts")

    # Shrink both training budgets proportionally if preprocessing ate into the total; 50 s are
    # kept for saving, evaluation and the reload checks.
    remaining = args.total_seconds - (time.time() - T0) - 50
    if not args.target_steps and not args.draft_steps and \
            remaining < args.target_seconds + args.draft_seconds:
        scale = max(0.2, remaining / (args.target_seconds + args.draft_seconds))
        args.target_seconds *= scale
        args.draft_seconds *= scale
        log(f"training budgets scaled by {scale:.2f}: target {args.target_seconds:.0f} s, "
            f"draft {args.draft_seconds:.0f} s")

    train_tokens = torch.from_numpy(train_arr.astype(np.int32)).to("cuda")
    val_tokens = torch.from_numpy(val_arr.astype(np.int32)).to("cuda")
    sample_text = val_docs[0][1][:2000] if val_docs else "def f(x):\n    return x\n"

    # ---- target
    t = time.time()
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(make_config(TARGET_DIMS, vocab, args.seq_len, eos_id)).to("cuda")
    summary["target"] = {"params": param_count(target), "dims": TARGET_DIMS,
                         "tie_word_embeddings": True,
                         "attn_implementation": getattr(target.config, "_attn_implementation", "?")}
    log(f"target: {summary['target']['params']} parameters")
    summary["target"]["train"] = train_model(target, train_tokens, args, args.target_seconds,
                                             args.target_steps, args.target_lr, args.seed + 1,
                                             "target")
    summary["timings_s"]["target_train"] = round(time.time() - t, 1)
    summary["target"]["files"] = save_hf(target, tok, target_dir, eos_id, pad_id, args.seq_len)
    write_summary()

    # ---- draft
    t = time.time()
    torch.manual_seed(args.seed + 100)
    draft = LlamaForCausalLM(make_config(DRAFT_DIMS, vocab, args.seq_len, eos_id)).to("cuda")
    summary["draft"] = {"params": param_count(draft), "dims": DRAFT_DIMS,
                        "tie_word_embeddings": True}
    log(f"draft: {summary['draft']['params']} parameters")
    summary["draft"]["train"] = train_model(draft, train_tokens, args, args.draft_seconds,
                                            args.draft_steps, args.draft_lr, args.seed + 2,
                                            "draft")
    summary["timings_s"]["draft_train"] = round(time.time() - t, 1)
    summary["draft"]["files"] = save_hf(draft, tok, draft_dir, eos_id, pad_id, args.seq_len)
    write_summary()
    del train_tokens

    ev = evaluate_pair(args, tok, val_tokens, eos_id, pad_id, target_dir, draft_dir, target,
                       draft, sample_text)
    summary["target"].update(ev.pop("target"))
    summary["draft"].update(ev.pop("draft"))
    summary.update(ev)
    total_bytes = sum(os.path.getsize(os.path.join(d, f)) for d in (target_dir, draft_dir)
                      for f in os.listdir(d))
    summary["models_total_bytes"] = total_bytes
    summary["timings_s"]["total"] = round(time.time() - T0, 1)
    write_summary()
    print("SUMMARY_JSON " + json.dumps(summary), flush=True)
    ok = summary["target"]["verify"].get("reload_ok") and summary["draft"]["verify"].get("reload_ok")
    return 0 if ok else 1


def evaluate_pair(args, tok, val_tokens, eos_id, pad_id, target_dir, draft_dir, target_master,
                  draft_master, sample_text):
    """Held-out losses, agreement and greedy-chain acceptance of the models as saved: loaded back
    from their folders by AutoModelForCausalLM in bf16, as any user would get them."""
    t = time.time()
    target = load_folder(target_dir)
    draft = load_folder(draft_dir)
    out = {"target": {"verify": verify_folder(target_dir, target, target_master, tok,
                                              sample_text)},
           "draft": {"verify": verify_folder(draft_dir, draft, draft_master, tok, sample_text)}}
    ev = eval_models({"target": target, "draft": draft}, val_tokens, args.seq_len,
                     args.eval_windows)
    out["target"]["target_val_loss"] = ev["target_val_loss"]
    out["draft"]["draft_val_loss"] = ev["draft_val_loss"]
    out["pair"] = {"evaluated": "folders loaded back with AutoModelForCausalLM, bf16, on the GPU",
                   "top1_agreement_heldout_text": ev["top1_agreement_heldout_text"],
                   "val_tokens_scored": ev["val_tokens_scored"]}
    try:
        out["pair"].update(greedy_agreement(target, draft, val_tokens, eos_id, pad_id))
    except Exception as e:
        traceback.print_exc()
        out["pair"]["greedy_error"] = repr(e)
    out["eval_seconds"] = round(time.time() - t, 1)
    log(f"evaluation: {out}")
    return out


if __name__ == "__main__":
    sys.exit(main())
