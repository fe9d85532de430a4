#!/usr/bin/env python3
"""Writes a random-weight bf16 Hugging Face Llama folder at a real model's shape, for benchmarks.

Runs on the GPU host (torch + safetensors): weights are drawn on the GPU with a fixed seed
(normal, std 0.02; norms are ones) and saved with safetensors in one file. Llama-3.1-8B is
16 GB: write it to /tmp on the host, never into the repository.

  python3 bench/tools/make_random_checkpoint.py --shape llama-3.1-8b --out /tmp/specd-8b
  python3 bench/tools/make_random_checkpoint.py --shape llama-3.2-1b --out /tmp/specd-1b
  python3 bench/tools/make_random_checkpoint.py --shape llama-3.1-70b --layers 8 --out /tmp/specd-70b8
"""
import argparse
import json
import os
import time

import torch
from safetensors.torch import save_file

from llama_shapes import SHAPES, hf_config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--layers", type=int, default=0,
                    help="keep only this many decoder layers (0: the shape's own count)")
    args = ap.parse_args()
    s = dict(SHAPES[args.shape])
    config = hf_config(args.shape)
    if args.layers > 0:
        s["num_hidden_layers"] = config["num_hidden_layers"] = args.layers
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    h, f, v = s["hidden_size"], s["intermediate_size"], config["vocab_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]

    def rand(*shape):
        t = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        t.normal_(0.0, args.std, generator=gen)
        return t.cpu()

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
    tensors = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": ones(h)}
    if not s["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(v, h)
    for l in range(s["num_hidden_layers"]):
        p = f"model.layers.{l}."
        tensors.update({
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
        })
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": 128000, "eos_token_id": [128001, 128009]}, fh, indent=2)
    n = sum(t.numel() for t in tensors.values())
    print(f"{args.shape}: {n / 1e9:.2f} B parameters, {2 * n / 1e9:.2f} GB -> {args.out} "
          f"in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
