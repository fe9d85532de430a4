#!/usr/bin/env python3
"""EAGLE head fixtures for specd's C++ head forward, from the PyTorch reference
(tools/oracle/eagle3_reference.py). Runs on the CPU with Debian's python3-torch; no transformers.

Writes tests/fixtures/eagle3/:
  target/        a tiny random Llama target in Hugging Face layout (fp32, 8 layers, llama3 RoPE
                 scaling, GQA, untied LM head, 4096 positions)
  eagle3_head/   a random EAGLE-3 head in the published layout (LlamaForCausalLMEagle3,
                 draft_vocab_size 64 < vocab 256 with d2t/t2d, taps 1, 4, 6 in both spellings,
                 rope_theta 5000, max_position_embeddings 2048)
  eagle3_nbr_head/  the EAGLE-3 head's weights with norm_before_residual: true
  eagle1_head/   a random EAGLE-1/2 head (fc 2H -> H with bias, two decoder layers, the first
                 without an input norm; the target's LM head)
  oracle.safetensors, oracle.json: the target's features at the taps and its final normed hidden
                 state for a prompt and a continuation sampled from the target, and for each
                 head a script of feed/commit calls (a prefill chain, three drafting steps of a
                 tree, a commit, a second chain and one more step) with the head's outputs
                 (hidden states before the final norm) and logits for every fed node; plus a
                 2100-pair chain and two tree steps beyond the head's 2048-position table.

The reference computes in float64 (RoPE angles in fp32, as transformers and specd define them)
and stores fp32. First it checks its target forward against transformers' logits in
tests/fixtures/models/{llama31,mistral} and stops if they differ.

  /usr/bin/python3 tools/oracle/make_eagle_fixtures.py --out tests/fixtures/eagle3
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eagle3_reference as ref  # noqa: E402
import safetensors_io  # noqa: E402

SEED = 2026
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 32, 64, 8, 4, 2, 8
DRAFT_VOCAB = 64
TAPS = [1, 4, 6]  # not the default (2, 4, 5), so a loader that ignored the config would show
PROMPT_LEN, CONTINUATION = 12, 4
LONG_LEN, LONG_PERIOD = 2100, 13
LONG_CHECK_ROWS = [0, 1000, 2046, 2047, 2048, 2049, LONG_LEN - 1]


def check_target_against_transformers(fixtures):
    worst = 0.0
    for family in ("llama31", "mistral"):
        folder = os.path.join(fixtures, "models", family)
        target = ref.LlamaTarget(folder)
        with open(os.path.join(folder, "oracle.json")) as f:
            oracle = json.load(f)
        for p in oracle["prompts"]:
            logits, _, _ = target.forward(torch.tensor([p["ids"]]))
            for pos, row in zip(p["logit_positions"], p["logits"]):
                want = torch.tensor(row, dtype=torch.float64)
                worst = max(worst, float((logits[0, pos] - want).abs().max() / want.abs().max()))
    if worst > 1e-5:
        sys.exit(f"reference target differs from transformers: relative error {worst:.3g}")
    return worst


def randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def random_linear(gen, out_f, in_f):
    return randn(gen, out_f, in_f, scale=1.0 / in_f ** 0.5)


def random_norm(gen, dim):
    return 1.0 + randn(gen, dim, scale=0.2)


def make_target(gen, folder):
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64},
        "dtype": "float32",
    }
    w = {"model.embed_tokens.weight": randn(gen, VOCAB, HIDDEN),
         "model.norm.weight": random_norm(gen, HIDDEN),
         "lm_head.weight": random_linear(gen, VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = random_norm(gen, HIDDEN)
        w[p + "post_attention_layernorm.weight"] = random_norm(gen, HIDDEN)
        w[p + "self_attn.q_proj.weight"] = random_linear(gen, HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = random_linear(gen, KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = random_linear(gen, KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = random_linear(gen, HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = random_linear(gen, FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = random_linear(gen, FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = random_linear(gen, HIDDEN, FFN)
    save_folder(folder, cfg, w)


def save_folder(folder, cfg, tensors):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    stored = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    safetensors_io.save(os.path.join(folder, "model.safetensors"), stored,
                        metadata={"format": "pt"})


def randomise(gen, module):
    """Unit-scale random weights (norm weights around 1) so every tensor moves the outputs."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(random_norm(gen, p.shape[0]))
            elif p.dim() == 2:
                p.copy_(random_linear(gen, *p.shape))
            else:
                p.copy_(randn(gen, *p.shape, scale=0.1))


