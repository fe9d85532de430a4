#!/usr/bin/env python3
"""Emulates where bf16 rounding happens in specd's CUDA forward and in transformers' bf16 eager
forward, on the family fixtures, with numpy only (no torch, no GPU).

Each path is the plain fp32 forward (Llama / Qwen2 / Qwen3: q/k norm, QKV bias, llama3 RoPE
scaling, tied embeddings) with round-to-nearest-even fp32 -> bf16 inserted where that path
rounds. The rounding points are switches (Variant below), so that one can be flipped at a time
and its share of the error measured. GEMMs and the attention's dot products accumulate in fp64
and are then rounded to fp32: the accumulation order of cuBLASLt / the MMA is not emulated, only
the (much larger) bf16 rounding of what goes in and comes out.

Where the numbers come from (specd, read from the code):
  weights        bf16 (RNE of an fp32 checkpoint), except the RMSNorm and q/k norm weights,
                 kept fp32 (Variant.keep_fp32; they were bf16 before)
  embedding      bf16 table rows, exact in the fp32 residual stream (residual_init)
  residual       fp32 (RmsNormRow8 keeps `res` in fp32); the o_proj / down GEMM outputs that are
                 added to it are bf16 (the partial / all-reduce input x)
  RMSNorm        out = bf16(h * inv * w), one rounding, fp32 math (rmsnorm_row.cuh)
  GEMM           fp32 accumulation, bias in the fp32 epilogue, output rounded to bf16
  q/k norm+RoPE  from the bf16 q/k: norm and rotation in fp32, one rounding (rope.cu); the KV
                 cache holds these bf16 keys and the bf16 values
  attention      scores fp32, online softmax with p = exp2(s - m) in fp32, l summed from the
                 fp32 p, P rounded to bf16 for P.V (fp32 accumulation), out = bf16(o / l)
  SwiGLU         bf16(silu(g) * u) in fp32, one rounding
  LM head        bf16 normed row times bf16 weights, fp32 output

transformers (Qwen3/Llama/Qwen2 modeling, bf16, eager attention):
  RMSNorm        bf16(w * bf16(h * rsqrt(var + eps))) with h the bf16 input
  residual       bf16: every residual add rounds
  q/k norm       as RMSNorm (two roundings), then RoPE in bf16: cos/sin rounded to bf16,
                 bf16(bf16(q * cos) + bf16(rotate_half(q) * sin))
  attention      scores bf16(q k^T) (then * scale, exact here: 1/4), softmax in fp32,
                 P = bf16(softmax), out = bf16(P V)
  MLP            bf16(bf16(silu(g)) * u)
  LM head        logits rounded to bf16

Usage (repository root):  python3 tools/oracle/bf16_emulate.py [--families qwen3,llama31,qwen2]
                          [--random N]  (N extra random prompts: error statistics, not just the
                          fixture's worst row)
"""

import argparse
import dataclasses
import json
import os
import struct

import numpy as np


