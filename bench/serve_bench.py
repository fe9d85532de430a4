#!/usr/bin/env python3
"""End-to-end serving benchmark of a running specd router (specd.v1.Generation over gRPC), the
counterpart of vLLM's benchmarks/benchmark_serving.py.

Each phase (one --concurrency value, or one --request-rate) runs every --speculation mode on the
same prompts, interleaved in rounds (the mode order rotates each round) so that the modes share
the machine's ups and downs and the ratio of each mode's tokens/s to `off` is side by side.

  bench/serve_bench.py --target 127.0.0.1:50050 --concurrency 1,4,16,64 \\
      --speculation off,draft_model,ngram,auto --max-new-tokens 64 --ignore-eos \\
      --check-lossless --json out.json --plot out.png

Custom modes set the request's draft tree: `NAME=BASE:depth=D,top_k=K,nodes=N`, for example
`deep=draft_model:depth=8,nodes=32`.

Per phase and mode: output tokens/s, requests/s, TTFT, inter-token latency (a chunk of k tokens
that arrives g seconds after the previous one counts as k gaps of g/k: speculation streams
several tokens at once, and per-token gaps are what a reader of the stream sees on average),
end-to-end latency, acceptance rate and tau (the final response's SpeculationStats: tau =
(accepted + steps) / steps, tokens emitted per speculative step, bonus token included),
target-only steps, errors, and the ratio of tokens/s to `off`. With --metrics NAME=URL (the
services' /metrics), the mean time of a step inside each service and the router's own timing of
each leg, scraped before and after every run.

--check-lossless compares every completion of every mode token for token with `off`'s
completion of the same prompt (greedy, or sampling with --seed: specd's seeded sampling gives
the same tokens with speculation on and off); a mismatch is an error and the exit status is 1.
"""

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import grpc  # noqa: E402

from specd.v1 import generation_pb2 as pb  # noqa: E402
from specd.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

BASE_MODES = {
    "off": pb.SPECULATION_OFF,
    "auto": pb.SPECULATION_AUTO,
    "draft_model": pb.SPECULATION_DRAFT_MODEL,
    "ngram": pb.SPECULATION_NGRAM,
    "eagle3": pb.SPECULATION_EAGLE3,
}
MODE_NAMES = {v: k for k, v in BASE_MODES.items()}


class Mode:
    def __init__(self, name, base, depth=0, top_k=0, nodes=0):
        self.name, self.base, self.depth, self.top_k, self.nodes = name, base, depth, top_k, nodes

    def to_json(self):
        return {"name": self.name, "speculation": self.base, "draft_depth": self.depth,
                "draft_top_k": self.top_k, "draft_max_nodes": self.nodes}


def parse_modes(text):
    """off,draft_model,... and NAME=BASE:depth=D,top_k=K,nodes=N (the commas after the colon
    belong to the custom mode)."""
    modes = []
    parts = []
    for tok in (t.strip() for t in text.split(",")):
        key = tok.partition("=")[0]
        # depth=4 after a custom mode's colon continues that mode.
        if parts and key in ("depth", "top_k", "nodes") and ":" in parts[-1]:
            parts[-1] += "," + tok
        elif tok:
            parts.append(tok)
    for part in parts:
        if "=" in part.split(":")[0]:
            name, rest = part.split("=", 1)
            base, _, opts = rest.partition(":")
            if base not in BASE_MODES or not name:
                raise SystemExit(f"--speculation: {part}: base must be one of {list(BASE_MODES)}")
            kw = {}
            for opt in filter(None, opts.split(",")):
                k, _, v = opt.partition("=")
                if k not in ("depth", "top_k", "nodes") or not v.isdigit():
                    raise SystemExit(f"--speculation: {part}: options are depth=, top_k=, nodes=")
                kw[k] = int(v)
            modes.append(Mode(name, base, **kw))
        else:
            if part not in BASE_MODES:
                raise SystemExit(f"--speculation: {part}: not one of {list(BASE_MODES)} "
                                 "or NAME=BASE:depth=D,top_k=K,nodes=N")
            modes.append(Mode(part, part))
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise SystemExit("--speculation: mode names must be distinct")
    return modes


