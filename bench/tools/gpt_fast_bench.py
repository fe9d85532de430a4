#!/usr/bin/env python3
"""Peer baseline: gpt-fast (pytorch-labs/gpt-fast: torch.compile, mode="reduce-overhead", i.e.
CUDA graphs) at the shapes of cuda_step_bench, batch 1, random bf16 weights, in the same run:

  decode rows   gpt-fast's generate.decode_one_token (forward of 1 token + its sampling, with
                temperature 0.8 and top-k 200 as generate.py's defaults), compiled as
                generate.py compiles it and run under the math-only SDPA context that
                decode_n_tokens puts around it.
  verify rows   gpt-fast's generate.model_forward over `tokens` = tree nodes + 1 new tokens (the
                pending token and the nodes, as specd scores a tree and as gpt-fast's
                speculative_decode scores speculate_k + 1 tokens), compiled as generate.py
                compiles it for speculative decoding. gpt-fast has no tree attention: its mask
                is causal among the new tokens (a chain), the closest equivalent to a tree of
                that many nodes. Forward only (speculative_decode's eager acceptance is not
                timed).

gpt-fast's code is not part of this repository: bench/tools/fetch_gpt_fast.sh copies it into
an ignored folder (default .carry-gptfast/gpt-fast), and this script imports model.py,
generate.py and tp.py from there (tokenizer.py needs sentencepiece and tiktoken; a stub takes its
place when they are missing: no tokenizer is used).

The model is gpt-fast's Transformer built from ModelArgs of the shape (bench/tools/
llama_shapes.py), initialised on the device (seed 0; linear and embedding weights N(0, 0.02²),
norms ones; tied embeddings for Llama-3.2-1B), KV cache by setup_caches(max_batch_size=1,
max_seq_length=context + --cache-extra), as generate.py sizes it for prompt + new tokens;
gpt-fast attends over the whole static cache (masked), so its step time depends on that length.
The cache is filled to the context by gpt-fast's forward in eager mode (2048-token chunks).

Every case (shape of inputs and cache) is compiled afresh with static shapes; on failure it is
retried with CUDA graphs without cudagraph trees (gpt-fast's own workaround for speculative
decoding with tensor parallelism), then eagerly, and the table says which ran. Cases past
--budget-s are skipped and listed as such.

Tensor parallelism: under torchrun --nproc_per_node N, each rank applies gpt-fast's
tp.apply_tp (NCCL, functional all-reduces inside the compiled graph) and rank 0 reports.

  python3 bench/tools/gpt_fast_bench.py --shape llama-3.1-8b [--contexts 512,2048,8192]
      [--trees 64,16,256,128,1] [--runs 20] [--budget-s 230] [--json OUT.json]
  torchrun --standalone --nproc_per_node 2 bench/tools/gpt_fast_bench.py --shape llama-3.1-8b
  python3 bench/tools/gpt_fast_bench.py --shape tiny --device cpu --no-compile   (smoke test)
"""
import os

# Never NVLink multicast on these hosts (NCCL NVLS, torch symmetric-memory multicast).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse
import ast
import atexit
import contextlib
import datetime
import fcntl
import glob
import sys
import time
import traceback
import types
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama_shapes  # noqa: E402
import step_timing as st  # noqa: E402

T0 = time.time()
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
NOTES = []


def log(msg):
    if RANK == 0:
        print(f"[gpt-fast {time.time() - T0:6.1f}s] {msg}", flush=True)