def make_heads(gen, out, target):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, target_hidden_size=HIDDEN,
                  intermediate_size=FFN, num_heads=HEADS, num_kv_heads=KV_HEADS,
                  head_dim=HEAD_DIM, rms_norm_eps=1e-5)
    e3 = ref.HeadConfig(kind="eagle3", draft_vocab_size=DRAFT_VOCAB, rope_theta=5000.0,
                        max_position_embeddings=2048, taps=TAPS, **common)
    h3 = ref.Eagle3Head(e3, target.embed).double()
    randomise(gen, h3)
    h3.set_draft_vocab(torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].tolist())
    save_folder(os.path.join(out, "eagle3_head"), e3.to_json(), h3.state_dict())

    e1 = ref.HeadConfig(kind="eagle1", draft_vocab_size=VOCAB, rope_theta=10000.0,
                        num_layers=2, max_position_embeddings=2048, **common)
    h1 = ref.Eagle1Head(e1, target.embed, target.lm_head).double()
    randomise(gen, h1)
    save_folder(os.path.join(out, "eagle1_head"), e1.to_json(), h1.state_dict())

    # The same EAGLE-3 weights read with norm_before_residual (the residual stream starts from
    # hidden_norm(x)), a flag some checkpoints carry.
    nbr = dataclasses.replace(e3, norm_before_residual=True)
    save_folder(os.path.join(out, "eagle3_nbr_head"), nbr.to_json(), h3.state_dict())


class Script:
    """Runs feed/commit calls on a HeadSequence and records them for the C++ replay."""

    def __init__(self, head, name, tensors):
        self.head, self.name, self.tensors = head, name, tensors
        self.calls, self.outputs = [], {}
        self.seqs = {}

    def seq(self, sid):
        if sid not in self.seqs:
            self.seqs[sid] = ref.HeadSequence(self.head)
        return self.seqs[sid]

    def feed(self, sid, tokens, parents, inputs, source, draft_ids=None):
        """source: the JSON description of `inputs` the C++ test rebuilds them from."""
        fused = source["kind"] == "hidden"
        out = self.seq(sid).feed(tokens, parents, inputs, fused=fused)
        logits = self.head.logits(out)
        key = f"{self.name}/call{len(self.calls)}"
        self.tensors[key + "/hidden"] = out.float()
        self.tensors[key + "/logits"] = logits.float()
        call = {"op": "feed", "seq": sid, "tokens": tokens, "parents": parents, "input": source,
                "out": key}
        if draft_ids is not None:
            call["draft_ids"] = draft_ids
        self.calls.append(call)
        self.outputs[len(self.calls) - 1] = (out, logits)
        return len(self.calls) - 1

    def commit(self, sid, path):
        self.seq(sid).commit(path)
        self.calls.append({"op": "commit", "seq": sid, "path": path})

    def children(self, call, row, k, base_logprob=0.0):
        """The k best draft tokens after output `row` of `call`: (draft id, target id,
        cumulative log-probability), best first."""
        logits = self.outputs[call][1][row]
        lp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(lp, k)
        return [(int(d), int(self.head.to_target(d)), base_logprob + float(v))
                for d, v in zip(top.indices, top.values)]

    def level(self, sid, parents_info, k):
        """One tree level: for each (call, row, scratch index, cumulative logprob) parent, its k
        best children fed with the parent's output. Returns (call index, [(scratch index,
        logprob)] of the new nodes)."""
        tokens, parents, drafts, rows, lps = [], [], [], [], []
        for call, row, scratch, lp in parents_info:
            for d, t, clp in self.children(call, row, k, lp):
                tokens.append(t)
                parents.append(scratch)
                drafts.append(d)
                rows.append([call, row])
                lps.append(clp)
        inputs = torch.stack([self.outputs[c][0][r] for c, r in rows])
        base = len(self.seq(sid).parents)
        idx = self.feed(sid, tokens, parents, inputs, {"kind": "hidden", "from": rows},
                        draft_ids=drafts)
        return idx, [(base + j, lps[j]) for j in range(len(tokens))]


def run_scenario(head, name, features, ids, tensors):
    """Round 1: prefill chain, three tree steps, commit. Round 2: three accepted pairs as a chain,
    one step, commit."""
    s = Script(head, name, tensors)
    n = PROMPT_LEN
    chain = s.feed(1, ids[1:n + 1], list(range(-1, n - 1)), features[:n],
                   {"kind": "target", "rows": list(range(n))})
    step1, nodes1 = s.level(1, [(chain, n - 1, n - 1, 0.0)], 3)
    step2, nodes2 = s.level(1, [(step1, j, nodes1[j][0], nodes1[j][1]) for j in range(3)], 2)
    best = sorted(range(len(nodes2)), key=lambda j: -nodes2[j][1])[:2]
    s.level(1, [(step2, j, nodes2[j][0], nodes2[j][1]) for j in best], 2)
    s.commit(1, list(range(n)))
    chain2 = s.feed(1, ids[n + 1:n + 4], [-1, 0, 1], features[n:n + 3],
                    {"kind": "target", "rows": [n, n + 1, n + 2]})
    s.level(1, [(chain2, 2, 2, 0.0)], 2)
    s.commit(1, [0, 1, 2])
    return s.calls