def load_prompts(path, limit=None):
    """bench/prompts/*.json ({"prompts": [{"text": ...}]}), a list of strings, or ShareGPT
    ([{"conversations": [{"from": "human", "value": ...}, ...]}]: the first human turn)."""
    with open(path) as f:
        doc = json.load(f)
    items = doc["prompts"] if isinstance(doc, dict) and "prompts" in doc else doc
    prompts = []
    for it in items:
        if isinstance(it, str):
            prompts.append(it)
        elif "text" in it:
            prompts.append(it["text"])
        elif "conversations" in it:
            turns = [c.get("value", "") for c in it["conversations"]
                     if c.get("from") in ("human", "user")]
            if turns and turns[0]:
                prompts.append(turns[0])
        elif "prompt" in it:
            prompts.append(it["prompt"])
    if not prompts:
        raise SystemExit(f"--prompts: {path}: no prompts found")
    return prompts[:limit] if limit else prompts


def pct(values, q):
    """The q-th percentile (linear interpolation, as numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


# ---- /metrics scraping -------------------------------------------------------------------------

METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEnaNinf]+)")
MODEL_LABEL_RE = re.compile(r',?model="(?:[^"\\]|\\.)*"')


def scrape(url):
    """{name{labels}: value} of a Prometheus text page; {} when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except Exception:  # noqa: BLE001  (a missing scrape must not stop the benchmark)
        return {}
    out = {}
    for line in text.splitlines():
        m = METRIC_RE.match(line)
        if m:
            try:
                # Every specd_ sample carries the service's model label; keys leave it out.
                labels = MODEL_LABEL_RE.sub("", m.group(2) or "").replace("{,", "{")
                labels = "" if labels == "{}" else labels.replace(",}", "}")
                out[m.group(1) + labels] = float(m.group(3))
            except ValueError:
                pass
    return out


def delta(before, after, key):
    return after.get(key, 0.0) - before.get(key, 0.0)


def kind_delta(before, after, name, kind):
    """delta of `name{kind="..."}`; a server without the kind label counts all as decode."""
    key = f'{name}{{kind="{kind}"}}'
    if key in after or key in before:
        return delta(before, after, key)
    return delta(before, after, name) if kind == "decode" else 0.0