def err(msg):
    print(f"[gpt-fast rank {RANK} {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def short(e):
    text = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return text[:160]


class Gate:
    """Lets several single-case processes compile at once and time one at a time (--gate-dir):
    each marks itself ready once its case is compiled and warm (or when it exits, whatever
    happened), waits until --gate-count processes are ready, so that no compilation or
    autotuning runs beside a timed loop, then times under an exclusive lock on DIR/lock.
    Without a directory it does nothing."""

    def __init__(self, directory, count, timeout_s):
        self.dir, self.count, self.timeout_s = directory, count, timeout_s
        self.lock = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            atexit.register(self.ready)

    def ready(self):
        if self.dir:
            open(os.path.join(self.dir, f"ready.{os.getpid()}"), "a").close()

    def enter(self):
        if not self.dir or self.lock is not None:
            return
        self.ready()
        t = time.time()
        while (len(glob.glob(os.path.join(self.dir, "ready.*"))) < self.count and
               time.time() - t < self.timeout_s):
            time.sleep(0.5)
        waited = time.time() - t
        self.lock = open(os.path.join(self.dir, "lock"), "a")
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        log(f"gate: {waited:.0f} s for the others to compile, "
            f"{time.time() - t - waited:.0f} s for the lock")

    def leave(self):
        if self.lock is not None:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.lock.close()
            self.lock = None


def import_gpt_fast(path):
    """Imports gpt-fast's model.py and the step functions of its generate.py from `path`."""
    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, "model.py")):
        raise SystemExit(f"no gpt-fast model.py in {path}: run bench/tools/fetch_gpt_fast.sh "
                         "here and carry the folder along")
    sys.path.insert(0, path)
    try:
        import tokenizer  # noqa: F401
    except Exception as e:  # sentencepiece / tiktoken are not on the GPU host
        stub = types.ModuleType("tokenizer")

        def get_tokenizer(*_a, **_k):
            raise RuntimeError("gpt_fast_bench: tokenizer stub (no tokenizer in a benchmark)")

        stub.get_tokenizer = get_tokenizer
        sys.modules["tokenizer"] = stub
        NOTES.append(f"tokenizer.py replaced by a stub ({short(e)})")
    import model as gf_model
    if os.path.dirname(os.path.abspath(gf_model.__file__)) != path:
        raise SystemExit(f"imported model.py from {gf_model.__file__}, not from {path}")
    names = ["decode_one_token", "model_forward", "sample", "logits_to_probs",
             "multinomial_sample_one_no_sync"]
    try:
        import generate as gf_generate
        fns = {n: getattr(gf_generate, n) for n in names}
    except Exception as e:
        # generate.py sets inductor options at import; if one of them no longer exists in this
        # torch, take its step functions alone (gpt-fast's own code, unchanged) from its source.
        NOTES.append(f"generate.py did not import ({short(e)}); its step functions were "
                     "taken from its source and the inductor options set here")
        fns = functions_from_source(os.path.join(path, "generate.py"), names, gf_model)
    commit = ""
    cpath = os.path.join(path, "COMMIT")
    if os.path.isfile(cpath):
        commit = open(cpath).read().strip()
    return gf_model, fns, commit


def functions_from_source(file, names, gf_model):
    import typing
    import torch
    tree = ast.parse(open(file).read(), file)
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    ns = {"torch": torch, "Optional": typing.Optional, "Tuple": typing.Tuple,
          "Union": typing.Union, "Transformer": gf_model.Transformer}
    exec(compile(ast.Module(body=body, type_ignores=[]), file, "exec"), ns)
    return {n: ns[n] for n in names}


def configure_compiler(args):
    """generate.py's inductor options (set again here in case its import failed), plus static
    shapes for every case (each case is compiled on its own)."""
    import torch
    settings = {}

    def put(obj, name, value, label):
        try:
            setattr(obj, name, value)
            settings[label] = value
        except Exception as e:
            NOTES.append(f"could not set {label}: {short(e)}")

    try:
        import torch._dynamo.config as dc
        import torch._inductor.config as ic
    except Exception as e:
        NOTES.append(f"no torch._dynamo / torch._inductor ({short(e)})")
        return settings
    put(ic, "coordinate_descent_tuning", not args.no_coordinate_descent,
        "inductor.coordinate_descent_tuning")
    put(ic.triton, "unique_kernel_names", True, "inductor.triton.unique_kernel_names")
    put(ic, "fx_graph_cache", True, "inductor.fx_graph_cache")
    try:
        put(torch._functorch.config, "enable_autograd_cache", True,
            "functorch.enable_autograd_cache")
    except Exception:
        pass
    put(dc, "automatic_dynamic_shapes", False, "dynamo.automatic_dynamic_shapes")
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name):
            put(dc, name, 64, f"dynamo.{name}")
    return settings


def set_cudagraph_trees(on):
    try:
        import torch._inductor.config as ic
        ic.triton.cudagraph_trees = on
    except Exception:
        pass


def reset_compiler():
    import torch
    try:
        torch._dynamo.reset()
    except Exception:
        pass
    try:
        from torch._inductor import cudagraph_trees
        cudagraph_trees.reset_cudagraph_trees()
    except Exception:
        pass


def mark_step():
    import torch
    f = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    if f is not None:
        f()


