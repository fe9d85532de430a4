#!/usr/bin/env python3
"""How far transformers itself lands from its fp32 logits when the same model runs in bf16.

For each family fixture (tests/fixtures/models/<family>/oracle.json, fp32 logits written by
make_fixtures.py), loads the fixture model in bfloat16 (weights and activations, on the GPU when
there is one) and prints the worst relative error max|bf16 - fp32| / max|fp32| over the fixture's
rows, the same metric as tests/gpu/cuda_model_test.cc. It says whether an error of specd's bf16
CUDA backend on a fixture is above what bf16 arithmetic itself gives there.

Usage (GPU host, repository root):  python3 tools/oracle/bf16_error.py [--families qwen3,llama31]
"""

import argparse
import json
import os

import torch
import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="tests/fixtures/models")
    ap.add_argument("--families", default="llama31,mistral,qwen2,qwen3")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}")
    print("| family | rows | worst rel. error, transformers bf16 vs fp32 | at prompt/position |")
    print("|---|---|---|---|")
    for fam in args.families.split(","):
        folder = os.path.join(args.fixtures, fam)
        oracle = json.load(open(os.path.join(folder, "oracle.json")))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.bfloat16, attn_implementation="eager").to(device).eval()
        worst, where, rows = 0.0, None, 0
        for i, p in enumerate(oracle["prompts"]):
            ids = torch.tensor([p["ids"]], device=device)
            with torch.no_grad():
                logits = model(ids).logits[0].float().cpu()
            for r, pos in enumerate(p["logit_positions"]):
                want = torch.tensor(p["logits"][r], dtype=torch.float64)
                got = logits[pos].double()
                err = float((got - want).abs().max() / want.abs().max())
                rows += 1
                if err > worst:
                    worst, where = err, (i, pos)
        print(f"| {fam} | {rows} | {worst:.3e} | {where} |")


if __name__ == "__main__":
    main()
