#!/usr/bin/env python3
"""Peer baseline, end to end: gpt-fast's own speculative decoding (pytorch-labs/gpt-fast,
generate() with draft_model= and speculate_k=, i.e. its --draft_checkpoint_path and
--speculate_k) on a specd synthetic pair (specd-make-synthetic-pair: a Llama-shaped bf16 target
in Hugging Face layout and a draft made of its first layer(s)), batch 1, over the token ids of
the prompts specd's serving benchmark sends, so that its tokens/s and tau stand beside
bench/serve_bench.py's at one stream.

  python3 bench/tools/gpt_fast_spec_bench.py --target /tmp/m/t --draft /tmp/m/d \\
      [--ks 3,5] [--no-plain] [--num-prompts 8] [--max-new-tokens 128] [--json OUT.json]
  python3 bench/tools/gpt_fast_spec_bench.py --target T --draft D --device cpu --dtype fp32 \\
      --no-compile --num-prompts 2 --max-new-tokens 16 --tokens-json OUT.json   (CPU check)

Conversion (as gpt-fast's scripts/convert_hf_checkpoint.py, in memory): embed_tokens ->
tok_embeddings, q/k/v_proj -> attention.wqkv (concatenated, q and k rows permuted from Hugging
Face's rotate-half RoPE layout to gpt-fast's interleaved pairs: row 2i of a head takes row i,
row 2i+1 takes row i + head_dim/2), o_proj -> wo, gate/up/down_proj -> feed_forward.w1/w3/w2,
input_layernorm -> attention_norm, post_attention_layernorm -> ffn_norm, norm, lm_head ->
output (embed_tokens when tied). ModelArgs from config.json: sizes, rms_norm_eps, rope_theta
(or rope_parameters), Llama-3 rope_scaling, block_size = max_position_embeddings. Safetensors are
read with the `safetensors` package (straight onto the device) where it is installed, else with
tools/oracle/safetensors_io.py. tests/tools/test_gpt_fast_spec.py checks on a tiny pair that
gpt-fast's greedy output equals specd's.

Which gpt-fast: model.py as of the carried COMMIT, generate.py as of COMMIT_SPEC (091515a,
written as generate_spec.py by bench/tools/fetch_gpt_fast.sh): from gpt-fast's next commit on,
its speculative decoding fails at every batch size (sample() and seq gained a batch dimension
that speculative_decode and generate()'s speculative branch were not given; gpt-fast issues
209, 213, 214). model.py has changed since only by Llama 3.1's RoPE scaling.

Run (per case: plain = generate without a draft, kN = generate with the draft and speculate_k N):
  - gpt-fast's generate.py's compilation (--compile): decode_one_token and, when speculative,
    model_forward wrapped in torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graphs),
    generate.py's inductor options; prefill eager (its --compile_prefill is off by default).
    Each case is compiled afresh (torch._dynamo.reset()); if the compiled run fails it is
    retried without cudagraph trees (gpt-fast's own setting for speculation under TP), then
    eagerly, and the table says which ran.
  - Each compiled call gets a copy of its token ids and a cudagraph-trees step mark
    (fresh_tokens; --as-is: none), since the old generate.py feeds a view of one replay's
    output into the next.
  - Greedy-equivalent sampling: temperature 0, which gpt-fast's logits_to_probs clamps to 1e-5,
    and top_k 1, so the sampled token is the argmax (a tie of bf16 logits is split at random)
    and speculative_decode's acceptance test (q/p against a uniform draw) accepts a draft token
    exactly when it is the target's argmax. gpt-fast has no greedy path of its own. In bf16 its
    output with the draft can part from its plain output where two logits nearly tie (its
    verify forward of k + 1 tokens rounds differently from a one-token decode); tau is what its
    own run accepted. In fp32 (--dtype fp32) the two agree on the test's pair.
  - The caches of both models are set up once for the longest prompt + --max-new-tokens +
    max(k) + 1 positions (generate's own setup_caches then keeps them), so every prompt and
    every k of a process use the same static shapes.
  - After the compiling call (prompt 0), --warmup more calls; then every prompt once, timed on
    the host with synchronization around generate(): tokens/s = max_new_tokens / that time
    (prefill included), as gpt-fast's generate.py reports it and as serve_bench's tokens/s at
    one stream counts time from request to last token. Medians over prompts and the aggregate
    (all tokens / all time).
  - tau from generate's accept_counts (a step that emits n tokens counts in accept_counts[n-1]):
    tokens per speculative step, bonus token included, as serve_bench's tau.

Prompts: bench/prompts/code_prompts.json's "ids" (models/pycoder-target's tokenizer, which
specd-make-synthetic-pair copies into both models and whose post-processor adds no special
token); a prompt without ids is tokenized with the target folder's tokenizer.json (the
`tokenizers` package, else tools/eagle3/bpe_tokenizer.py).

--gate-dir/--gate-count as gpt_fast_bench.py: several single-case processes compile side by
side and time one at a time (bench/tools/gpt_fast_vs_specd.sh). gpt-fast's code is not part of
this repository: bench/tools/fetch_gpt_fast.sh copies it into the ignored .carry-gptfast.

Old torch (the development machine's 1.13, CPU, --no-compile only): gpt-fast needs
F.scaled_dot_product_attention, `with torch.device(...)` and indexing by int32 tensors; where
`with torch.device` is missing the script adds the math SDPA to torch.nn.functional, runs
generate_spec.py's functions from its source with a `torch` whose device() can be entered, and
makes positions and sampled ids int64 (same values). Each stand-in is printed as a note; the GPU
host's torch needs none of them.
"""
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse
import ast
import contextlib
import glob
import json
import math
import statistics
import sys
import time
import traceback
import types
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import gpt_fast_bench as gfb  # noqa: E402
import step_timing as st  # noqa: E402

