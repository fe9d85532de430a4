#!/usr/bin/env python3
"""How far the CUDA EAGLE head's bf16 rounding takes each fixture head from the float64 oracle,
emulated on the CPU with PyTorch (docs/eagle.md, "The CUDA head"), to set and check the bound of
tests/gpu/cuda_eagle_head_test.cc without a GPU.

The reference heads of eagle3_reference.py run in float64 with bf16 round-to-nearest-even
inserted where engine/draft/eagle_head_cuda.cc rounds: the weights (norm weights too, a small
pessimism: the CUDA head keeps them fp32), every GEMM's input and output, every RMSNorm's input
and output, and the LM head's input. The residual stream stays unrounded, as the CUDA head keeps
it in fp32; fc's output enters it unrounded (the CUDA head's fc writes fp32), and --round-fc-out
rounds it as a bf16-output fc would. Each scenario of tests/fixtures/eagle3/oracle.json is
replayed call by call, later calls fed the emulated head's own earlier outputs (as the C++ replay
feeds the CUDA head's), and the worst relative error per row (max |diff| / max |reference|) over
the hidden states and logits is printed.

  /usr/bin/python3 tools/oracle/eagle_bf16_emulate.py [--round-fc-out]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eagle3_reference as ref  # noqa: E402
import safetensors_io  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                        "fixtures", "eagle3")


def bf16(t):
    return t.to(torch.bfloat16).to(torch.float64)


def rel_error(got, want):
    return ((got - want).abs().max(dim=-1).values / want.abs().max(dim=-1).values).max().item()


def rounded_head(folder, target, round_fc_out):
    head = ref.load_head(folder, target)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(bf16(p))
        for attr in ("embed", "target_lm_head"):
            if hasattr(head, attr):
                v = getattr(head, attr)
                if isinstance(v, torch.nn.Parameter):
                    v.copy_(bf16(v))
                else:
                    setattr(head, attr, bf16(v))
    for name, m in head.named_modules():
        if isinstance(m, (torch.nn.Linear, ref.RMSNorm)):
            m.register_forward_pre_hook(lambda mod, inp: tuple(bf16(i) for i in inp))
            if name != "fc" or round_fc_out:
                m.register_forward_hook(lambda mod, inp, out: bf16(out))
    logits = head.logits
    head.logits = lambda out: logits(bf16(out))
    return head


def worst_error(scenario, oracle, target, round_fc_out):
    head = rounded_head(os.path.join(FIXTURES, scenario["head"]), target, round_fc_out)
    features = bf16(oracle[scenario["features"]].double())
    seqs, outs, worst = {}, {}, 0.0
    for i, call in enumerate(scenario["calls"]):
        seq = seqs.setdefault(call["seq"], ref.HeadSequence(head))
        if call["op"] == "commit":
            seq.commit(call["path"])
            continue
        source = call["input"]
        if source["kind"] == "target":
            inputs, fused = features[source["rows"]], False
        else:
            inputs, fused = torch.stack([outs[c][r] for c, r in source["from"]]), True
        out = seq.feed(call["tokens"], call["parents"], inputs, fused=fused)
        outs[i] = out
        worst = max(worst, rel_error(out, oracle[call["out"] + "/hidden"].double()),
                    rel_error(head.logits(out), oracle[call["out"] + "/logits"].double()))
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--round-fc-out", action="store_true",
                        help="round fc's output to bf16 before the residual stream")
    args = parser.parse_args()
    target = ref.LlamaTarget(os.path.join(FIXTURES, "target"))
    oracle = safetensors_io.load_folder(FIXTURES)
    with open(os.path.join(FIXTURES, "oracle.json")) as f:
        scenarios = json.load(f)["scenarios"]
    for name in ("eagle3", "eagle3_nbr", "eagle1"):
        worst = worst_error(scenarios[name], oracle, target, args.round_fc_out)
        print(f"{name}: worst relative error {worst:.4f}")


if __name__ == "__main__":
    main()