def bf16(x):
    """Round-to-nearest-even fp32 -> bf16, returned as fp32 (finite inputs)."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def mm(a, b_t):
    """a [.., k] times b_t [n, k]^T, fp64 accumulation rounded to fp32."""
    return (a.astype(np.float64) @ b_t.astype(np.float64).T).astype(np.float32)


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", meta["dtype"]
        b, e = meta["data_offsets"]
        out[name] = np.frombuffer(data[b:e], dtype=np.float32).reshape(meta["shape"]).copy()
    return out


def rope_inv_freq(cfg, head_dim):
    """As engine/model_config.cc RopeInvFreq (fp64 math, fp32 result)."""
    rp = cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    half = head_dim // 2
    inv = np.array([1.0 / theta ** (2.0 * i / head_dim) for i in range(half)], dtype=np.float64)
    inv = inv.astype(np.float32)
    if rp.get("rope_type") == "llama3":
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        orig = rp["original_max_position_embeddings"]
        low_wl, high_wl = orig / lo, orig / hi
        out = []
        for f in inv.astype(np.float64):
            wl = 2.0 * np.pi / f
            if wl > low_wl:
                f = f / factor
            elif wl >= high_wl:
                s = (orig / wl - lo) / (hi - lo)
                f = (1.0 - s) * f / factor + s * f
            out.append(f)
        inv = np.array(out, dtype=np.float32)
    return inv


@dataclasses.dataclass
class Variant:
    """Where a bf16 forward rounds. Defaults: specd's CUDA backend before norm weights went fp32
    (SPECD_FP32_NORMS is the backend since)."""
    weights_bf16: bool = True  # all weights (norm weights too) stored in bf16
    keep_fp32: tuple = ()  # weights whose name contains one of these stay fp32 (weights_bf16)
    resid_bf16: bool = False  # round the residual stream after every add (transformers)
    # RMSNorm: "single" = bf16(h*inv*w) (specd); "hf" = bf16(w*bf16(h*inv)); "fp32" = no rounding
    norm: str = "single"
    # q/k norm + RoPE: "single" = fp32 norm and rotation, one rounding (specd); "hf" = norm as
    # transformers' RMSNorm, RoPE in bf16 with bf16 cos/sin; "fp32" = no rounding at all
    qk: str = "single"
    qkv_out_bf16: bool = True  # the QKV GEMM's output (q, k, v) rounded to bf16
    scores_bf16: bool = False  # round q.k to bf16 before the softmax (transformers)
    # P.V: "unnorm" = bf16(exp(s - max)), divide by the fp32 sum afterwards (specd);
    # "norm" = bf16(softmax) (transformers); "fp32" = no rounding
    p: str = "unnorm"
    attn_out_bf16: bool = True
    gemm_out_bf16: bool = True  # o_proj, gate/up, down outputs rounded to bf16
    silu_bf16: bool = False  # round silu(g) before multiplying by u (transformers)
    act_bf16: bool = True  # SwiGLU output rounded
    logits_bf16: bool = False  # LM head output rounded (transformers)
    fp32: bool = False  # no rounding anywhere (the reference)


SPECD = Variant()
SPECD_FP32_NORMS = Variant(keep_fp32=("norm",))
HF = Variant(resid_bf16=True, norm="hf", qk="hf", scores_bf16=True, p="norm", silu_bf16=True,
             logits_bf16=True)
FP32 = Variant(weights_bf16=False, norm="fp32", qk="fp32", qkv_out_bf16=False, p="fp32",
               attn_out_bf16=False, gemm_out_bf16=False, act_bf16=False, fp32=True)


class Model:
    def __init__(self, folder):
        self.cfg = json.load(open(os.path.join(folder, "config.json")))
        self.w = load_safetensors(os.path.join(folder, "model.safetensors"))
        c = self.cfg
        self.H = c["hidden_size"]
        self.nh = c["num_attention_heads"]
        self.nkv = c["num_key_value_heads"]
        self.hd = c.get("head_dim") or self.H // self.nh
        self.eps = c["rms_norm_eps"]
        self.layers = c["num_hidden_layers"]
        self.inv_freq = rope_inv_freq(c, self.hd)
        if "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]

    def forward(self, ids, v):
        r = (lambda x: f32(x)) if v.fp32 else bf16
        rw = bf16 if v.weights_bf16 else f32
        W = {k: (f32(a) if any(t in k for t in v.keep_fp32) else rw(a))
             for k, a in self.w.items()}
        eps = np.float32(self.eps)
        T, H, nh, nkv, hd = len(ids), self.H, self.nh, self.nkv, self.hd
        half = hd // 2

        def rms(h, w):
            h = f32(h)
            var = np.mean((h.astype(np.float64) ** 2), axis=-1, keepdims=True).astype(np.float32)
            inv = f32(1.0 / np.sqrt(var + eps))
            if v.norm == "hf":
                return bf16(w * bf16(h * inv))
            if v.norm == "fp32":
                return f32(h * inv * w)
            return r(h * inv * w)

        def maybe(x, flag):
            return r(x) if flag else f32(x)

        pos = np.arange(T, dtype=np.float32)
        ang = f32(pos[:, None] * self.inv_freq[None, :])  # [T, half]
        cos, sin = f32(np.cos(ang.astype(np.float64))), f32(np.sin(ang.astype(np.float64)))

        def qk_transform(x, wn):  # x [T, heads, hd]
            if v.qk == "hf":
                if wn is not None:
                    var = np.mean(x.astype(np.float64) ** 2, -1, keepdims=True)
                    x = bf16(wn * bf16(x * f32(1.0 / np.sqrt(f32(var) + eps))))
                c, s = bf16(cos)[:, None, :], bf16(sin)[:, None, :]
                a, b = x[..., :half], x[..., half:]
                lo = bf16(bf16(a * c) + bf16(-b * s))
                hi = bf16(bf16(b * c) + bf16(a * s))
                return np.concatenate([lo, hi], -1)
            if wn is not None:
                var = np.mean(x.astype(np.float64) ** 2, -1, keepdims=True).astype(np.float32)
                x = f32(x * f32(1.0 / np.sqrt(var + eps)) * wn)
            a, b = x[..., :half], x[..., half:]
            c, s = cos[:, None, :], sin[:, None, :]
            out = np.concatenate([f32(a * c - b * s), f32(b * c + a * s)], -1)
            return out if v.qk == "fp32" else r(out)

        hidden = W["model.embed_tokens.weight"][ids]  # exact (bf16 rows)
        for l in range(self.layers):
            p = f"model.layers.{l}."
            x = rms(hidden, W[p + "input_layernorm.weight"])
            outs = []
            for name in ("q", "k", "v"):
                y = mm(x, W[p + f"self_attn.{name}_proj.weight"])
                bk = p + f"self_attn.{name}_proj.bias"
                if bk in W:
                    y = f32(y + W[bk])
                outs.append(maybe(y, v.qkv_out_bf16))
            q = outs[0].reshape(T, nh, hd)
            k = outs[1].reshape(T, nkv, hd)
            val = outs[2].reshape(T, nkv, hd)
            q = qk_transform(q, W.get(p + "self_attn.q_norm.weight"))
            k = qk_transform(k, W.get(p + "self_attn.k_norm.weight"))
            scale = np.float32(1.0 / np.sqrt(hd))
            group = nh // nkv
            attn = np.zeros((T, nh, hd), np.float32)
            mask = np.tril(np.ones((T, T), bool))
            for h in range(nh):
                kh, vh = k[:, h // group], val[:, h // group]
                s = mm(q[:, h], kh)  # [T, T]
                if v.scores_bf16:
                    s = bf16(s)
                s = f32(s * scale)
                s = np.where(mask, s, -np.inf)
                m = s.max(-1, keepdims=True)
                e = f32(np.exp((s - m).astype(np.float64)))
                lsum = f32(e.astype(np.float64).sum(-1, keepdims=True))
                if v.p == "norm":
                    o = mm(bf16(f32(e / lsum)), vh.T)
                elif v.p == "unnorm":
                    o = f32(mm(bf16(e), vh.T) * f32(1.0 / lsum))
                else:
                    o = mm(f32(e / lsum), vh.T)
                attn[:, h] = maybe(o, v.attn_out_bf16)
            o = maybe(mm(attn.reshape(T, nh * hd), W[p + "self_attn.o_proj.weight"]),
                      v.gemm_out_bf16)
            hidden = maybe(hidden + o, v.resid_bf16)
            x = rms(hidden, W[p + "post_attention_layernorm.weight"])
            g = maybe(mm(x, W[p + "mlp.gate_proj.weight"]), v.gemm_out_bf16)
            u = maybe(mm(x, W[p + "mlp.up_proj.weight"]), v.gemm_out_bf16)
            silu = f32(g / (1.0 + np.exp(-g.astype(np.float64))))
            if v.silu_bf16:
                silu = bf16(silu)
            act = maybe(silu * u, v.act_bf16)
            d = maybe(mm(act, W[p + "mlp.down_proj.weight"]), v.gemm_out_bf16)
            hidden = maybe(hidden + d, v.resid_bf16)
        x = rms(hidden, W["model.norm.weight"])
        logits = mm(x, W["lm_head.weight"])
        return bf16(logits) if v.logits_bf16 else logits


def rel_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def fixture_error(model, oracle, v):
    worst, where = 0.0, None
    for i, p in enumerate(oracle["prompts"]):
        logits = model.forward(np.array(p["ids"]), v)
        for r, pos in enumerate(p["logit_positions"]):
            e = rel_error(logits[pos], p["logits"][r])
            if e > worst:
                worst, where = e, (i, pos)
    return worst, where


def random_errors(model, prompts, refs, v):
    """Per-prompt worst row error over all positions, against the emulated fp32 forward."""
    out = []
    for ids, ref in zip(prompts, refs):
        lg = model.forward(ids, v)
        out.append(max(rel_error(lg[t], ref[t]) for t in range(len(ids))))
    return np.array(out)


def variants():
    """(label, Variant): the two paths, then one switch at a time from each."""
    r = dataclasses.replace
    return [
        ("specd, bf16 norm weights (before)", SPECD),
        ("specd, fp32 norm weights (now)", SPECD_FP32_NORMS),
        ("transformers (hf)", HF),
        ("specd, fp32 weights (only activations round)", r(SPECD, weights_bf16=False)),
        ("specd, fp32 q/k norm weights", r(SPECD, keep_fp32=("q_norm", "k_norm"))),
        ("specd, fp32 RMSNorm weights (not q/k norm)",
         r(SPECD, keep_fp32=("layernorm", "model.norm"))),
        ("specd, fp32 embedding / LM head", r(SPECD, keep_fp32=("embed", "lm_head"))),
        ("specd, fp32 linear weights (q/k/v/o/gate/up/down)", r(SPECD, keep_fp32=("proj",))),
        ("weights bf16, activations fp32", r(FP32, weights_bf16=True)),
        ("hf, fp32 norm weights", r(HF, keep_fp32=("norm",))),
        ("specd + bf16 residual stream", r(SPECD, resid_bf16=True)),
        ("specd + hf RMSNorm (two roundings)", r(SPECD, norm="hf")),
        ("specd + hf q/k norm and bf16 RoPE", r(SPECD, qk="hf")),
        ("specd, q/k unrounded after norm+RoPE", r(SPECD, qk="fp32")),
        ("specd, QKV GEMM output fp32", r(SPECD, qkv_out_bf16=False)),
        ("specd + bf16 scores", r(SPECD, scores_bf16=True)),
        ("specd, P normalised before rounding", r(SPECD, p="norm")),
        ("specd, P fp32", r(SPECD, p="fp32")),
        ("specd, attention output fp32", r(SPECD, attn_out_bf16=False)),
        ("specd, o/gate/up/down outputs fp32", r(SPECD, gemm_out_bf16=False)),
        ("specd + bf16 silu", r(SPECD, silu_bf16=True)),
        ("specd, SwiGLU output fp32", r(SPECD, act_bf16=False)),
        ("specd + bf16 logits", r(SPECD, logits_bf16=True)),
        ("hf, fp32 residual stream", r(HF, resid_bf16=False)),
        ("hf, specd RMSNorm", r(HF, norm="single")),
        ("hf, specd q/k norm+RoPE", r(HF, qk="single")),
        ("hf, fp32 scores", r(HF, scores_bf16=False)),
        ("hf, specd P", r(HF, p="unnorm")),
        ("hf, fp32 silu", r(HF, silu_bf16=False)),
        ("hf, fp32 logits", r(HF, logits_bf16=False)),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="tests/fixtures/models")
    ap.add_argument("--families", default="qwen3,llama31,qwen2")
    ap.add_argument("--random", type=int, default=0,
                    help="extra random prompts (length 19) per family for error statistics")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    fams = args.families.split(",")
    models = {f: Model(os.path.join(args.fixtures, f)) for f in fams}
    oracles = {f: json.load(open(os.path.join(args.fixtures, f, "oracle.json"))) for f in fams}
    for f in fams:  # the fp32 emulation must reproduce transformers' fp32 oracle
        e, _ = fixture_error(models[f], oracles[f], FP32)
        print(f"{f}: fp32 emulation vs oracle {e:.2e}")
    rnd = {}
    if args.random:
        rng = np.random.default_rng(args.seed)
        for f in fams:
            vocab = models[f].cfg["vocab_size"]
            prompts = [rng.integers(0, vocab, 19) for _ in range(args.random)]
            refs = [models[f].forward(ids, FP32) for ids in prompts]
            rnd[f] = (prompts, refs)
    head = "| variant | " + " | ".join(f"{f} fixture (worst at)" for f in fams)
    if args.random:
        head += " | " + " | ".join(f"{f} random: mean / p90 / max" for f in fams)
    print(head + " |")
    print("|---" * (1 + len(fams) * (2 if args.random else 1)) + "|")
    for label, v in variants():
        cells = []
        for f in fams:
            e, where = fixture_error(models[f], oracles[f], v)
            cells.append(f"{e:.2e} {where}")
        for f in rnd:
            errs = random_errors(models[f], *rnd[f], v)
            cells.append(f"{errs.mean():.2e} / {np.quantile(errs, 0.9):.2e} / {errs.max():.2e}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
