#!/usr/bin/env python3
"""Peer baseline: Hugging Face transformers, eager (no torch.compile, no CUDA graphs), one step
at a time at the shapes of cuda_step_bench: LlamaForCausalLM built from the LlamaConfig of
Llama-3.1-8B or Llama-3.2-1B (bench/tools/llama_shapes.py) with random bf16 weights on the GPU
(seed 0; linear and embedding weights N(0, 0.02²), norms ones), batch 1, default SDPA
attention, a DynamicCache filled to the context by chunked forwards.

  decode rows   one forward of 1 token at the context.
  verify rows   one forward of tree nodes + 1 tokens at the context (the pending token and the
                nodes, as specd scores a tree); transformers' causal mask makes them a chain,
                not a tree.

After each step the cache is cropped back to the context (DynamicCache.crop, outside the timed
region for "step ms"), so every step runs at the same context. The logits of every new token
are computed, as a verify step needs them. Table format: bench/tools/step_timing.py.

  PYTHONUNBUFFERED=1 python3 bench/hf_step_baseline.py --shape llama-3.1-8b \
      [--contexts 512,2048,8192] [--trees 1,16,64,128,256] [--runs 20] [--json OUT.json]
"""
import argparse
import os
import sys
import time
import traceback
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench", "tools"))
import llama_shapes  # noqa: E402
import step_timing as st  # noqa: E402

T0 = time.time()


def log(msg):
    print(f"[hf-step {time.time() - T0:6.1f}s] {msg}", flush=True)


def short(e):
    return f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")[:160]


def build_model(shape, device, attn, seed, std):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    # from_dict reads the config.json layout (rope_theta / rope_scaling included) as
    # from_pretrained does, whatever this transformers version calls those fields inside.
    config = LlamaConfig.from_dict(llama_shapes.hf_config(shape))
    try:
        config._attn_implementation = attn
    except Exception:
        pass
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if getattr(model.config, "_attn_implementation", None) != attn and hasattr(
            model, "set_attn_implementation"):
        model.set_attn_implementation(attn)
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # a tied weight is listed once
            if p.dtype != torch.bfloat16:
                p.data = p.data.to(torch.bfloat16)
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    model.requires_grad_(False)
    return model.eval(), config


def new_cache(config):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=config)
    except TypeError:
        return DynamicCache()


def forward(model, x, cache, keep_last_only=False):
    if keep_last_only:
        try:
            return model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        except TypeError:
            pass
    return model(input_ids=x, past_key_values=cache, use_cache=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b",
                    choices=sorted(llama_shapes.SHAPES) + ["tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--trees", default="1,16,64,128,256",
                    help="tree node counts; each verify row forwards nodes + 1 tokens")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=110,
                    help="start no new case after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)

    import torch
    import transformers
    device = args.device
    meta = st.env_info(device)
    meta.update({"impl": "transformers", "transformers": transformers.__version__,
                 "shape": args.shape, "runs": args.runs, "warmup": args.warmup})
    log(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
        f"{transformers.__version__}, {meta.get('gpu', device)}")
    t = time.time()
    model, config = build_model(args.shape, device, args.attn, args.seed, args.std)
    st.sync(device)
    attn = getattr(model.config, "_attn_implementation", None)
    weight_bytes = st.param_bytes(model)
    bw = st.copy_bandwidth(device)
    floor_ms = weight_bytes / bw * 1e3 if bw else None
    meta.update({"attn_implementation": attn, "weight_bytes": weight_bytes,
                 "copy_bandwidth_GBps": bw / 1e9 if bw else None, "floor_ms": floor_ms})
    log(f"{args.shape}: {weight_bytes / 1e9:.2f} GB of bf16 weights, attention {attn}, built "
        f"in {time.time() - t:.1f} s" +
        (f"; device copy {bw / 1e9:.0f} GB/s, floor {floor_ms:.3f} ms" if bw else ""))

    vocab = config.vocab_size
    cases = ([] if args.no_decode else [0]) + st.ints(args.trees)
    deadline = T0 + args.budget_s
    rows = []
    print(st.table_header(), flush=True)

    def add(row):
        rows.append(row)
        print(st.table_row(row), flush=True)

    for ctx in st.ints(args.contexts):
        base = {"impl": "transformers", "shape": args.shape, "tp": 1, "cache": "dynamic",
                "context": ctx}
        if time.time() > deadline:
            for n in cases:
                add(dict(base, **{"tree nodes": "decode" if n == 0 else n,
                                  "tokens": 1 if n == 0 else n + 1, "mode": "skipped",
                                  "note": f"over --budget-s {args.budget_s:g}"}))
            continue
        cache = None
        try:
            t = time.time()
            cache = new_cache(config)
            torch.manual_seed(args.seed + 1)
            with torch.no_grad():
                for done in range(0, ctx, 2048):
                    n = min(2048, ctx - done)
                    x = torch.randint(0, vocab, (1, n), device=device)
                    forward(model, x, cache, keep_last_only=True)
            st.sync(device)
            assert cache.get_seq_length() == ctx, (cache.get_seq_length(), ctx)
            log(f"DynamicCache prefilled to {ctx} in {time.time() - t:.1f} s")
        except Exception as e:
            traceback.print_exc()
            for n in cases:
                add(dict(base, **{"tree nodes": "decode" if n == 0 else n,
                                  "tokens": 1 if n == 0 else n + 1, "mode": "failed",
                                  "note": f"prefill: {short(e)}"}))
            cache = None
            continue
        for nodes in cases:
            tokens = 1 if nodes == 0 else nodes + 1
            row = dict(base, **{"tree nodes": "decode" if nodes == 0 else nodes,
                                "tokens": tokens})
            if time.time() > deadline:
                add(dict(row, mode="skipped", note=f"over --budget-s {args.budget_s:g}"))
                continue
            try:
                x = torch.randint(0, vocab, (1, tokens), device=device)

                def call(x=x):
                    forward(model, x, cache)

                with torch.no_grad():
                    first_s, step_ms, b2b_ms, _ = st.measure(
                        call, device, args.runs, args.warmup, between=lambda: cache.crop(ctx))
                assert cache.get_seq_length() == ctx, (cache.get_seq_length(), ctx)
                add(dict(row, **{"step ms": step_ms, "back-to-back ms": b2b_ms,
                                 "x floor": step_ms / floor_ms if floor_ms else None,
                                 "mode": f"eager, {attn}",
                                 "note": "chain of tokens (causal mask)" if nodes
                                 else "forward only"}))
            except Exception as e:
                traceback.print_exc()
                add(dict(row, mode="failed", note=short(e)))
                try:
                    cache.crop(ctx)
                except Exception:
                    pass
        cache = None
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()

    meta["elapsed_s"] = round(time.time() - T0, 1)
    print(f"\n## transformers {transformers.__version__} eager ({attn}), {args.shape} "
          f"({meta.get('gpu', device)}, torch {torch.__version__}); floor {st.fmt(floor_ms)} ms; "
          f"{meta['elapsed_s']} s in all")
    print("decode = one forward of 1 token; verify = one forward of nodes + 1 tokens in a chain "
          "(causal mask, no tree); DynamicCache cropped back to the context after each step")
    st.print_table(sorted(rows, key=lambda r: (r["context"], r["tokens"])))
    if args.json:
        st.write_json(args.json, meta, rows)
        print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
