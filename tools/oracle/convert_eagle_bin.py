#!/usr/bin/env python3
"""Converts an EAGLE head saved as pytorch_model.bin (EAGLE-1/2 heads and some EAGLE-3 heads are
published that way) to the model.safetensors specd reads. Needs PyTorch only (any machine that has
it; Debian's python3-torch will do).

  python3 tools/oracle/convert_eagle_bin.py HEAD_DIR OUT_DIR [--dtype keep|bfloat16|float16|float32]

HEAD_DIR holds pytorch_model.bin, or shards named by pytorch_model.bin.index.json, and config.json.
OUT_DIR receives model.safetensors with every tensor under its own name (nothing renamed or
dropped: specd refuses tensors a head does not use, so a surprise shows at load time) and copies
of config.json and the folder's other .json files. Floating-point tensors keep their dtype unless
--dtype says otherwise; integer and boolean ones (d2t, t2d) are never cast. Tensors that share
storage in the .bin are written as separate copies.
"""

import argparse
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_bin(path):
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except TypeError:  # torch < 1.13 has no weights_only
        state = torch.load(path, map_location="cpu")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ValueError(f"{path}: not a state dict of tensors")
    return state


def read_head(head_dir):
    index = os.path.join(head_dir, "pytorch_model.bin.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["pytorch_model.bin"]
    state = {}
    for name in files:
        for key, value in load_bin(os.path.join(head_dir, name)).items():
            if key in state:
                raise ValueError(f"{name}: tensor {key} appears in two shards")
            state[key] = value
    return state


def convert(head_dir, out_dir, dtype="keep"):
    state = read_head(head_dir)
    out = {}
    for key, value in state.items():
        t = value.detach().clone().contiguous()
        if dtype != "keep" and t.is_floating_point():
            t = t.to(DTYPES[dtype])
        out[key] = t
    os.makedirs(out_dir, exist_ok=True)
    safetensors_io.save(os.path.join(out_dir, "model.safetensors"), out,
                        metadata={"format": "pt"})
    for name in os.listdir(head_dir):
        if name.endswith(".json") and name != "pytorch_model.bin.index.json":
            shutil.copy(os.path.join(head_dir, name), os.path.join(out_dir, name))
    return sorted(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("head_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="keep", choices=["keep"] + sorted(DTYPES))
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.head_dir, "config.json")):
        sys.exit(f"{args.head_dir}: no config.json (specd needs it beside the weights)")
    names = convert(args.head_dir, args.out_dir, args.dtype)
    print(f"wrote {len(names)} tensors to {os.path.join(args.out_dir, 'model.safetensors')}")


if __name__ == "__main__":
    main()