def step_breakdown(before, after, wall_s):
    """Mean seconds per step of each leg from the scrapes around one run. Step and round-trip
    times are of decode steps only (no sequence fed its prompt); the prefill steps (some
    sequence's first step, or a resync) are kept apart as *_prefill_*, because their cost would
    weigh in a mean by how few decode steps the mode needed."""
    out = {}
    router_b, router_a = before.get("router", {}), after.get("router", {})
    for svc in ("verify", "draft"):
        b, a = before.get(svc, {}), after.get(svc, {})
        n = kind_delta(b, a, "specd_step_seconds_count", "prefill")
        if n > 0:
            out[f"{svc}_prefill_steps"] = n
            out[f"{svc}_prefill_step_s"] = kind_delta(b, a, "specd_step_seconds_sum",
                                                      "prefill") / n
        n = kind_delta(b, a, "specd_step_seconds_count", "decode")
        if n > 0:
            out[f"{svc}_steps"] = n
            out[f"{svc}_step_s"] = kind_delta(b, a, "specd_step_seconds_sum", "decode") / n
            out[f"{svc}_batch_mean"] = (delta(b, a, "specd_step_batch_size_sum") /
                                        max(delta(b, a, "specd_step_batch_size_count"), 1))
            # On a GPU: forwards captured into, replayed from, or run outside CUDA graphs.
            for key, name in (("captures", "specd_cuda_graph_captures_total"),
                              ("replays", "specd_cuda_graph_replays_total"),
                              ("eager", "specd_eager_steps_total")):
                if name in a:
                    out[f"{svc}_graph_{key}"] = delta(b, a, name)
        for kind, infix in (("decode", ""), ("prefill", "prefill_")):
            n = kind_delta(router_b, router_a, f"specd_{svc}_latency_seconds_count", kind)
            if n > 0:
                out[f"router_{svc}_{infix}rtt_s"] = kind_delta(
                    router_b, router_a, f"specd_{svc}_latency_seconds_sum", kind) / n
                out[f"router_{svc}_{infix}calls"] = n
    # Sequence steps by why they had the shape they had (the policy's choices, probes, ...),
    # and by the draft tree size they carried.
    for key in set(router_a) | set(router_b):
        if key.startswith("specd_spec_steps_total{"):
            n = delta(router_b, router_a, key)
            labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
            if n > 0 and "reason" in labels:
                by = out.setdefault("spec_steps_by_reason", {})
                by[labels["reason"]] = by.get(labels["reason"], 0) + n
                by = out.setdefault("spec_steps_by_tree_size", {})
                size = labels.get("tree_size", "?")
                by[size] = by.get(size, 0) + n
    # Overlap (--overlap on the router): pre-draft hit rate, and each service's idle share of
    # the router's step time.
    outcomes = [k for k in router_a if k.startswith("specd_predraft_outcomes_total{")]
    predrafts = sum(delta(router_b, router_a, k) for k in outcomes)
    if predrafts > 0:
        out["predraft_steps"] = predrafts
        out["predraft_hit_rate"] = sum(
            delta(router_b, router_a, k) for k in outcomes if 'result="hit"' in k) / predrafts
        # By accepted position, and what each guess rank (fan-out) adds to the hit rate.
        by_pos, hit_pos = {}, {}
        for k in outcomes:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', k))
            n = delta(router_b, router_a, k)
            pos = labels.get("position", "?")
            by_pos[pos] = by_pos.get(pos, 0) + n
            if labels.get("result") == "hit":
                hit_pos[pos] = hit_pos.get(pos, 0) + n
        out["predraft_hit_rate_by_position"] = {
            pos: hit_pos.get(pos, 0) / n for pos, n in sorted(by_pos.items()) if n > 0}
        for k in router_a:
            if k.startswith("specd_predraft_guess_hits_total{"):
                rank = dict(re.findall(r'(\w+)="([^"]*)"', k)).get("guess", "?")
                n = delta(router_b, router_a, k)
                if n > 0:
                    out.setdefault("predraft_hits_by_guess", {})[rank] = n / predrafts
    for k in router_a:
        if k.startswith("specd_overlap_decisions_total{"):
            n = delta(router_b, router_a, k)
            if n > 0:
                decision = dict(re.findall(r'(\w+)="([^"]*)"', k)).get("decision", "?")
                out.setdefault("overlap_decisions", {})[decision] = n
    # The ideal of a step whose draft and verify fully overlap: the tokens a verify step emits
    # over the slower of the two services' own step times.
    # The tokens come out of prefill steps too, so they are spread over all verify steps.
    tokens = delta(router_b, router_a, "specd_generation_tokens_total")
    slower = max(out.get("verify_step_s", 0.0), out.get("draft_step_s", 0.0))
    all_verify_steps = out.get("verify_steps", 0) + out.get("verify_prefill_steps", 0)
    if tokens > 0 and out.get("verify_steps") and slower > 0:
        out["tokens_per_verify_step"] = tokens / all_verify_steps
        out["ideal_tok_s"] = out["tokens_per_verify_step"] / slower
    step_s = delta(router_b, router_a, "specd_router_step_seconds_total")
    if step_s > 0:
        for svc in ("verify", "draft"):
            busy = delta(router_b, router_a, f'specd_service_busy_seconds_total{{service="{svc}"}}')
            out[f"{svc}_idle_fraction"] = max(0.0, 1.0 - busy / step_s)
    steps = out.get("router_verify_calls") or out.get("verify_steps")
    if steps:
        # Decode steps' share of the wall time: less the prefill steps' round trips.
        prefill_s = sum(out.get(f"router_{svc}_prefill_rtt_s", 0.0) *
                        out.get(f"router_{svc}_prefill_calls", 0) for svc in ("verify", "draft"))
        out["wall_per_step_s"] = max(0.0, wall_s - prefill_s) / steps
        legs = out.get("router_verify_rtt_s", 0.0) + (
            out.get("router_draft_rtt_s", 0.0) * out.get("router_draft_calls", 0) / steps)
        # What the legs do not explain: the router's own work per step (scheduling, tokenizer,
        # streaming to clients) and any time no step was running.
        out["router_other_per_step_s"] = out["wall_per_step_s"] - legs
    return out


# ---- one request -------------------------------------------------------------------------------

class Result:
    __slots__ = ("prompt_index", "ok", "error", "start", "ttft", "e2e", "gaps", "tokens", "stats",
                 "completion_tokens")

    def __init__(self, prompt_index):
        self.prompt_index = prompt_index
        self.ok = False
        self.error = None
        self.ttft = None
        self.e2e = None
        self.gaps = []
        self.tokens = []
        self.stats = None
        self.completion_tokens = 0


