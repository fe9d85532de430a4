"""Timing and reporting shared by the peer baselines (gpt_fast_bench.py,
bench/hf_step_baseline.py), so their tables line up with cuda_step_bench's.

Each case is timed two ways:
  step ms          median over --runs steps, each bracketed by torch.cuda.synchronize() and
                   timed on the host: the latency of one step, as cuda_step_bench times
                   Backend::Verify().
  back-to-back ms  --runs steps issued without a synchronization in between, total / runs (CUDA
                   events): what a generation loop that never waits on the GPU achieves, as
                   gpt-fast's own tokens/s figures do.
"""
import datetime
import json
import platform
import statistics
import sys
import time

COLUMNS = ["impl", "shape", "tp", "cache", "context", "tree nodes", "tokens", "step ms",
           "back-to-back ms", "x floor", "compile s", "mode", "note"]


def now_utc():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def sync(device):
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def measure(call, device, runs, warmup, between=None, before_timing=None):
    """Times call() (which issues one step). Returns (first_call_s, step_ms_median,
    back_to_back_ms, all step ms). The first call includes any compilation; warmup counts it.
    between(), if given, runs after every call (host-side bookkeeping such as cropping a cache
    back to the context): outside the timed region for step ms, inline for back-to-back.
    before_timing(), if given, runs once between the warmup and the timed calls (a process
    that compiled beside others waits there for the GPU to itself)."""
    import torch
    between = between or (lambda: None)
    t = time.perf_counter()
    call()
    sync(device)
    first_s = time.perf_counter() - t
    between()
    for _ in range(max(0, warmup - 1)):
        call()
        sync(device)
        between()
    if before_timing is not None:
        before_timing()
    steps = []
    for _ in range(runs):
        sync(device)
        t = time.perf_counter()
        call()
        sync(device)
        steps.append((time.perf_counter() - t) * 1e3)
        between()
    if str(device).startswith("cuda"):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        start.record()
        for _ in range(runs):
            call()
            between()
        stop.record()
        sync(device)
        b2b = start.elapsed_time(stop) / runs
    else:
        t = time.perf_counter()
        for _ in range(runs):
            call()
            between()
        b2b = (time.perf_counter() - t) * 1e3 / runs
    return first_s, statistics.median(steps), b2b, steps


def copy_bandwidth(device, gib=4):
    """Device-to-device copy of `gib` GiB, bytes read plus written per second (as
    cuda_step_bench measures it); None off the GPU."""
    import torch
    if not str(device).startswith("cuda"):
        return None
    n = gib << 30
    a = torch.ones(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates = []
    for i in range(7):
        start.record()
        b.copy_(a)
        stop.record()
        stop.synchronize()
        if i:
            rates.append(2 * n / (start.elapsed_time(stop) * 1e-3))
    del a, b
    torch.cuda.empty_cache()
    return statistics.median(rates)


def param_bytes(model):
    """Bytes of the model's parameters, each shared tensor once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def env_info(device):
    import torch
    info = {"date": now_utc(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "device": str(device),
            "command": " ".join([sys.executable.split("/")[-1]] + sys.argv)}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
        info["gpu_count"] = torch.cuda.device_count()
    return info


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def table_header():
    return ("| " + " | ".join(COLUMNS) + " |\n" +
            "|" + "|".join("---" for _ in COLUMNS) + "|")


def table_row(row):
    return "| " + " | ".join(fmt(row.get(c)) for c in COLUMNS) + " |"


def print_table(rows, out=sys.stdout):
    print(table_header(), file=out)
    for r in rows:
        print(table_row(r), file=out)
    out.flush()


def write_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)


def ints(text):
    return [int(x) for x in text.split(",") if x.strip()]
