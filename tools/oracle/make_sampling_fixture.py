#!/usr/bin/env python3
"""Oracle for specd's logits processors, sampling filters and log-probabilities.

Writes tests/fixtures/sampling_oracle.json: random logit rows with a sequence history (prompt,
output, tree path) and sampling parameters, and what PyTorch computes for them with the
semantics vLLM's v1 sampler documents (vllm/v1/sample/sampler.py), written here with tensor
masks the way a GPU sampler does it, independently of specd's C++ loops:

  processed  min_tokens mask (EOS/stop ids -inf while output + path < min_tokens), logit_bias
             added, repetition penalty over prompt | output tokens (positive logits divided,
             others multiplied), frequency penalty x output counts, presence penalty x output
             mask; fp32 like vLLM. Output = the history's output followed by the path.
  probs      (sampling rows) softmax after temperature, min_p (p < min_p * p_max removed), top-k,
             top-p (ascending cumulative mass <= 1 - p removed, the largest always kept); fp64.
  argmax     (greedy rows) of the processed logits, lowest id on ties.
  raw_logprobs        log_softmax of the raw row (fp64).
  processed_logprobs  greedy: log_softmax of the processed row; sampling: log(probs).

Cases whose min-p or top-p cut lies within 1e-4 of a token's mass are redrawn, so that the C++
loops (which sum in another order) must agree exactly on the kept set.

Usage (repository root; Debian's python3-torch is enough):
  /usr/bin/python3 tools/oracle/make_sampling_fixture.py --out tests/fixtures/sampling_oracle.json
"""

import argparse
import json
import random
import sys

import torch

VOCAB = 48
NEG_INF = float("-inf")


def f32_list(values):
    """fp32 values as JSON numbers (9 significant digits round-trip fp32); -inf as null."""
    return [None if v == NEG_INF else float(f"{v:.9g}") for v in values]


def f64_list(values):
    return [None if v == NEG_INF else float(f"{v:.17g}") for v in values]


def process(raw, case):
    logits = torch.tensor(raw, dtype=torch.float32)
    output = case["output"] + case["path"]
    if len(output) < case["min_tokens"] and case["stop_ids"]:
        logits[torch.tensor(case["stop_ids"], dtype=torch.long)] = NEG_INF
    for token, bias in case["logit_bias"]:
        logits[token] += torch.tensor(bias, dtype=torch.float32)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB)
    output_mask = counts > 0
    prompt_mask = torch.bincount(torch.tensor(case["prompt"], dtype=torch.long),
                                 minlength=VOCAB) > 0
    rep = torch.full((VOCAB,), case["repetition_penalty"], dtype=torch.float32)
    rep[~(prompt_mask | output_mask)] = 1.0
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    freq = torch.tensor(case["frequency_penalty"], dtype=torch.float32)
    pres = torch.tensor(case["presence_penalty"], dtype=torch.float32)
    seen = output_mask.nonzero().flatten()
    # Only tokens the output holds change (x - 0 is x, but -inf - 0 stays -inf either way).
    logits[seen] = logits[seen] - freq * counts[seen].to(torch.float32)
    logits[seen] = logits[seen] - pres
    return logits


def filtered_probs(processed, case):
    """Returns (probs, ok): ok is False when a cut is too close to call."""
    scaled = processed.to(torch.float64) / case["temperature"]
    probs = torch.softmax(scaled, dim=-1)
    if case["min_p"] > 0:
        ratio = probs / probs.max()
        finite = torch.isfinite(scaled)
        if ((ratio[finite] - case["min_p"]).abs() < 1e-4).any():
            return None, False
        scaled = scaled.masked_fill(ratio < case["min_p"], NEG_INF)
    k = case["top_k"]
    if 0 < k < VOCAB:
        values, _ = scaled.sort(descending=True)
        kth = values[k - 1]
        if torch.isfinite(kth) and ((values[:k] == kth).sum() > 1 or values[k] == kth):
            return None, False  # a tie at the cut
        scaled = scaled.masked_fill(scaled < kth, NEG_INF)
    if case["top_p"] < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = probs.sort(descending=False)
        cum = sorted_probs.cumsum(dim=-1)
        live = sorted_probs > 0
        if ((cum[live] - (1 - case["top_p"])).abs() < 1e-4).any():
            return None, False
        remove = cum <= 1 - case["top_p"]
        remove[-1] = False
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        mask[order[remove]] = True
        scaled = scaled.masked_fill(mask, NEG_INF)
    return torch.softmax(scaled, dim=-1), True


def draw_case(rng, kind):
    c = {
        "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "logit_bias": [],
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "min_tokens": 0, "stop_ids": [],
        "prompt": [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))],
        "output": [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))],
        "path": [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))],
    }
    if kind in ("bias", "all"):
        c["logit_bias"] = [[t, round(rng.uniform(-100, 100) if rng.random() < 0.3 else
                                     rng.uniform(-3, 3), 3)]
                           for t in rng.sample(range(VOCAB), rng.randrange(1, 6))]
    if kind in ("repetition", "all", "penalties"):
        c["repetition_penalty"] = rng.choice([0.7, 1.2, 1.5, 2.0])
    if kind in ("frequency", "all", "penalties"):
        c["frequency_penalty"] = rng.choice([-1.0, 0.5, 1.3, 2.0])
    if kind in ("presence", "all", "penalties"):
        c["presence_penalty"] = rng.choice([-0.5, 0.4, 1.1, 2.0])
    if kind in ("min_tokens", "all"):
        c["min_tokens"] = len(c["output"]) + len(c["path"]) + rng.choice([-1, 0, 1, 3])
        c["min_tokens"] = max(c["min_tokens"], 1)
        c["stop_ids"] = rng.sample(range(VOCAB), rng.randrange(1, 4))
    if rng.random() < 0.7 or kind == "filters":
        c["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        if kind == "filters" or rng.random() < 0.5:
            c["min_p"] = rng.choice([0.0, 0.05, 0.2])
            c["top_k"] = rng.choice([0, 5, 12])
            c["top_p"] = rng.choice([1.0, 0.9, 0.6])
    return c


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/fixtures/sampling_oracle.json")
    parser.add_argument("--seed", type=int, default=28)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    kinds = ["none", "bias", "repetition", "frequency", "presence", "penalties", "min_tokens",
             "filters", "all"]
    cases = []
    for kind in kinds:
        made = 0
        while made < 8:
            case = draw_case(rng, kind)
            raw = (torch.randn(VOCAB, dtype=torch.float64) * 2.5).to(torch.float32)
            processed = process(raw.tolist(), case)
            raw64 = raw.to(torch.float64)
            entry = dict(case, kind=kind, raw=f32_list(raw.tolist()),
                         processed=f32_list(processed.tolist()),
                         raw_logprobs=f64_list(torch.log_softmax(raw64, -1).tolist()))
            if case["temperature"] == 0.0:
                top = processed.max()
                if (processed == top).sum() > 1:
                    continue
                entry["argmax"] = int(processed.argmax())
                entry["processed_logprobs"] = f64_list(
                    torch.log_softmax(processed.to(torch.float64), -1).tolist())
            else:
                probs, ok = filtered_probs(processed, case)
                if not ok:
                    continue
                entry["probs"] = f64_list(probs.tolist())
                entry["processed_logprobs"] = f64_list(torch.log(probs).tolist())
            cases.append(entry)
            made += 1
    fixture = {
        "note": "tools/oracle/make_sampling_fixture.py; vLLM v1 sampler semantics in PyTorch",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "vocab": VOCAB,
        "cases": cases,
    }
    with open(args.out, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
