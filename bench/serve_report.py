#!/usr/bin/env python3
"""Markdown tables of serve_bench.py JSON files, for bench/CURRENT.md:

  bench/serve_report.py bench/results/cpu_reference_pair.json [more.json ...]
"""

import json
import sys


def f(v, scale=1.0, digits=1):
    return "–" if v is None else f"{v * scale:.{digits}f}"


def report(path):
    doc = json.load(open(path))
    m = doc["machine"]
    print(f"**{doc['meta'].get('title', path)}** — `{path}`\n")
    print(f"- Date {doc['date']}, commit {doc['git_commit']}, build "
          f"{doc['meta'].get('build_type') or '?'}; {m.get('cpu_model')}, {m['cores']} cores"
          + (f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else "")
          + f"; load average {doc.get('loadavg_at_start')} at start, "
          f"{doc['loadavg_at_end']} at end")
    if doc["meta"].get("pinning"):
        print(f"- Pinning: {doc['meta']['pinning']}")
    c = doc["config"]
    print(f"- {c['max_new_tokens']} new tokens, "
          f"{'greedy' if not c['temperature'] else 'temperature ' + str(c['temperature'])}, "
          f"ignore_eos {c['ignore_eos']}, prompts {c['prompts']}, warm-up {c['warmup']}, "
          f"rounds {c['rounds']}; lossless check: "
          + (f"{doc['lossless']['compared']} completions compared, "
             f"{len(doc['lossless']['mismatches'])} mismatches" if c["check_lossless"] else "off")
          + f"; errors {doc['errors']}")
    print(f"- Command: `{' '.join(doc['command'])}`\n")
    print("| phase | mode | req | tok/s | × off | TTFT p50 ms | ITL p50 ms | ITL p99 ms | "
          "E2E p50 ms | accept | τ | target-only steps |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ph in doc["phases"]:
        for name, s in ph["modes"].items():
            print(f"| {ph['label']} | {name} | {s['completed']} | {f(s['output_tokens_per_s'])} | "
                  f"**{f(s.get('ratio_to_off'), digits=2)}** | {f(s['ttft_s']['p50'], 1e3, 0)} | "
                  f"{f(s['itl_s']['p50'], 1e3, 2)} | {f(s['itl_s']['p99'], 1e3, 1)} | "
                  f"{f(s['e2e_s']['p50'], 1e3, 0)} | {f(s['acceptance_rate'], digits=3)} | "
                  f"{f(s['tau'], digits=2)} | {s['target_only_steps']} |")
    rows = [(ph["label"], name, s["steps"]) for ph in doc["phases"]
            for name, s in ph["modes"].items() if s.get("steps")]
    if rows:
        print("\nStep breakdown, ms per decode step (means over the mode's runs): wall = wall "
              "time less the prefill steps' round trips ÷ decode verify calls; verify/draft = "
              "`specd_step_seconds{kind=\"decode\"}` inside the service; rtt = the router's "
              "timing of the leg (service + gRPC); router+ = wall − legs. Prefill steps (those "
              "feeding some sequence its prompt) are apart: their count and verify ms.\n")
        print("| phase | mode | wall | verify | verify rtt | draft | draft rtt | router+ | "
              "verify batch | prefills | verify prefill |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for label, name, b in rows:
            print(f"| {label} | {name} | {f(b.get('wall_per_step_s'), 1e3, 2)} | "
                  f"{f(b.get('verify_step_s'), 1e3, 2)} | "
                  f"{f(b.get('router_verify_rtt_s'), 1e3, 2)} | "
                  f"{f(b.get('draft_step_s'), 1e3, 2)} | "
                  f"{f(b.get('router_draft_rtt_s'), 1e3, 2)} | "
                  f"{f(b.get('router_other_per_step_s'), 1e3, 2)} | "
                  f"{f(b.get('verify_batch_mean'), digits=1)} | "
                  f"{f(b.get('verify_prefill_steps'), digits=0)} | "
                  f"{f(b.get('verify_prefill_step_s'), 1e3, 2)} |")
    print()


if __name__ == "__main__":
    for p in sys.argv[1:]:
        report(p)
