#!/usr/bin/env python3
"""A small EAGLE-1/2 head for a served target, for the services' end-to-end tests.

EAGLE-1/2 heads read the target's final norm output (the feature; specd's tap N + 1), which is
what the verify service must export for them. The published EAGLE-1/2 heads are for 7B+ targets,
so this writes one for the reference target (models/pycoder-target by default) in the published
layout (LlamaForCausalLM: fc.weight [H, 2H], fc.bias [H], layers.0.* without an input norm, the
target's LM head), bf16, small: one layer, 2 query heads and 1 KV head of 32, intermediate 64.

The layer is random, its output projections scaled down; fc is fitted in closed form (ridge
least squares, float64) so that fc(concat(embedding of t_{p+1}, feature_p)) approximates
feature_{p+1} on the target's own greedy continuations of prompts cut from the training files of
this machine's Python installation (the reference models' corpus). The target's LM head over
that then proposes the target's next token often enough for trees to be accepted, so a serving
test sees accepted drafts and taps of accepted rows, not only rejected trees. It is not a
trained head: its acceptance says nothing about EAGLE-1/2 at its best.

  /usr/bin/python3 tools/oracle/make_eagle1_serving_head.py \
      --target models/pycoder-target --out tests/fixtures/eagle1_pycoder

Deterministic for a given target, corpus and PyTorch build (seeded); prints the fit's held-out
top-1 agreement (the share of positions where argmax of the LM head over fc's output is the
target's next token).
"""

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "reference_models"))
sys.path.insert(0, os.path.join(ROOT, "tools", "eagle3"))
import eagle3_reference as ref  # noqa: E402
import safetensors_io  # noqa: E402
from bpe_tokenizer import load_tokenizer  # noqa: E402

SEED = 2026
HEADS, KV_HEADS, HEAD_DIM, FFN = 2, 1, 32, 64
OUT_SCALE = 0.05  # o_proj and down_proj, so the layer moves fc's output only a little


@torch.no_grad()
def greedy(target, prompts, new_tokens):
    """prompts [B, P] continued greedily by new_tokens with a KV cache: [B, P + new_tokens]."""
    cache = ref.TargetCache(target.cfg.num_layers)
    logits, _, _ = target.forward(prompts, cache=cache)
    out = [prompts]
    for _ in range(new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        logits, _, _ = target.forward(nxt, cache=cache)
    return torch.cat(out, dim=1)


def pairs(target, seqs):
    """Rows [emb(t_{p+1}), f_p] and targets f_{p+1} over every position of seqs [B, L], with the
    target's token at p + 2 (what the head's output at p should propose)."""
    _, _, final = target.forward(seqs, want_final=True)
    emb = target.embed[seqs]
    x = torch.cat((emb[:, 1:-1], final[:, :-2]), dim=-1)
    y = final[:, 1:-1]
    nxt = (final[:, 1:-1] @ target.lm_head.T).argmax(-1)
    h = x.shape[-1]
    return x.reshape(-1, h), y.reshape(-1, y.shape[-1]), nxt.reshape(-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "models", "pycoder-target"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "eagle1_pycoder"))
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--gen-len", type=int, default=72)
    ap.add_argument("--corpus-chars", type=int, default=400_000)
    ap.add_argument("--ridge", type=float, default=1e-2)
    args = ap.parse_args()

    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    target = ref.LlamaTarget(args.target, dtype=torch.float32)
    tc = target.cfg
    import train as reference_train  # the reference models' corpus (tools/reference_models)
    docs, _, _ = reference_train.gather_corpus(args.corpus_chars)
    encode = load_tokenizer(os.path.join(args.target, "tokenizer.json"))
    stream = [i for doc in encode([text for _, text in docs]) for i in doc]
    starts = torch.randint(0, len(stream) - args.prompt_len, (args.prompts,), generator=gen)
    prompts = torch.tensor([stream[s:s + args.prompt_len] for s in starts.tolist()])
    seqs = greedy(target, prompts, args.gen_len)

    x, y, want = pairs(target, seqs)
    x, y = x.double(), y.double()
    n_fit = x.shape[0] * 7 // 8  # the last eighth of the rows (the last prompts) held out
    ones = torch.ones(x.shape[0], 1, dtype=x.dtype)
    xb = torch.cat((x, ones), dim=1)
    a = xb[:n_fit]
    w = torch.linalg.solve(a.T @ a + args.ridge * torch.eye(a.shape[1], dtype=a.dtype),
                           a.T @ y[:n_fit])  # [2H + 1, H]
    fc_w, fc_b = w[:-1].T.contiguous(), w[-1].contiguous()
    pred = (xb[n_fit:] @ w).float() @ target.lm_head.T
    agree = float((pred.argmax(-1) == want[n_fit:]).float().mean())
    print(f"fc fitted on {n_fit} pairs; held-out top-1 agreement of fc alone {agree:.3f} "
          f"({x.shape[0] - n_fit} pairs)")

    cfg = ref.HeadConfig(kind="eagle1", vocab_size=tc.vocab_size, draft_vocab_size=tc.vocab_size,
                         hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size,
                         intermediate_size=FFN, num_heads=HEADS, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, num_layers=1, rms_norm_eps=tc.rms_norm_eps,
                         rope_theta=10000.0, max_position_embeddings=2048)
    head = ref.Eagle1Head(cfg, target.embed.double(), target.lm_head.double()).double()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
            elif p.dim() == 2:
                scale = OUT_SCALE if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype)
                        * scale / p.shape[1] ** 0.5)
        head.fc.weight.copy_(fc_w)
        head.fc.bias.copy_(fc_b)
    os.makedirs(args.out, exist_ok=True)
    import json
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg.to_json("bfloat16"), f, indent=2)
        f.write("\n")
    tensors = {k: v.to(torch.bfloat16) for k, v in head.state_dict().items()}
    safetensors_io.save(os.path.join(args.out, "model.safetensors"), tensors,
                        metadata={"format": "pt"})
    print(f"wrote {args.out}: {sum(t.numel() for t in tensors.values())} parameters (bf16)")


if __name__ == "__main__":
    main()