T0 = time.time()
NOTES = []


def log(msg):
    print(f"[gpt-fast-spec {time.time() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# gpt-fast import, with the shims old torch needs


def sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """F.scaled_dot_product_attention's math path (boolean mask: True = attend), for a torch
    without it."""
    import torch
    s = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    att = torch.matmul(q, k.transpose(-2, -1)) * s
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            att = att.masked_fill(~attn_mask, float("-inf"))
        else:
            att = att + attn_mask
    return torch.matmul(torch.softmax(att.float(), dim=-1).to(q.dtype), v)


class _EnterableDevice:
    def __init__(self, *a, **k):
        import torch
        self.device = torch.device(*a, **k)

    def __enter__(self):
        return self.device

    def __exit__(self, *exc):
        return False


def old_torch_shims():
    """Returns a stand-in for the `torch` module where this torch lacks what gpt-fast uses."""
    import torch
    import torch.nn.functional as F
    if not hasattr(F, "scaled_dot_product_attention"):
        # Then its sdp_kernel, if any, predates the flags generate.py passes.
        F.scaled_dot_product_attention = sdpa_math
        torch.backends.cuda.sdp_kernel = lambda **_k: contextlib.nullcontext()
        NOTES.append("torch.nn.functional.scaled_dot_product_attention: math stand-in, "
                     "torch.backends.cuda.sdp_kernel: no-op")
    elif not hasattr(torch.backends.cuda, "sdp_kernel"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        torch.backends.cuda.sdp_kernel = lambda **_k: sdpa_kernel([SDPBackend.MATH])
        NOTES.append("torch.backends.cuda.sdp_kernel (gone from this torch): "
                     "torch.nn.attention.sdpa_kernel([MATH]) in its place")
    if not hasattr(torch.device, "__enter__"):
        # Old torch indexes with int64 tensors only; generate() passes int32 positions.
        import model as gf_model
        forward = gf_model.Transformer.forward
        gf_model.Transformer.forward = lambda self, idx, input_pos=None: forward(
            self, idx, input_pos.long())
        NOTES.append("Transformer.forward: positions made int64 (old torch's indexing)")
    if hasattr(torch.device, "__enter__"):
        return torch
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.device = _EnterableDevice
    NOTES.append("`with torch.device(...)`: enterable stand-in in generate.py's functions")
    return proxy


def import_gpt_fast(path):
    """gpt-fast's model module, its generate module (imported, or its functions executed from
    its source into a module when the import fails) and its COMMIT line."""
    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, "model.py")):
        raise SystemExit(f"no gpt-fast model.py in {path}: run bench/tools/fetch_gpt_fast.sh "
                         "and carry .carry-gptfast along")
    sys.path.insert(0, path)
    torch_like = old_torch_shims()
    try:
        import tokenizer  # noqa: F401
    except Exception as e:
        stub = types.ModuleType("tokenizer")
        stub.get_tokenizer = lambda *a, **k: None
        sys.modules["tokenizer"] = stub
        NOTES.append(f"tokenizer.py replaced by a stub ({gfb.short(e)}); prompts are ids")
    import model as gf_model
    if os.path.dirname(os.path.abspath(gf_model.__file__)) != path:
        raise SystemExit(f"imported model.py from {gf_model.__file__}, not from {path}")
    file = os.path.join(path, "generate_spec.py")
    if not os.path.isfile(file):
        raise SystemExit(f"no {file}: run bench/tools/fetch_gpt_fast.sh again (it writes "
                         "generate.py as of the last revision whose speculative decoding runs)")
    gen = None
    if torch_like is sys.modules["torch"]:
        try:
            import generate_spec as gen
        except Exception as e:
            NOTES.append(f"generate_spec.py did not import ({gfb.short(e)}); its functions "
                         "were run from its source")
    if gen is None:
        gen = module_from_source(file, gf_model, torch_like)
    if torch_like is not sys.modules["torch"]:
        # Old torch indexes with int64 tensors only; speculative_decode indexes with the
        # sampled (int32) ids.
        sample_one = gen.multinomial_sample_one_no_sync
        gen.multinomial_sample_one_no_sync = lambda probs: sample_one(probs).long()
        NOTES.append("multinomial_sample_one_no_sync: ids made int64 (old torch's indexing)")
    commits = []
    for name in ("COMMIT", "COMMIT_SPEC"):
        if os.path.isfile(os.path.join(path, name)):
            commits.append(open(os.path.join(path, name)).read().strip())
    return gf_model, gen, commits


