"""The parsing and reporting half of tools/gpu/run.sh's `cluster` command.

  cluster_report.py prompts PROMPTS_JSON          one line per prompt: "id comma,separated,ids"
  cluster_report.py compare WORK PROMPTS_TXT      token ids with speculation off against
                                                  draft_model and eagle3, and each mode's
                                                  acceptance and speed; exit status 1 on any
                                                  mismatch
  cluster_report.py round WORK N MODE T0 T1       one throughput row: N streams' completion
                                                  tokens over the round's wall time
WORK holds specd-cli --json outputs: MODE.ID.jsonl for compare, stream.I.jsonl for round.
"""
import json
import statistics
import sys


def prompts(path):
    for p in json.load(open(path))["prompts"]:
        print(p["id"], ",".join(str(i) for i in p["ids"]))
    return 0


def compare(work, prompts_txt):
    ids = [line.split()[0] for line in open(prompts_txt)]
    modes = ("off", "draft_model", "eagle3")
    tokens, summary = {}, {}
    for mode in modes:
        for pid in ids:
            lines = [json.loads(l) for l in open(f"{work}/{mode}.{pid}.jsonl") if l.strip()]
            # Streamed chunks carry token_ids; the last line is the summary.
            tokens[mode, pid] = [t for l in lines[:-1] for t in l.get("token_ids", [])]
            summary[mode, pid] = lines[-1]
    bad = set()
    for pid in ids:
        for mode in modes[1:]:
            a, b = tokens["off", pid], tokens[mode, pid]
            if a != b:
                bad.add(pid)
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                             min(len(a), len(b)))
                print(f"MISMATCH prompt {pid}: {len(a)} tokens off vs {len(b)} {mode}, first "
                      f"difference at token {first}: off {a[first:first + 4]} {mode} "
                      f"{b[first:first + 4]}")
    mismatches = len(bad)
    print(f"{'speculation':<12} {'tokens':>7} {'acceptance':>11} {'mean accepted length':>21} "
          f"{'median tokens/s':>16}")
    for mode in modes:
        rows = [summary[mode, pid] for pid in ids]
        n = sum(r["usage"]["completion_tokens"] for r in rows)
        steps = sum(r["speculation"]["steps"] for r in rows)
        drafted = sum(r["speculation"]["draft_tokens"] for r in rows)
        accepted = sum(r["speculation"]["accepted_tokens"] for r in rows)
        acc = f"{accepted / drafted:.3f}" if drafted else "-"
        mal = f"{1 + accepted / steps:.2f}" if steps and drafted else "-"
        tps = statistics.median(r["tokens_per_second"] for r in rows)
        print(f"{mode:<12} {n:>7} {acc:>11} {mal:>21} {tps:>16.1f}")
    print(f"{len(ids) - mismatches} of {len(ids)} prompts: identical token ids with "
          f"speculation off, draft_model and eagle3 (greedy, 64 new tokens)")
    return 1 if mismatches else 0


def round_row(work, n, mode, t0, t1):
    n, t0, t1 = int(n), float(t0), float(t1)
    tokens = 0
    for i in range(n):
        lines = [l for l in open(f"{work}/stream.{i}.jsonl") if l.strip()]
        if lines:
            tokens += json.loads(lines[-1]).get("usage", {}).get("completion_tokens", 0)
    print(f"| {mode} | {n} | {tokens} | {t1 - t0:.2f} | {tokens / (t1 - t0):.0f} |")
    return 0


if __name__ == "__main__":
    commands = {"prompts": prompts, "compare": compare, "round": round_row}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    sys.exit(commands[sys.argv[1]](*sys.argv[2:]))