def run_long(head, tensors):
    """A 2100-pair chain of periodic features (rows base[p % 13]) and tokens (p * 37 + 11) % V,
    then two tree steps at positions 2100 and 2101: RoPE beyond the head's 2048-entry table."""
    gen = torch.Generator().manual_seed(SEED + 1)
    base = randn(gen, LONG_PERIOD, 3 * HIDDEN)
    tensors["long/base_features"] = base.float()
    base = base.float().double()
    tokens = [(p * 37 + 11) % VOCAB for p in range(LONG_LEN)]
    feats = base[torch.arange(LONG_LEN) % LONG_PERIOD]
    s = Script(head, "long", {})
    chain = s.feed(7, tokens, list(range(-1, LONG_LEN - 1)), feats,
                   {"kind": "periodic", "period": LONG_PERIOD})
    step1, nodes1 = s.level(7, [(chain, LONG_LEN - 1, LONG_LEN - 1, 0.0)], 3)
    s.level(7, [(step1, j, nodes1[j][0], nodes1[j][1]) for j in range(3)], 2)
    # Keep the chain's checked rows only: 2100 rows of logits would dwarf everything else.
    rows = torch.tensor(LONG_CHECK_ROWS)
    tensors["long/call0/hidden"] = s.outputs[0][0][rows].float()
    tensors["long/call0/logits"] = s.outputs[0][1][rows].float()
    for c in (1, 2):
        tensors[f"long/call{c}/hidden"] = s.outputs[c][0].float()
        tensors[f"long/call{c}/logits"] = s.outputs[c][1].float()
    s.calls[0]["checked_rows"] = LONG_CHECK_ROWS
    s.calls[0]["tokens_formula"] = "(p * 37 + 11) % vocab"
    s.calls[0]["length"] = LONG_LEN
    del s.calls[0]["tokens"], s.calls[0]["parents"]
    return s.calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/eagle3")
    ap.add_argument("--fixtures", default="tests/fixtures",
                    help="where the transformers fixtures (models/llama31, models/mistral) are")
    args = ap.parse_args()
    worst = check_target_against_transformers(args.fixtures)
    print(f"reference target vs transformers: max relative error {worst:.3g}")

    out = args.out
    for sub in ("target", "eagle3_head", "eagle3_nbr_head", "eagle1_head"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(SEED)
    make_target(gen, os.path.join(out, "target"))
    # Everything below reads the fp32 files back, exactly as specd will.
    target = ref.LlamaTarget(os.path.join(out, "target"))
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
    make_heads(gen, out, target)
    h3 = ref.load_head(os.path.join(out, "eagle3_head"), target)
    h1 = ref.load_head(os.path.join(out, "eagle1_head"), target)
    h3n = ref.load_head(os.path.join(out, "eagle3_nbr_head"), target)
    assert h3n.cfg.norm_before_residual
    assert h3.cfg.taps == TAPS and h1.cfg.kind == "eagle1"

    ids = list(prompt)
    for _ in range(CONTINUATION):  # sampled at temperature 1 (greedy loops on one token here)
        logits, _, _ = target.forward(torch.tensor([ids]))
        probs = torch.softmax(logits[0, -1], dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    logits, states, final = target.forward(torch.tensor([ids]), taps=TAPS, want_final=True)
    taps = torch.cat([states[t][0] for t in TAPS], dim=-1).float()
    final = final[0].float()
    tensors = {"ids": torch.tensor(ids, dtype=torch.int32), "taps": taps, "final_hidden": final,
               "target_logits": logits[0].float()}
    with torch.no_grad():
        calls3 = run_scenario(h3, "eagle3", taps.double(), ids, tensors)
        calls1 = run_scenario(h1, "eagle1", final.double(), ids, tensors)
        calls3n = run_scenario(h3n, "eagle3_nbr", taps.double(), ids, tensors)
        calls_long = run_long(h3, tensors)
    safetensors_io.save(os.path.join(out, "oracle.safetensors"), tensors)
    oracle = {
        "note": "written by tools/oracle/make_eagle_fixtures.py; float64 reference, fp32 stored",
        "torch": torch.__version__,
        "ids": ids, "prompt_len": PROMPT_LEN,
        "taps": TAPS, "default_taps": ref.default_taps(LAYERS),
        "tap_layout": "taps[p] = concat(residual entering layer L for L in taps); "
                      "final_hidden[p] = the target's final normed hidden state",
        "draft_vocab_size": DRAFT_VOCAB,
        "scenarios": {
            "eagle3": {"head": "eagle3_head", "features": "taps", "calls": calls3},
            "eagle1": {"head": "eagle1_head", "features": "final_hidden", "calls": calls1},
            "eagle3_nbr": {"head": "eagle3_nbr_head", "features": "taps", "calls": calls3n},
            "long": {"head": "eagle3_head", "features": "long/base_features",
                     "calls": calls_long},
        },
    }
    with open(os.path.join(out, "oracle.json"), "w") as f:
        json.dump(oracle, f, separators=(",", ":"))
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(d, x)) for d, _, xs in os.walk(out) for x in xs)
    print(f"wrote {out}: {size} bytes")


if __name__ == "__main__":
    main()