def make_request(args, mode, prompt_index, prompt):
    req = pb.GenerateRequest(prompt=prompt, max_new_tokens=args.max_new_tokens,
                             ignore_eos=args.ignore_eos, speculation=BASE_MODES[mode.base],
                             draft_depth=mode.depth, draft_top_k=mode.top_k,
                             draft_max_nodes=mode.nodes,
                             request_id=f"bench-{mode.name}-{prompt_index}")
    if args.temperature is not None:
        req.temperature = args.temperature
    if args.seed is not None:
        req.seed = args.seed + prompt_index
    return req


async def one_request(stub, args, mode, prompt_index, prompt):
    r = Result(prompt_index)
    t0 = time.perf_counter()
    last = t0
    try:
        call = stub.Generate(make_request(args, mode, prompt_index, prompt),
                             timeout=args.request_timeout)
        async for resp in call:
            now = time.perf_counter()
            k = len(resp.token_ids)
            if k:
                if r.ttft is None:
                    r.ttft = now - t0
                else:
                    r.gaps.extend([(now - last) / k] * k)
                last = now
                r.tokens.extend(resp.token_ids)
            if resp.HasField("speculation"):
                r.stats = resp.speculation
            if resp.HasField("usage"):
                r.completion_tokens = resp.usage.completion_tokens
        r.e2e = time.perf_counter() - t0
        r.ok = True
        if not r.completion_tokens:
            r.completion_tokens = len(r.tokens)
    except grpc.aio.AioRpcError as e:
        r.error = f"{e.code().name}: {e.details()}"
    except Exception as e:  # noqa: BLE001  (counted as an error, never a crash of the run)
        r.error = f"{type(e).__name__}: {e}"
    return r


def compare_completions(completions, check=True):
    """completions: (phase, mode, prompt index, tokens) in the order they were measured. The
    reference of a prompt is off's first completion of it; every other completion of it, off's
    own in other phases and batch mixes included, must equal it token for token. Returns
    (reference by prompt index, mismatches, number compared)."""
    reference, mismatches, compared = {}, [], 0
    for label, name, i, tokens in completions:
        if name == "off" and i not in reference:
            reference[i] = (label, tokens)
    for label, name, i, tokens in completions if check else []:
        ref = reference.get(i)
        if ref is None or ref[1] is tokens:
            continue
        compared += 1
        if tokens != ref[1]:
            first = next((k for k, (a, b) in enumerate(zip(tokens, ref[1])) if a != b),
                         min(len(tokens), len(ref[1])))
            mismatches.append({"phase": label, "mode": name, "prompt_index": i,
                               "first_difference": first, "tokens": len(tokens),
                               "reference_tokens": len(ref[1]), "reference_phase": ref[0]})
    return reference, mismatches, compared


class Progress:
    def __init__(self, total, enabled):
        self.total, self.done, self.enabled = total, 0, enabled
        self.label = ""
        self.t0 = time.time()

    def tick(self, n=1):
        self.done += n
        self.draw()

    def draw(self):
        if not self.enabled:
            return
        width = 30
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {time.time() - self.t0:6.1f}s "
                         f"{self.label:<40}")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


async def run_batch(stub, args, mode, indices, prompts, concurrency, gaps, progress):
    """Requests for `indices` (prompt indices), at most `concurrency` in flight, or, with
    `gaps` (seconds before each next request, by prompt index), arriving on that schedule.
    Returns (results, wall seconds)."""
    results = []
    sem = asyncio.Semaphore(concurrency if concurrency else 10**6)

    async def go(i):
        async with sem:
            r = await one_request(stub, args, mode, i, prompts[i % len(prompts)])
            results.append(r)
            if progress:
                progress.tick()

    t0 = time.perf_counter()
    tasks = []
    for i in indices:
        tasks.append(asyncio.ensure_future(go(i)))
        if gaps:
            await asyncio.sleep(gaps[i])
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def summarize(results, wall_s, off_tps=None):
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.gaps]
    e2e = [r.e2e for r in ok]
    steps = sum(r.stats.steps for r in ok if r.stats is not None)
    draft_tokens = sum(r.stats.draft_tokens for r in ok if r.stats is not None)
    accepted = sum(r.stats.accepted_tokens for r in ok if r.stats is not None)
    target_only = sum(r.stats.target_only_steps for r in ok if r.stats is not None)
    used = sorted({MODE_NAMES.get(r.stats.mode, str(r.stats.mode)) for r in ok
                   if r.stats is not None})
    tps = out_tokens / wall_s if wall_s > 0 else 0.0
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok
            if r.ttft is not None and r.completion_tokens > 1]
    s = {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_messages": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "output_tokens_per_s": tps,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
        "itl_s": {"p50": pct(itl, 50), "p90": pct(itl, 90), "p99": pct(itl, 99)},
        "tpot_s": {"p50": pct(tpot, 50), "mean": statistics.fmean(tpot) if tpot else None},
        "e2e_s": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)},
        "spec_steps": steps,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "tau": (accepted + steps) / steps if steps else None,
        "target_only_steps": target_only,
        "speculation_used": used,
    }
    if off_tps:
        s["ratio_to_off"] = tps / off_tps
    return s