def sdpa_math():
    """The context decode_n_tokens runs decode_one_token in: math SDPA only, which inductor
    generates its own attention code for ("Actually better for Inductor to codegen attention
    here", generate.py)."""
    import torch
    f = getattr(torch.backends.cuda, "sdp_kernel", None)
    if f is not None:
        try:
            return f(enable_flash=False, enable_mem_efficient=False, enable_math=True)
        except Exception:
            pass
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.MATH])
    except Exception:
        return contextlib.nullcontext()


def build_model(gf_model, shape, device, seed, std):
    import torch
    kwargs = llama_shapes.gpt_fast_args(shape)
    tied = llama_shapes.shape(shape)[0]["tie_word_embeddings"]
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = gf_model.Transformer(gf_model.ModelArgs(**kwargs))
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
        if tied:
            model.output.weight = model.tok_embeddings.weight
    model.requires_grad_(False)
    return model.eval(), kwargs


def apply_tp(model):
    """gpt-fast's tp.apply_tp, then each shard copied into storage of its own, as generate.py's
    _load_model ends up with (it shards on the host, then moves the model to the GPU)."""
    import torch
    import tp as gf_tp
    gf_tp.apply_tp(model)
    with torch.no_grad():
        for block in model.layers:
            for lin in (block.attention.wqkv, block.attention.wo, block.feed_forward.w1,
                        block.feed_forward.w2, block.feed_forward.w3):
                lin.weight = torch.nn.Parameter(lin.weight.detach().clone(
                    memory_format=torch.contiguous_format), requires_grad=False)
    torch.cuda.empty_cache()


def setup_cache(model, length, device):
    import torch
    model.max_seq_length = -1  # setup_caches keeps a larger cache; always make this one
    model.max_batch_size = -1
    with torch.device(device):
        model.setup_caches(max_batch_size=1, max_seq_length=length)
    return model.max_seq_length


def prefill(model, context, vocab, device, chunk=2048):
    import torch
    done = 0
    while done < context:
        n = min(chunk, context - done)
        x = torch.randint(0, vocab, (1, n), device=device, dtype=torch.int)
        pos = torch.arange(done, done + n, device=device)
        model(x, pos)
        done += n
    st.sync(device)