def module_from_source(file, gf_model, torch_like):
    """Every function of generate.py, unchanged, in a module of their own (without its
    module-level statements: inductor options, which configure_compiler sets)."""
    import itertools
    import typing
    from pathlib import Path
    tree = ast.parse(open(file).read(), file)
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    mod = types.ModuleType("generate")
    mod.__dict__.update({"torch": torch_like, "Optional": typing.Optional,
                         "Tuple": typing.Tuple, "Union": typing.Union, "Path": Path,
                         "itertools": itertools, "sys": sys, "time": time,
                         "Transformer": gf_model.Transformer, "default_device": "cpu"})
    exec(compile(ast.Module(body=body, type_ignores=[]), file, "exec"), mod.__dict__)
    return mod


# ---------------------------------------------------------------------------------------------
# Loading a Hugging Face Llama folder into gpt-fast's Transformer


def read_config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def model_args(cfg):
    """gpt-fast ModelArgs keywords for a Hugging Face Llama config."""
    def need(key):
        if key not in cfg:
            raise SystemExit(f"config.json: no {key}")
        return cfg[key]

    if cfg.get("model_type", "llama") != "llama":
        raise SystemExit(f"config.json: model_type {cfg.get('model_type')}: Llama only")
    dim, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = cfg.get("head_dim") or dim // heads
    if head_dim * heads != dim:
        raise SystemExit(f"config.json: head_dim {head_dim} x {heads} heads != hidden_size "
                         f"{dim}: gpt-fast's ModelArgs takes head_dim = dim / n_head")
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    args = dict(block_size=need("max_position_embeddings"), vocab_size=need("vocab_size"),
                n_layer=need("num_hidden_layers"), n_head=heads,
                n_local_heads=cfg.get("num_key_value_heads", heads), dim=dim,
                intermediate_size=need("intermediate_size"), rope_base=float(theta),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-5)))
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise SystemExit(f"config.json: rope_scaling {kind}: gpt-fast has Llama 3's only")
        args["rope_scaling"] = {k: scaling[k] for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    return args


def read_weights(folder, device):
    """name -> tensor of every safetensors file of the folder (on `device` with the
    safetensors package, else on the CPU)."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(folder, v) for v in json.load(f)["weight_map"].values()})
    if not files:
        raise SystemExit(f"{folder}: no *.safetensors")
    out = {}
    try:
        from safetensors.torch import load_file

        def load(p):
            return load_file(p, device=str(device))
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "tools", "oracle"))
        import safetensors_io

        def load(p):
            return safetensors_io.load(p)
    for p in files:
        out.update(load(p))
    return out


def permute_rope(w, n_heads, head_dim):
    """Rows of a q/k projection from rotate-half pairs (i, i + head_dim/2) to interleaved pairs
    (2i, 2i + 1), per head: gpt-fast's convert_hf_checkpoint.permute."""
    dim = w.shape[1]
    return (w.view(n_heads, 2, head_dim // 2, dim).transpose(1, 2)
            .reshape(head_dim * n_heads, dim))


def convert(hf, args, tied, permute=True):
    """gpt-fast state dict from a Hugging Face Llama state dict; every tensor used once.
    permute=False leaves q/k in Hugging Face's row order (only to show a check can fail)."""
    import torch
    hf = dict(hf)
    hd = args["dim"] // args["n_head"]
    rope_rows = permute_rope if permute else (lambda w, n, d: w)

    def take(name):
        if name not in hf:
            raise SystemExit(f"checkpoint: no {name}")
        return hf.pop(name)

    sd = {"tok_embeddings.weight": take("model.embed_tokens.weight"),
          "norm.weight": take("model.norm.weight")}
    sd["output.weight"] = (sd["tok_embeddings.weight"] if tied and "lm_head.weight" not in hf
                           else take("lm_head.weight"))
    for i in range(args["n_layer"]):
        p, g = f"model.layers.{i}.", f"layers.{i}."
        q = rope_rows(take(p + "self_attn.q_proj.weight"), args["n_head"], hd)
        k = rope_rows(take(p + "self_attn.k_proj.weight"), args["n_local_heads"], hd)
        v = take(p + "self_attn.v_proj.weight")
        sd[g + "attention.wqkv.weight"] = torch.cat([q, k, v])
        del q, k, v
        sd[g + "attention.wo.weight"] = take(p + "self_attn.o_proj.weight")
        sd[g + "feed_forward.w1.weight"] = take(p + "mlp.gate_proj.weight")
        sd[g + "feed_forward.w3.weight"] = take(p + "mlp.up_proj.weight")
        sd[g + "feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight")
        sd[g + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        sd[g + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
    left = [n for n in hf if not n.endswith("rotary_emb.inv_freq")]
    if left:
        raise SystemExit(f"checkpoint: tensors gpt-fast has no place for: {left[:5]}")
    return sd


def load_model(gf_model, folder, device, dtype, permute=True):
    """gpt-fast Transformer holding the folder's weights in `dtype` on `device`."""
    import torch
    cfg = read_config(folder)
    args = model_args(cfg)
    with torch.no_grad():
        sd = convert(read_weights(folder, device), args,
                     bool(cfg.get("tie_word_embeddings", False)), permute)
        # Built on the CPU with tiny stand-in parameters would still allocate them; build the
        # modules on the meta device where torch can, and put the real tensors in.
        if hasattr(torch.device, "__enter__"):
            with torch.device("meta"):
                model = gf_model.Transformer(gf_model.ModelArgs(**args))
        else:
            model = gf_model.Transformer(gf_model.ModelArgs(**args))
        for name, t in sd.items():
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            setattr(mod, attr, torch.nn.Parameter(t.to(device=device, dtype=dtype),
                                                  requires_grad=False))
        if "output.weight" in sd and sd["output.weight"] is sd["tok_embeddings.weight"]:
            model.output.weight = model.tok_embeddings.weight
    leftover = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise SystemExit(f"{folder}: parameters without weights: {leftover[:5]}")
    return model.eval(), args


# ---------------------------------------------------------------------------------------------
# Prompts


def load_prompt_ids(path, target_dir, limit):
    with open(path) as f:
        doc = json.load(f)
    items = doc["prompts"] if isinstance(doc, dict) else doc
    items = items[:limit] if limit else items
    tok = None
    out = []
    for it in items:
        if isinstance(it, dict) and it.get("ids"):
            out.append([int(x) for x in it["ids"]])
            continue
        text = it["text"] if isinstance(it, dict) else it
        if tok is None:
            tok = tokenizer_for(target_dir)
        out.append(tok(text))
    return out


def tokenizer_for(folder):
    file = os.path.join(folder, "tokenizer.json")
    try:
        from tokenizers import Tokenizer
        t = Tokenizer.from_file(file)
        return lambda text: t.encode(text, add_special_tokens=True).ids
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "tools", "eagle3"))
        import bpe_tokenizer
        t = bpe_tokenizer.load_tokenizer(file)
        NOTES.append("prompts tokenized by tools/eagle3/bpe_tokenizer.py (no post-processor)")
        return t.encode


# ---------------------------------------------------------------------------------------------
# Cases


def setup_caches(model, length, device):
    import torch
    ctx = torch.device(device) if hasattr(torch.device, "__enter__") else contextlib.nullcontext()
    with ctx:
        model.setup_caches(max_batch_size=1, max_seq_length=length)


def run_generate(gen, model, draft, prompt, args, k):
    """gpt-fast's generate() (1-D seq of prompt + new ids, {"accept_counts": [...]})."""
    return gen.generate(model, prompt, args.max_new_tokens, interactive=False,
                        draft_model=draft, speculate_k=k, temperature=args.temperature,
                        top_k=args.top_k)


def fresh_tokens(compiled):
    """generate_spec.py's decode_n_tokens feeds a view of the last call's output (the sampled
    id, cudagraph-managed memory) back as the next call's input; newer gpt-fast clones it
    (cur_token = next_token.clone()). This clones the ids (one element) before each call and
    marks a new cudagraph-trees step, as gpt_fast_bench.py does, so that no replay reads memory
    a replay overwrote. Every output gpt-fast keeps is cloned or consumed before its next call.
    --as-is runs without it."""
    def call(model, x, input_pos, **kwargs):
        x = x.clone()
        gfb.mark_step()
        return compiled(model, x, input_pos, **kwargs)
    return call


def run_case(name, k, gen, originals, model, draft, prompts, args, device, gate):
    """One case: compile (unless --no-compile), warm up, time every prompt. Returns its row."""
    import torch
    spec = k > 0
    attempts = []
    if not args.no_compile:
        attempts += [("compiled, CUDA graphs", True), ("compiled, CUDA graphs (no trees)", False)]
    attempts.append(("eager", None))
    failures = []
    for mode, trees in attempts:
        gfb.reset_compiler()
        gen.decode_one_token = originals["decode_one_token"]
        gen.model_forward = originals["model_forward"]
        if trees is not None:
            gfb.set_cudagraph_trees(trees)
            # As generate.py's main() with --compile (and --draft_checkpoint_path).
            wrap = (lambda f: f) if args.as_is else fresh_tokens
            if spec:
                gen.model_forward = wrap(torch.compile(originals["model_forward"],
                                                       mode="reduce-overhead", fullgraph=True))
            gen.decode_one_token = wrap(torch.compile(originals["decode_one_token"],
                                                      mode="reduce-overhead", fullgraph=True))
        try:
            t = time.time()
            run_generate(gen, model, draft if spec else None, prompts[0], args, max(k, 1))
            st.sync(device)
            first_s = time.time() - t
            log(f"{name}: {mode}: first call (compile) {first_s:.1f} s")
            for _ in range(args.warmup):
                run_generate(gen, model, draft if spec else None, prompts[0], args, max(k, 1))
            st.sync(device)
            gate.enter()
            try:
                times, counts, outputs = [], [0] * (max(k, 1) + 1), []
                for i, p in enumerate(prompts):
                    st.sync(device)
                    t = time.perf_counter()
                    seq, stats = run_generate(gen, model, draft if spec else None, p, args,
                                              max(k, 1))
                    st.sync(device)
                    times.append(time.perf_counter() - t)
                    if spec:
                        counts = [a + b for a, b in zip(counts, stats["accept_counts"])]
                    outputs.append(seq[p.numel():].tolist())
            finally:
                gate.leave()
        except Exception as e:
            traceback.print_exc()
            log(f"{name}: {mode} failed: {gfb.short(e)}")
            failures.append(f"{mode} failed: {gfb.short(e)}")
            continue
        finally:
            gfb.set_cudagraph_trees(True)
        n = args.max_new_tokens
        tps = [n / s for s in times]
        steps = sum(counts)
        row = {"case": name, "speculate_k": k or None, "mode": mode,
               "compile_s": round(first_s, 1) if trees is not None else None,
               "prompts": len(prompts), "new_tokens": n,
               "tok_s_median": statistics.median(tps), "tok_s_min": min(tps),
               "tok_s_max": max(tps), "tok_s_aggregate": n * len(times) / sum(times),
               "ms_per_token_median": 1e3 / statistics.median(tps),
               "tau": (sum((i + 1) * c for i, c in enumerate(counts)) / steps) if steps else None,
               "accept_counts": counts if spec else None, "steps": steps or None,
               "note": "; ".join(failures), "outputs": outputs}
        log(f"{name}: {mode}: median {row['tok_s_median']:.1f} tok/s over {len(prompts)} "
            f"prompts" + (f", tau {row['tau']:.2f}" if row["tau"] else ""))
        return row
    return {"case": name, "speculate_k": k or None, "mode": "failed",
            "note": "; ".join(failures), "outputs": []}


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(rows):
    plain = next((r for r in rows if r["case"] == "plain" and r.get("tok_s_median")), None)
    print("| case | mode | tok/s (median) | tok/s (all) | x plain | tau | accept counts | "
          "compile s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for r in rows:
        ratio = (r["tok_s_median"] / plain["tok_s_median"]
                 if plain and r.get("tok_s_median") else None)
        print(f"| {r['case']} | {r['mode']} | {fmt(r.get('tok_s_median'))} | "
              f"{fmt(r.get('tok_s_aggregate'))} | {fmt(ratio, 2)} | {fmt(r.get('tau'), 2)} | "
              f"{r.get('accept_counts') or '-'} | {fmt(r.get('compile_s'))} |")
        if r.get("note"):
            print(f"  note ({r['case']}): {r['note']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target folder (Hugging Face Llama)")
    ap.add_argument("--draft", default="", help="draft folder (needed for --ks)")
    ap.add_argument("--gpt-fast-dir", default=os.path.join(ROOT, ".carry-gptfast", "gpt-fast"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="weights and activations (gpt-fast's generate.py: bf16)")
    ap.add_argument("--ks", default="3,5", help="speculate_k values, one case each")
    ap.add_argument("--no-plain", action="store_true", help="no case without the draft")
    ap.add_argument("--prompts", default=os.path.join(ROOT, "bench", "prompts",
                                                      "code_prompts.json"))
    ap.add_argument("--num-prompts", type=int, default=8, help="the first N prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1, help="calls after the compiling one")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: gpt-fast clamps it to 1e-5")
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true", help="eager gpt-fast only")
    ap.add_argument("--no-coordinate-descent", action="store_true",
                    help="turn off generate.py's inductor coordinate_descent_tuning")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="start no new case after this many seconds")
    ap.add_argument("--json", default="", help="rows (without the tokens) and versions")
    ap.add_argument("--tokens-json", default="", help="every case's generated ids per prompt")
    ap.add_argument("--gate-dir", default="")
    ap.add_argument("--gate-count", type=int, default=1)
    ap.add_argument("--gate-timeout-s", type=float, default=900)
    ap.add_argument("--as-is", action="store_true",
                    help="compiled step functions called exactly as generate.py calls them "
                    "(see fresh_tokens)")
    ap.add_argument("--skip-rope-permute", action="store_true",
                    help="a wrong conversion (q/k rows left in rotate-half order), for the "
                    "negative control of tests/tools/test_gpt_fast_spec.py")
    ap.add_argument("--seed", type=int, default=1234, help="torch seed (generate.py's)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)

    import torch
    device = args.device
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ks = st.ints(args.ks) if args.ks else []
    if any(k < 1 for k in ks):
        raise SystemExit("--ks: every speculate_k must be >= 1")
    if ks and not args.draft:
        raise SystemExit("--draft: needed for --ks")
    gate = gfb.Gate(args.gate_dir, args.gate_count, args.gate_timeout_s)
    gf_model, gen, commits = import_gpt_fast(args.gpt_fast_dir)
    commit = "model.py " + (commits[0][:7] if commits else "?") + ", generate_spec.py " + (
        commits[1][:7] if len(commits) > 1 else "?")
    # configure_compiler reads the option gpt_fast_bench.py names no_coordinate_descent.
    settings = {} if args.no_compile else gfb.configure_compiler(args)
    originals = {"decode_one_token": gen.decode_one_token, "model_forward": gen.model_forward}
    meta = st.env_info(device)
    meta.update({"impl": "gpt-fast speculative decoding", "gpt_fast_commits": commits,
                 "target": os.path.abspath(args.target),
                 "draft": os.path.abspath(args.draft) if args.draft else None,
                 "dtype": args.dtype, "compiler_settings": settings,
                 "sampling": {"temperature": args.temperature, "top_k": args.top_k},
                 "max_new_tokens": args.max_new_tokens, "warmup": args.warmup,
                 "synthetic": read_config(args.target).get("specd_synthetic")})
    log(f"torch {torch.__version__}, {meta.get('gpu', device)}; gpt-fast "
        f"{commit}")

    t = time.time()
    permute = not args.skip_rope_permute
    model, margs = load_model(gf_model, args.target, device, dtype, permute)
    draft = None
    if args.draft:
        draft, dargs = load_model(gf_model, args.draft, device, dtype, permute)
        if dargs["vocab_size"] != margs["vocab_size"]:
            raise SystemExit("--draft: vocabulary differs from the target's")
    st.sync(device)
    log(f"loaded target ({margs['n_layer']} layers) and draft "
        f"({dargs['n_layer'] if draft else 0} layers) in {time.time() - t:.1f} s")
    prompts_ids = load_prompt_ids(args.prompts, args.target, args.num_prompts)
    bad = [i for i, p in enumerate(prompts_ids) if max(p) >= margs["vocab_size"]]
    if bad:
        raise SystemExit(f"--prompts: prompts {bad} hold ids beyond the vocabulary")
    prompts = [torch.tensor(p, dtype=torch.int, device=device) for p in prompts_ids]
    length = max(len(p) for p in prompts_ids) + args.max_new_tokens + max(ks or [0]) + 1
    setup_caches(model, length, device)
    if draft is not None:
        setup_caches(draft, length, device)
    meta.update({"model_args": margs, "prompt_tokens": [len(p) for p in prompts_ids],
                 "cache_positions": model.max_seq_length})
    for n in NOTES + gfb.NOTES:
        log(f"note: {n}")

    cases = ([] if args.no_plain else [("plain", 0)]) + [(f"k{k}", k) for k in ks]
    rows = []
    for name, k in cases:
        if time.time() - T0 > args.budget_s:
            rows.append({"case": name, "speculate_k": k or None, "mode": "skipped",
                         "note": f"over --budget-s {args.budget_s:g}", "outputs": []})
            log(f"{name}: skipped (over --budget-s)")
            continue
        torch.manual_seed(args.seed)
        rows.append(run_case(name, k, gen, originals, model, draft, prompts, args, device, gate))
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()

    meta["elapsed_s"] = round(time.time() - T0, 1)
    meta["notes"] = NOTES + gfb.NOTES
    print(f"\n## gpt-fast speculative decoding ({meta.get('gpu', device)}, torch "
          f"{torch.__version__}, gpt-fast {commit}), {args.dtype}, batch 1, "
          f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, temperature "
          f"{args.temperature:g} (clamped to 1e-5) top-k {args.top_k}; "
          f"{meta['elapsed_s']} s in all")
    for n in meta["notes"]:
        print(f"note: {n}")
    print_table(rows)
    best = max((r for r in rows if r.get("speculate_k") and r.get("tok_s_median")),
               key=lambda r: r["tok_s_median"], default=None)
    if best:
        print(f"best k: {best['speculate_k']} ({best['tok_s_median']:.1f} tok/s, tau "
              f"{best['tau']:.2f})")
    if args.tokens_json:
        with open(args.tokens_json, "w") as f:
            json.dump({"prompt_ids": prompts_ids,
                       "cases": {r["case"]: r["outputs"] for r in rows}}, f)
    if args.json:
        st.write_json(args.json, meta, [{k: v for k, v in r.items() if k != "outputs"}
                                        for r in rows])
        print(f"wrote {args.json}", flush=True)
    return 0 if all(r["mode"] not in ("failed",) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
