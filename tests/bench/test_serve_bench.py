"""serve_bench.py's own logic, without a cluster: the lossless comparison, mode parsing,
percentiles and the step breakdown from two /metrics scrapes."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import serve_bench as sb  # noqa: E402


def test_lossless_comparison_finds_a_changed_token_and_a_short_completion():
    completions = [("c=1", "off", 0, [1, 2, 3]), ("c=1", "off", 1, [4, 5]),
                   ("c=1", "draft_model", 0, [1, 2, 3]), ("c=1", "draft_model", 1, [4, 6]),
                   ("c=4", "off", 0, [1, 2]), ("c=4", "ngram", 2, [9])]
    reference, mismatches, compared = sb.compare_completions(completions)
    assert set(reference) == {0, 1}
    assert compared == 3  # prompt 2 has no reference; off's first completions are references
    assert [(m["phase"], m["mode"], m["prompt_index"], m["first_difference"])
            for m in mismatches] == [("c=1", "draft_model", 1, 1), ("c=4", "off", 0, 2)]


def test_lossless_comparison_of_equal_completions_is_clean():
    completions = [("c=1", "off", 0, [1, 2]), ("c=1", "auto", 0, [1, 2]),
                   ("c=2", "off", 0, [1, 2])]
    _, mismatches, compared = sb.compare_completions(completions)
    assert mismatches == [] and compared == 2


def test_modes():
    modes = sb.parse_modes("off,deep=draft_model:depth=8,nodes=32,ngram,w=ngram:top_k=2")
    assert [(m.name, m.base, m.depth, m.top_k, m.nodes) for m in modes] == [
        ("off", "off", 0, 0, 0), ("deep", "draft_model", 8, 0, 32), ("ngram", "ngram", 0, 0, 0),
        ("w", "ngram", 0, 2, 0)]
    for bad in ("of", "x=nope:depth=2", "x=ngram:width=2", "off,off"):
        with pytest.raises(SystemExit):
            sb.parse_modes(bad)


def test_percentiles():
    assert sb.pct([], 50) is None
    assert sb.pct([3, 1, 2], 50) == 2
    assert sb.pct([0, 10], 90) == pytest.approx(9.0)


def test_step_breakdown():
    before = {"router": {"specd_verify_latency_seconds_sum": 1.0,
                         "specd_verify_latency_seconds_count": 10,
                         "specd_draft_latency_seconds_sum": 0.5,
                         "specd_draft_latency_seconds_count": 10},
              "verify": {"specd_step_seconds_sum": 0.8, "specd_step_seconds_count": 10}}
    after = {"router": {"specd_verify_latency_seconds_sum": 3.0,
                        "specd_verify_latency_seconds_count": 30,
                        "specd_draft_latency_seconds_sum": 1.5,
                        "specd_draft_latency_seconds_count": 30},
             "verify": {"specd_step_seconds_sum": 2.4, "specd_step_seconds_count": 30}}
    # Scrapes without the kind label (an older server): every step counts as a decode step.
    b = sb.step_breakdown(before, after, wall_s=4.0)
    assert b["verify_steps"] == 20 and b["verify_step_s"] == pytest.approx(0.08)
    assert "verify_prefill_steps" not in b
    assert b["router_verify_rtt_s"] == pytest.approx(0.1)
    assert b["router_draft_rtt_s"] == pytest.approx(0.05)
    assert b["wall_per_step_s"] == pytest.approx(0.2)
    assert b["router_other_per_step_s"] == pytest.approx(0.05)


def kinds(name, decode, prefill):
    return {f'{name}{{kind="decode"}}': decode, f'{name}{{kind="prefill"}}': prefill}


def test_step_breakdown_keeps_prefill_steps_apart():
    # 20 decode steps of 80 ms in the verify service (100 ms round trips), and 4 prefill steps
    # of 500 ms (600 ms round trips); 10 draft decode round trips of 50 ms and 2 prefill ones
    # of 200 ms. Wall time 5.0 s, of which 2.8 s prefill round trips.
    zero = {}
    for name in ("specd_verify_latency_seconds", "specd_draft_latency_seconds"):
        zero.update(kinds(name + "_sum", 0, 0))
        zero.update(kinds(name + "_count", 0, 0))
    svc_zero = {**kinds("specd_step_seconds_sum", 0, 0), **kinds("specd_step_seconds_count", 0, 0)}
    before = {"router": {**zero, "specd_generation_tokens_total": 0},
              "verify": svc_zero, "draft": svc_zero}
    after = {"router": {**kinds("specd_verify_latency_seconds_sum", 2.0, 2.4),
                        **kinds("specd_verify_latency_seconds_count", 20, 4),
                        **kinds("specd_draft_latency_seconds_sum", 0.5, 0.4),
                        **kinds("specd_draft_latency_seconds_count", 10, 2),
                        "specd_generation_tokens_total": 72},
             "verify": {**kinds("specd_step_seconds_sum", 1.6, 2.0),
                        **kinds("specd_step_seconds_count", 20, 4)},
             "draft": {**kinds("specd_step_seconds_sum", 0.3, 0.3),
                       **kinds("specd_step_seconds_count", 10, 2)}}
    b = sb.step_breakdown(before, after, wall_s=5.0)
    assert b["verify_steps"] == 20 and b["verify_step_s"] == pytest.approx(0.08)
    assert b["verify_prefill_steps"] == 4 and b["verify_prefill_step_s"] == pytest.approx(0.5)
    assert b["draft_steps"] == 10 and b["draft_step_s"] == pytest.approx(0.03)
    assert b["draft_prefill_steps"] == 2 and b["draft_prefill_step_s"] == pytest.approx(0.15)
    assert b["router_verify_rtt_s"] == pytest.approx(0.1)
    assert b["router_verify_calls"] == 20
    assert b["router_verify_prefill_rtt_s"] == pytest.approx(0.6)
    assert b["router_draft_rtt_s"] == pytest.approx(0.05)
    assert b["router_draft_prefill_rtt_s"] == pytest.approx(0.2)
    # (5.0 - 4 * 0.6 - 2 * 0.2) / 20 decode steps; a mean over all 24 steps would be 0.208.
    assert b["wall_per_step_s"] == pytest.approx(0.11)
    assert b["router_other_per_step_s"] == pytest.approx(0.11 - 0.1 - 0.05 * 10 / 20)
    # The tokens came out of all 24 verify steps.
    assert b["tokens_per_verify_step"] == pytest.approx(3.0)


def test_step_breakdown_overlap_hit_rate_and_idle_fractions():
    hit = 'specd_predraft_outcomes_total{position="4",result="hit"}'
    miss = 'specd_predraft_outcomes_total{position="1",result="miss"}'
    busy = 'specd_service_busy_seconds_total{service="%s"}'
    before = {"router": {hit: 5, miss: 5, "specd_router_step_seconds_total": 1.0,
                         busy % "verify": 0.5, busy % "draft": 0.2}}
    after = {"router": {hit: 35, miss: 15, "specd_router_step_seconds_total": 3.0,
                        busy % "verify": 2.1, busy % "draft": 1.2}}
    b = sb.step_breakdown(before, after, wall_s=2.0)
    assert b["predraft_steps"] == 40 and b["predraft_hit_rate"] == pytest.approx(0.75)
    assert b["verify_idle_fraction"] == pytest.approx(0.2)
    assert b["draft_idle_fraction"] == pytest.approx(0.5)
    assert b["predraft_hit_rate_by_position"] == {"1": 0.0, "4": 1.0}
    assert "predraft_steps" not in sb.step_breakdown({}, {}, wall_s=1.0)


def test_step_breakdown_overlap_guess_ranks_decisions_and_ideal():
    hit = 'specd_predraft_outcomes_total{position="4",result="hit"}'
    miss = 'specd_predraft_outcomes_total{position="0",result="miss"}'
    g0 = 'specd_predraft_guess_hits_total{guess="0"}'
    g1 = 'specd_predraft_guess_hits_total{guess="1"}'
    pays = 'specd_overlap_decisions_total{decision="pays"}'
    no_gain = 'specd_overlap_decisions_total{decision="no_gain"}'
    before = {"router": {hit: 0, miss: 0, g0: 0, g1: 0, pays: 0, no_gain: 0,
                         "specd_generation_tokens_total": 0},
              "verify": {"specd_step_seconds_sum": 0, "specd_step_seconds_count": 0},
              "draft": {"specd_step_seconds_sum": 0, "specd_step_seconds_count": 0}}
    after = {"router": {hit: 30, miss: 10, g0: 20, g1: 10, pays: 35, no_gain: 5,
                        "specd_generation_tokens_total": 120},
             "verify": {"specd_step_seconds_sum": 0.4, "specd_step_seconds_count": 40},
             "draft": {"specd_step_seconds_sum": 0.6, "specd_step_seconds_count": 40}}
    b = sb.step_breakdown(before, after, wall_s=1.0)
    assert b["predraft_hits_by_guess"] == {"0": pytest.approx(0.5), "1": pytest.approx(0.25)}
    assert b["overlap_decisions"] == {"pays": 35, "no_gain": 5}
    # 3 tokens a verify step, the draft the slower service at 15 ms a step: 200 tokens/s.
    assert b["ideal_tok_s"] == pytest.approx(200.0)


def test_scrape_parses_prometheus_text(tmp_path):
    page = tmp_path / "metrics"
    page.write_text('# HELP x y\nspecd_step_seconds_sum 1.5\n'
                    'specd_target_only_steps_total{reason="off"} 7\n')
    got = sb.scrape(page.as_uri())
    assert got["specd_step_seconds_sum"] == 1.5
    assert got['specd_target_only_steps_total{reason="off"}'] == 7
    assert sb.scrape((tmp_path / "missing").as_uri()) == {}