class Dist:
    """Keeps the ranks of a tensor-parallel run on the same path through the cases."""

    def __init__(self, device):
        self.device = device

    def all_ok(self, ok):
        if WORLD == 1:
            return ok
        import torch
        import torch.distributed as dist
        t = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def rank0_says(self, yes):
        if WORLD == 1:
            return yes
        import torch
        import torch.distributed as dist
        t = torch.tensor([1 if yes else 0], device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item())

    def barrier(self):
        if WORLD > 1:
            import torch.distributed as dist
            dist.barrier()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b",
                    choices=sorted(llama_shapes.SHAPES) + ["tiny"])
    ap.add_argument("--gpt-fast-dir", default=".carry-gptfast/gpt-fast")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--trees", default="64,16,256,128,1",
                    help="tree node counts, in the order to run them (cases past --budget-s "
                    "are skipped); each verify row forwards nodes + 1 tokens")
    ap.add_argument("--no-decode", action="store_true", help="verify rows only")
    ap.add_argument("--cache", choices=["per-context", "shared"], default="per-context",
                    help="per-context: max_seq_length = context + --cache-extra for each "
                    "context (as generate.py sizes it; one compile per case); shared: one "
                    "cache of max(contexts) + --cache-extra for all (one compile per token "
                    "count, reused at every context)")
    ap.add_argument("--cache-extra", type=int, default=300)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5,
                    help="calls before timing, the compiling first call included (CUDA "
                    "graphs are recorded on the second)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=200)
    ap.add_argument("--no-compile", action="store_true", help="eager gpt-fast only")
    ap.add_argument("--no-coordinate-descent", action="store_true",
                    help="turn off generate.py's inductor coordinate_descent_tuning (shorter "
                    "compiles, maybe slower kernels)")
    ap.add_argument("--cudagraph-trees", choices=["auto", "on", "off"], default="auto",
                    help="auto: off for verify rows under tensor parallelism, as generate.py "
                    "does for speculative decoding with TP; on otherwise")
    ap.add_argument("--budget-s", type=float, default=230,
                    help="start no new case after this many seconds")
    ap.add_argument("--dist-timeout-s", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--json", default="")
    ap.add_argument("--gate-dir", default="",
                    help="time only once --gate-count processes sharing this directory have "
                    "compiled, one at a time (see Gate; single-case processes run side by side "
                    "by baselines.sh with GF_PARALLEL)")
    ap.add_argument("--gate-count", type=int, default=1)
    ap.add_argument("--gate-timeout-s", type=float, default=900)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)

    import torch
    device = args.device
    if WORLD > 1:
        import torch.distributed as dist
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        # As tp.maybe_init_dist does, with a timeout so that a rank left alone gives up.
        dist.init_process_group(backend="nccl", rank=RANK, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=args.dist_timeout_s))
    sync_ranks = Dist(device)
    gate = Gate(args.gate_dir if RANK == 0 else "", args.gate_count, args.gate_timeout_s)
    gf_model, fns, commit = import_gpt_fast(args.gpt_fast_dir)
    settings = {} if args.no_compile else configure_compiler(args)
    contexts = st.ints(args.contexts)
    trees = st.ints(args.trees)
    meta = st.env_info(device)
    meta.update({"impl": "gpt-fast", "gpt_fast_commit": commit, "shape": args.shape,
                 "tp": WORLD, "cache": args.cache, "cache_extra": args.cache_extra,
                 "runs": args.runs, "warmup": args.warmup, "compiler_settings": settings,
                 "sampling": {"temperature": args.temperature, "top_k": args.top_k}})
    log(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {meta.get('gpu', device)}, "
        f"tp {WORLD}; gpt-fast {commit or '(no COMMIT file)'}")

    t = time.time()
    model, margs = build_model(gf_model, args.shape, device, args.seed, args.std)
    if WORLD > 1:
        apply_tp(model)
    st.sync(device)
    weight_bytes = st.param_bytes(model)
    bw = st.copy_bandwidth(device)
    floor_ms = weight_bytes / bw * 1e3 if bw else None
    meta.update({"model_args": margs, "weight_bytes_per_rank": weight_bytes,
                 "copy_bandwidth_GBps": bw / 1e9 if bw else None, "floor_ms": floor_ms})
    log(f"{args.shape}: {weight_bytes / 1e9:.2f} GB of bf16 weights per rank, built in "
        f"{time.time() - t:.1f} s" +
        (f"; device copy {bw / 1e9:.0f} GB/s (read + write), floor = weights / that = "
         f"{floor_ms:.3f} ms" if bw else ""))
    for n in NOTES:
        log(f"note: {n}")

    sampling = {"temperature": args.temperature, "top_k": args.top_k}
    cases = ([] if args.no_decode else [0]) + trees  # 0 = decode
    if args.cache == "per-context":
        # Case by case in the order given (decode first), each at every context: the cases
        # that matter most come first when --budget-s cuts the run short.
        groups = [(c + args.cache_extra, [c], n) for n in cases for c in contexts]
    else:
        groups = [(max(contexts) + args.cache_extra, sorted(contexts), n) for n in cases]
    deadline = T0 + args.budget_s
    rows = []
    vocab = margs["vocab_size"]
    current_len = None
    prefilled = 0
    if RANK == 0:
        print(st.table_header(), flush=True)

    def add(row):
        rows.append(row)
        if RANK == 0:
            print(st.table_row(row), flush=True)

    for length, ctxs, nodes in groups:
        tokens = 1 if nodes == 0 else nodes + 1
        base = {"impl": "gpt-fast", "shape": args.shape, "tp": WORLD,
                "tree nodes": "decode" if nodes == 0 else nodes, "tokens": tokens}
        if not sync_ranks.rank0_says(time.time() < deadline):
            for c in ctxs:
                add(dict(base, context=c, cache=length, mode="skipped",
                         note=f"over --budget-s {args.budget_s:g}"))
            continue
        try:
            if length != current_len:
                reset_compiler()
                current_len = None
                t = time.time()
                real_len = setup_cache(model, length, device)
                torch.manual_seed(args.seed + 1)
                with torch.no_grad():
                    prefill(model, max(ctxs), vocab, device)
                current_len, prefilled = length, max(ctxs)
                log(f"cache of {real_len} positions, prefilled to {prefilled} in "
                    f"{time.time() - t:.1f} s (eager)")
            ok = True
        except Exception as e:
            traceback.print_exc()
            err(f"cache setup / prefill failed: {short(e)}")
            ok = False
        if not sync_ranks.all_ok(ok):
            for c in ctxs:
                add(dict(base, context=c, cache=length, mode="failed",
                         note="cache setup / prefill failed"))
            current_len = None
            continue
        real_len = model.max_seq_length
        too_long = [c for c in ctxs if c + tokens > real_len]
        ctxs = [c for c in ctxs if c + tokens <= real_len]
        for c in too_long:
            add(dict(base, context=c, cache=real_len, mode="skipped",
                     note="context + tokens exceed the cache (raise --cache-extra)"))
        if not ctxs:
            continue

        attempts = []
        if not args.no_compile:
            trees_on = {"on": True, "off": False}.get(args.cudagraph_trees,
                                                      not (WORLD > 1 and nodes > 0))
            attempts.append(("compiled, CUDA graphs" + ("" if trees_on else " (no trees)"),
                             trees_on))
            if trees_on:
                attempts.append(("compiled, CUDA graphs (no trees)", False))
        attempts.append(("eager", None))
        failures = []
        for mode, trees_on in attempts:
            results, error = [], None
            try:
                reset_compiler()
                if trees_on is None:
                    decode_fn, forward_fn = fns["decode_one_token"], fns["model_forward"]
                else:
                    set_cudagraph_trees(trees_on)
                    if nodes == 0:
                        decode_fn = torch.compile(fns["decode_one_token"],
                                                  mode="reduce-overhead", fullgraph=True)
                    else:
                        forward_fn = torch.compile(fns["model_forward"],
                                                   mode="reduce-overhead", fullgraph=True)
                torch.manual_seed(args.seed + 2)
                x = torch.randint(0, vocab, (1, tokens), device=device, dtype=torch.int)
                for c in ctxs:
                    if nodes == 0:
                        pos = torch.tensor([c], device=device, dtype=torch.int)

                        def call(x=x, pos=pos):
                            mark_step()
                            with sdpa_math():
                                decode_fn(model, x, pos, **sampling)
                    else:
                        pos = torch.arange(c, c + tokens, device=device)

                        def call(x=x, pos=pos):
                            mark_step()
                            forward_fn(model, x, pos)
                    sync_ranks.barrier()
                    with torch.no_grad():
                        try:
                            first_s, step_ms, b2b_ms, _ = st.measure(
                                call, device, args.runs, args.warmup, before_timing=gate.enter)
                        finally:
                            gate.leave()
                    results.append((c, first_s, step_ms, b2b_ms))
            except Exception as e:
                traceback.print_exc()
                err(f"{args.shape} {base['tree nodes']} at {ctxs}, {mode}: {short(e)}")
                error = e
            finally:
                set_cudagraph_trees(True)
            if sync_ranks.all_ok(error is None):
                note = "; ".join(failures) + ("; " if failures else "")
                note += "chain of tokens (causal mask)" if nodes else "forward + sampling"
                for i, (c, first_s, step_ms, b2b_ms) in enumerate(results):
                    add(dict(base, context=c, cache=real_len, **{
                        "step ms": step_ms, "back-to-back ms": b2b_ms,
                        "x floor": step_ms / floor_ms if floor_ms else None,
                        "compile s": first_s if i == 0 and trees_on is not None else None,
                        "mode": mode, "note": note}))
                break
            failures.append(f"{mode} failed: " + (short(error) if error else "on another rank"))
        else:
            for c in ctxs:
                add(dict(base, context=c, cache=real_len, mode="failed",
                         note="; ".join(failures)))
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()

    meta["elapsed_s"] = round(time.time() - T0, 1)
    meta["notes"] = NOTES
    if RANK == 0:
        print(f"\n## gpt-fast, {args.shape}, tp {WORLD} ({meta.get('gpu', device)}, torch "
              f"{torch.__version__}, gpt-fast {commit[:12]}); floor "
              f"{st.fmt(floor_ms)} ms; {meta['elapsed_s']} s in all")
        print("decode = generate.decode_one_token (forward + sampling, temperature "
              f"{args.temperature:g}, top-k {args.top_k}); verify = generate.model_forward "
              "over nodes + 1 tokens in a chain (gpt-fast has no tree attention); "
              "cache = max_seq_length of gpt-fast's static KV cache, all of which it attends "
              "to (masked)")
        for n in NOTES:
            print(f"note: {n}")
        st.print_table(sorted(rows, key=lambda r: (r["context"], r["tokens"])))
        if args.json:
            st.write_json(args.json, meta, rows)
            print(f"wrote {args.json}", flush=True)
    if WORLD > 1:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
