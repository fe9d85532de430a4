#!/usr/bin/env python3
"""check_serve_bench_json.py OUT.json [OUT.png]: the structure serve_bench.py promises (every
phase and mode with its metrics, provenance, a lossless check that compared completions and
found them equal) for the smoke run of tests/bench/serve_bench_smoke.sh. Never a speed."""

import json
import sys


def main():
    doc = json.load(open(sys.argv[1]))
    for key in ("command", "date", "git_commit", "machine", "meta", "config", "phases",
                "lossless", "errors"):
        assert key in doc, f"missing {key}"
    assert doc["machine"]["cores"] >= 1 and "cpu_model" in doc["machine"], doc["machine"]
    assert "serve_bench.py" in " ".join(doc["command"])
    assert doc["meta"]["launcher"] == "bench/serve_cluster.sh" and doc["meta"]["target_dir"]
    assert doc["meta"]["title"] == "smoke"
    assert [p["label"] for p in doc["phases"]] == ["c=1", "c=2"], doc["phases"]
    for phase in doc["phases"]:
        assert set(phase["modes"]) == {"off", "chain4", "ngram"}, phase["modes"].keys()
        for name, s in phase["modes"].items():
            where = f"{phase['label']} {name}"
            assert s["completed"] == 4 and s["errors"] == 0, (where, s)
            assert s["output_tokens"] == 4 * 12, (where, s["output_tokens"])
            assert s["output_tokens_per_s"] > 0 and s["requests_per_s"] > 0, where
            for metric, qs in (("ttft_s", ("p50", "p90", "p99")), ("itl_s", ("p50", "p90", "p99")),
                               ("e2e_s", ("p50", "p99"))):
                vals = [s[metric][q] for q in qs]
                assert all(v is not None and v >= 0 for v in vals), (where, metric, vals)
                assert vals == sorted(vals), (where, metric, vals)
            assert abs(s["ratio_to_off"] - s["output_tokens_per_s"] /
                       phase["modes"]["off"]["output_tokens_per_s"]) < 1e-9, where
            assert "verify_step_s" in s["steps"] and s["steps"]["verify_steps"] > 0, (where, s)
            # Each request's first step is a prefill step, counted apart from the decode steps.
            assert s["steps"].get("verify_prefill_steps", 0) >= 1, (where, s["steps"])
            assert s["steps"].get("router_verify_prefill_calls", 0) >= 1, (where, s["steps"])
        off, dm = phase["modes"]["off"], phase["modes"]["chain4"]
        assert off["spec_steps"] == 0 and off["target_only_steps"] > 0, off
        assert off["tau"] is None and off["ratio_to_off"] == 1.0, off
        # The draft model proposes the explicit chain (the policy would judge this pair's drafts
        # not worth their cost) on every step but the first: some accepted, tau in [1, 5].
        assert dm["spec_steps"] > 0 and dm["draft_tokens"] > 0, dm
        assert 1.0 <= dm["tau"] <= 5.0 and 0.0 <= dm["acceptance_rate"] <= 1.0, dm
        assert dm["speculation_used"] == ["draft_model"], dm["speculation_used"]
        # Each request's prompt is fed to the drafter in a call of its own beside verify's
        # prefill (a draft prefill step); its drafts follow from the second step.
        assert dm["steps"].get("draft_prefill_steps", 0) >= 1, dm["steps"]
        assert dm["steps"].get("router_draft_prefill_calls", 0) >= 1, dm["steps"]
    lossless = doc["lossless"]
    assert lossless["checked"] and lossless["mismatches"] == [], lossless
    # Every completion but off's first of each prompt was compared: 2 phases x 3 modes x 4.
    assert lossless["compared"] == 2 * 3 * 4 - lossless["reference_prompts"], lossless
    assert doc["errors"] == 0
    if len(sys.argv) > 2:
        with open(sys.argv[2], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", "not a PNG"
    print("serve_bench JSON ok")


if __name__ == "__main__":
    main()