# ---- machine and provenance --------------------------------------------------------------------

def machine_info():
    info = {"hostname": socket.gethostname(), "platform": platform.platform(),
            "cores": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20).stdout
            info["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            info["gpus"] = []
    else:
        info["gpus"] = []
    return info


def loadavg():
    try:
        return os.getloadavg()
    except OSError:
        return None


def git_commit():
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "") if commit else None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- the run -----------------------------------------------------------------------------------

def fmt(v, scale=1.0, digits=1):
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_table(phases, modes, out=sys.stdout):
    cols = ["phase", "mode", "tok/s", "x off", "req/s", "TTFT p50", "p99", "ITL p50", "p90",
            "p99", "E2E p50", "p99", "accept", "tau", "t-only", "err"]
    rows = []
    for ph in phases:
        for m in modes:
            s = ph["modes"][m.name]
            rows.append([ph["label"], m.name, fmt(s["output_tokens_per_s"]),
                         fmt(s.get("ratio_to_off"), digits=2), fmt(s["requests_per_s"], digits=2),
                         fmt(s["ttft_s"]["p50"], 1e3), fmt(s["ttft_s"]["p99"], 1e3),
                         fmt(s["itl_s"]["p50"], 1e3, 2), fmt(s["itl_s"]["p90"], 1e3, 2),
                         fmt(s["itl_s"]["p99"], 1e3, 2), fmt(s["e2e_s"]["p50"], 1e3, 0),
                         fmt(s["e2e_s"]["p99"], 1e3, 0), fmt(s["acceptance_rate"], digits=2),
                         fmt(s["tau"], digits=2), str(s["target_only_steps"]), str(s["errors"])])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)), file=out)
    print("(times in ms; tok/s = output tokens / wall time of the mode's runs; x off = ratio to "
          "off in the same phase; tau = tokens per speculative step incl. bonus)", file=out)
    breakdown = [(ph["label"], m.name, ph["modes"][m.name].get("steps"))
                 for ph in phases for m in modes if ph["modes"][m.name].get("steps")]
    if breakdown:
        print("\nstep breakdown (ms per decode step, means; service = inside the service, rtt = "
              "the router's timing of the leg; wall/step = wall time less the prefill steps' "
              "round trips, over decode steps; prefill = steps feeding some sequence its "
              "prompt, kept apart: their count and verify ms)", file=out)
        graphs = any(b.get("verify_graph_replays") for _, _, b in breakdown)
        print(f"{'phase':>8} {'mode':>12} {'wall/step':>9} {'verify':>7} {'v rtt':>7} "
              f"{'draft':>7} {'d rtt':>7} {'router+':>8} {'batch':>6} {'prefills':>8} "
              f"{'v prefill':>9}" +
              (f" {'v eager':>7} {'v capt':>6} {'d eager':>7}" if graphs else ""), file=out)
        for label, name, b in breakdown:
            extra = ""
            if graphs:
                def eager_share(svc):
                    n = b.get(f"{svc}_graph_replays", 0) + b.get(f"{svc}_graph_eager", 0)
                    return fmt(b.get(f"{svc}_graph_eager", 0) / n, 100, 0) + "%" if n else "-"
                extra = (f" {eager_share('verify'):>7} "
                         f"{fmt(b.get('verify_graph_captures'), 1, 0):>6} "
                         f"{eager_share('draft'):>7}")
            print(f"{label:>8} {name:>12} {fmt(b.get('wall_per_step_s'), 1e3, 2):>9} "
                  f"{fmt(b.get('verify_step_s'), 1e3, 2):>7} "
                  f"{fmt(b.get('router_verify_rtt_s'), 1e3, 2):>7} "
                  f"{fmt(b.get('draft_step_s'), 1e3, 2):>7} "
                  f"{fmt(b.get('router_draft_rtt_s'), 1e3, 2):>7} "
                  f"{fmt(b.get('router_other_per_step_s'), 1e3, 2):>8} "
                  f"{fmt(b.get('verify_batch_mean'), 1, 1):>6} "
                  f"{fmt(b.get('verify_prefill_steps'), 1, 0):>8} "
                  f"{fmt(b.get('verify_prefill_step_s'), 1e3, 2):>9}" + extra, file=out)
        overlap = [(label, name, b) for label, name, b in breakdown if "predraft_steps" in b]
        if overlap:
            print("\noverlap (pre-drafted sequence steps, hit rate, per guess rank, idle share "
                  "of step time, ideal tok/s = tokens a verify step / max(draft, verify step))",
                  file=out)
            print(f"{'phase':>8} {'mode':>12} {'pre-drafts':>10} {'hit rate':>8} "
                  f"{'by guess':>14} {'verify idle':>11} {'draft idle':>10} {'ideal':>7}",
                  file=out)
            for label, name, b in overlap:
                ranks = b.get("predraft_hits_by_guess", {})
                by_guess = "/".join(fmt(ranks[r], 1, 2) for r in sorted(ranks)) or "-"
                print(f"{label:>8} {name:>12} {fmt(b.get('predraft_steps'), 1, 0):>10} "
                      f"{fmt(b.get('predraft_hit_rate'), 1, 2):>8} {by_guess:>14} "
                      f"{fmt(b.get('verify_idle_fraction'), 1, 2):>11} "
                      f"{fmt(b.get('draft_idle_fraction'), 1, 2):>10} "
                      f"{fmt(b.get('ideal_tok_s'), 1, 1):>7}", file=out)


def plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = doc["phases"]
    by_rate = phases[0]["request_rate"] is not None
    xs = [ph["request_rate"] if by_rate else ph["concurrency"] for ph in phases]
    modes = [m["name"] for m in doc["config"]["modes"]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = {name: f"C{i}" for i, name in enumerate(modes)}  # one colour a mode in all panels
    for name in modes:
        tps = [ph["modes"][name]["output_tokens_per_s"] for ph in phases]
        itl = [(ph["modes"][name]["itl_s"]["p50"] or float("nan")) * 1e3 for ph in phases]
        axes[0].plot(xs, tps, marker="o", label=name, color=colors[name])
        axes[1].plot(xs, itl, marker="o", label=name, color=colors[name])
        if name != "off" and "off" in modes:
            ratio = [ph["modes"][name].get("ratio_to_off", float("nan")) for ph in phases]
            axes[2].plot(xs, ratio, marker="o", label=name, color=colors[name])
    axes[2].axhline(1.0, color="gray", linestyle="--", linewidth=1)
    xlabel = "request rate (req/s)" if by_rate else "concurrent streams"
    for ax, title in zip(axes, ["output tokens/s", "inter-token latency p50 (ms)",
                                "tokens/s ÷ off (same run)"]):
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        if not by_rate and len(set(xs)) > 1:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    meta = doc.get("meta", {})
    title = " · ".join(filter(None, [meta.get("title"), meta.get("target_model"),
                                     doc["machine"].get("cpu_model"),
                                     ", ".join(doc["machine"].get("gpus") or []),
                                     f"{doc['config']['max_new_tokens']} new tokens",
                                     doc["date"][:10]]))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def repo_relative(value):
    """Paths inside this checkout written relative to its root, so that results name no
    machine's folders."""
    if isinstance(value, str):
        return value.replace(ROOT + os.sep, "")
    if isinstance(value, list):
        return [repo_relative(v) for v in value]
    if isinstance(value, dict):
        return {k: repo_relative(v) for k, v in value.items()}
    return value


def parse_meta(items):
    meta = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep:
            raise SystemExit(f"--meta: {item}: expected KEY=VALUE")
        meta[k] = v
    env = os.environ.get("SPECD_BENCH_META")
    if env:
        meta.update(json.loads(env))
    return meta


async def main_async(args):
    load_at_start = loadavg()
    modes = parse_modes(args.speculation)
    prompts = load_prompts(args.prompts, args.num_prompts)
    if args.check_lossless:
        if "off" not in [m.name for m in modes]:
            raise SystemExit("--check-lossless needs the mode off among --speculation")
        if args.temperature not in (None, 0.0) and args.seed is None:
            raise SystemExit("--check-lossless with --temperature > 0 needs --seed")
    modes.sort(key=lambda m: m.name != "off")  # off first in tables and in round 1
    metrics_urls = dict(item.split("=", 1) for item in (args.metrics or []))

    if args.request_rate:
        phases_spec = [("rate=" + r, None, float(r)) for r in args.request_rate.split(",")]
    else:
        phases_spec = [(f"c={c}", int(c), None) for c in args.concurrency.split(",")]
    rounds = max(1, args.rounds)

    def phase_requests(conc):
        # Every round must be able to fill all `conc` streams, else the phase measures less.
        return max(args.num_requests, (conc or 0) * rounds)

    channel = grpc.aio.insecure_channel(args.target, options=[
        ("grpc.max_receive_message_length", 64 << 20)])
    stub = pb_grpc.GenerationStub(channel)
    try:
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    except grpc.aio.AioRpcError as e:
        raise SystemExit(f"--target {args.target}: GetModelInfo failed: {e.code().name} "
                         f"{e.details()}")
    model_info = {"target_model": info.target_model, "draft_model": info.draft_model,
                  "vocab_size": info.vocab_size, "max_context": info.max_context,
                  "draft_available": info.draft_available}

    total = 0
    for _, c, _ in phases_spec:
        total += len(modes) * (phase_requests(c) + args.warmup)
    progress = Progress(total, not args.quiet)
    completions = []  # (phase, mode, prompt index, tokens) of every measured completion
    phases = []
    rng = random.Random(args.seed if args.seed is not None else 0)
    deadline = time.time() + args.duration if args.duration else None
    for label, conc, rate in phases_spec:
        per_mode = {m.name: {"results": [], "wall": 0.0, "breakdown": []} for m in modes}
        n = phase_requests(conc)
        # One Poisson schedule a phase, the same for every mode: with a schedule drawn per
        # mode, tokens/s would compare arrival luck as much as the modes.
        gaps = [rng.expovariate(rate) for _ in range(n)] if rate else None
        if args.warmup:
            for m in modes:
                progress.label = f"{label} {m.name} warm-up"
                await run_batch(stub, args, m, list(range(args.warmup)), prompts,
                                conc or args.warmup, None, progress)
        # Round r runs requests [r*n/R, (r+1)*n/R) of every mode, the mode order rotated by r.
        bounds = [round(n * k / rounds) for k in range(rounds + 1)]
        for r in range(rounds):
            idx = list(range(bounds[r], bounds[r + 1]))
            if not idx:
                continue
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for m in order:
                if deadline and time.time() > deadline:
                    break
                progress.label = f"{label} {m.name} round {r + 1}/{rounds}"
                progress.draw()
                before = {k: scrape(u) for k, u in metrics_urls.items()}
                results, wall = await run_batch(stub, args, m, idx, prompts, conc, gaps,
                                                progress)
                after = {k: scrape(u) for k, u in metrics_urls.items()}
                per_mode[m.name]["results"].extend(results)
                per_mode[m.name]["wall"] += wall
                per_mode[m.name]["breakdown"].append((before, after, wall))
                for res in results:
                    if res.ok:
                        completions.append((label, m.name, res.prompt_index, res.tokens))
        phase = {"label": label, "concurrency": conc, "request_rate": rate,
                 "requests_per_mode": n, "modes": {}}
        for m in modes:
            pm = per_mode[m.name]
            phase["modes"][m.name] = summarize(pm["results"], pm["wall"])
            # Breakdown over the mode's runs: sum the deltas of every run.
            if metrics_urls and pm["breakdown"]:
                merged_b, merged_a, wall = {}, {}, 0.0
                for before, after, w in pm["breakdown"]:
                    wall += w
                    for svc in set(before) | set(after):
                        mb, ma = merged_b.setdefault(svc, {}), merged_a.setdefault(svc, {})
                        for key in set(after.get(svc, {})) | set(before.get(svc, {})):
                            ma[key] = ma.get(key, 0.0) + after.get(svc, {}).get(key, 0.0) - \
                                before.get(svc, {}).get(key, 0.0)
                            mb.setdefault(key, 0.0)
                phase["modes"][m.name]["steps"] = step_breakdown(merged_b, merged_a, wall)
        off = phase["modes"].get("off")
        if off and off["output_tokens_per_s"]:
            for name, s in phase["modes"].items():
                s["ratio_to_off"] = s["output_tokens_per_s"] / off["output_tokens_per_s"]
        phases.append(phase)
    progress.close()
    await channel.close()

    reference, mismatches, compared = compare_completions(completions, args.check_lossless)

    errors = sum(s["errors"] for ph in phases for s in ph["modes"].values())
    doc = {
        "tool": "bench/serve_bench.py",
        "command": repo_relative([sys.executable] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "loadavg_at_start": load_at_start,
        "loadavg_at_end": loadavg(),
        "meta": repo_relative({**model_info, **parse_meta(args.meta)}),
        "config": {
            "target": args.target, "prompts": os.path.relpath(args.prompts, ROOT),
            "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "ignore_eos": args.ignore_eos, "temperature": args.temperature, "seed": args.seed,
            "num_requests": args.num_requests, "warmup": args.warmup, "rounds": rounds,
            "duration_s": args.duration, "modes": [m.to_json() for m in modes],
            "check_lossless": args.check_lossless,
        },
        "phases": phases,
        "lossless": {"checked": args.check_lossless,
                     "compared": compared,
                     "reference_prompts": len(reference),
                     "mismatches": mismatches},
        "errors": errors,
    }
    return doc


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--target", default="127.0.0.1:50050", help="router host:port")
    p.add_argument("--concurrency", default="1,4,16,64",
                   help="comma-separated concurrent streams, one phase each")
    p.add_argument("--request-rate", default=None,
                   help="comma-separated Poisson arrival rates (req/s) instead of --concurrency")
    p.add_argument("--prompts", default=os.path.join(HERE, "prompts", "code_prompts.json"))
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=None, help="unset: greedy")
    p.add_argument("--seed", type=int, default=None,
                   help="request seed = SEED + prompt index (seeded sampling)")
    p.add_argument("--speculation", default="off,draft_model,ngram,auto")
    p.add_argument("--num-requests", type=int, default=32,
                   help="measured requests per mode and phase (at least concurrency x rounds)")
    p.add_argument("--duration", type=float, default=None,
                   help="stop starting runs after this many seconds in all")
    p.add_argument("--warmup", type=int, default=2,
                   help="unmeasured requests per mode at the start of each phase")
    p.add_argument("--rounds", type=int, default=2,
                   help="each phase's requests split into rounds, the modes interleaved")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--check-lossless", action="store_true")
    p.add_argument("--metrics", action="append", metavar="NAME=URL",
                   help="router=, verify=, draft= /metrics URLs for the step breakdown")
    p.add_argument("--meta", action="append", metavar="KEY=VALUE",
                   help="recorded in the JSON (models, flags, build); also $SPECD_BENCH_META")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--plot", default=None, help="PNG of tokens/s, ITL p50 and ratio to off")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="run nothing: print the tables of an earlier --json and --plot it")
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        modes = [Mode(m["name"], m["speculation"]) for m in doc["config"]["modes"]]
        print_table(doc["phases"], modes)
        if args.plot:
            plot(doc, args.plot)
        return 0
    if args.num_requests < 1:
        p.error("--num-requests: must be >= 1")
    doc = asyncio.run(main_async(args))
    modes = parse_modes(args.speculation)
    modes.sort(key=lambda m: m.name != "off")
    print_table(doc["phases"], modes)
    lossless = doc["lossless"]
    if args.check_lossless:
        if lossless["mismatches"]:
            print(f"\nLOSSLESS CHECK FAILED: {len(lossless['mismatches'])} completions differ "
                  f"from off: {lossless['mismatches'][:5]}")
        else:
            print(f"\nlossless: all {lossless['compared']} completions matched off's token for "
                  f"token ({lossless['reference_prompts']} prompts)")
    if doc["errors"]:
        msgs = sorted({m for ph in doc["phases"] for s in ph["modes"].values()
                       for m in s["error_messages"]})
        print(f"\n{doc['errors']} requests failed: {msgs[:5]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(doc, args.plot)
    return 1 if doc["errors"] or lossless["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
