#!/usr/bin/env python3
"""Trains an EAGLE-3 draft head for specd's reference target (models/pycoder-target) and writes it
in the published layout (config.json with LlamaForCausalLMEagle3, bf16 model.safetensors), with
an evaluation of held-out acceptance.

Each step trains on rows cut from the training files: the target's own continuations of prompts
(half greedy, half sampled at temperature 0.8; generated --gen-batch rows at a time) and, with
--generated-share below 1, windows of the files' own text, which need no generation (EAGLE-1's
fixed data). One pass of the frozen target over the batch gives its features at the taps and its
next-token distributions, and the head is trained on those with the training-time test of
EAGLE-3: the head is unrolled `--depth` (7) steps, step 0 reading fc(taps) and each later step
its own previous output (a draft node at tree depth i attends to the real pairs before it and to
its own ancestors), with a soft cross-entropy against the target's distribution over the draft
vocabulary at every step, weighted 0.8^i. The model is tools/oracle/eagle3_reference.py's
Eagle3Head, the module specd's C++ forward is checked against, so training and serving compute
the same function (tests/tools/test_eagle_oracle.py checks the unrolled attention against the
tree forward).

Data: the .py files of this machine's Python installation (standard library and site-packages),
split by a hash of their path exactly as the reference models' corpus was
(tools/reference_models/train.py: 2% of files held out), tokenized with the target's tokenizer.

Evaluation (held-out files): the target continues held-out prompts greedily; speculative decoding
with the head is simulated on those continuations, drafting trees the way specd's drafters build
them (EAGLE-2: top-k per node by cumulative log-probability, best nodes kept), and tau (tokens per
target step, bonus included) is reported for a chain of 4 and for the router's default tree
(depth 4, top-k 4, 16 nodes), beside the standalone draft model's greedy chain and the same trees
drafted by it, on the same text.

Runs on the CPU (fp32, --threads 1 by default: keep such runs short) or a GPU (--device cuda:
bf16 autocast, fp32 master weights). The training loop stops after --minutes; evaluation after.

  /usr/bin/python3 tools/eagle3/train_head.py --out /tmp/pycoder-eagle3 --minutes 5
  python3 tools/eagle3/train_head.py --device cuda --generated-share 0.25 ...   (GPU host)
  /usr/bin/python3 tools/eagle3/train_head.py --eval-only --out models/pycoder-eagle3
"""

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools", "oracle"))
sys.path.insert(0, os.path.join(ROOT, "tools", "reference_models"))
sys.path.insert(0, HERE)
import eagle3_reference as ref  # noqa: E402
import safetensors_io  # noqa: E402
from bpe_tokenizer import load_tokenizer  # noqa: E402

T0 = time.time()
EOS = 0
# Taps entering layers 1, 2 and 4 of the 5-layer target: the defaults (2, N/2, N-3) are all 2
# here. EAGLE-3 fuses a low, a middle and a high layer; tap 0 (the embeddings) would repeat what
# the head's own token embedding says, and tap 5 (after the last layer) is the state the target's
# LM head reads, tuned to the token the head is already given rather than the one after it.
# 1, 2, 4 spread over what is left, the high one at the relative depth of Llama-3.1-8B's 29/32.
DEFAULT_TAPS = "1,2,4"


def log(msg):
    print(f"[eagle3 {time.time() - T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------

def load_corpus(tokenizer_path, max_train_chars, max_val_files):
    """(train token stream, held-out token stream) as int64 tensors, files joined by EOS."""
    import train as reference_train  # tools/reference_models/train.py: the same corpus and split
    train_docs, val_docs, _ = reference_train.gather_corpus(max_train_chars)
    encode = load_tokenizer(tokenizer_path)

    def stream(docs):
        ids = []
        for doc in encode([text for _, text in docs]):
            ids.extend(doc)
            ids.append(EOS)
        return torch.tensor(ids, dtype=torch.int64)

    t = time.time()
    train = stream(train_docs)
    val = stream(val_docs[:max_val_files])
    seconds = time.time() - t
    log(f"tokenized {len(train_docs)} train files ({train.numel()} tokens) and "
        f"{min(len(val_docs), max_val_files)} held-out files ({val.numel()} tokens) in "
        f"{seconds:.0f} s")
    return train, val, {"train_files": len(train_docs), "train_tokens": train.numel(),
                        "heldout_files": min(len(val_docs), max_val_files),
                        "heldout_tokens": val.numel(), "tokenize_seconds": round(seconds, 1)}


@torch.no_grad()
def generate(target, prompts, new_tokens, temperatures, gen):
    """Continues each row of prompts [B, P] by new_tokens with a KV cache; row b samples at
    temperatures[b] (0: greedy). Returns [B, P + new_tokens]."""
    cache = ref.TargetCache(target.cfg.num_layers)
    logits, _, _ = target.forward(prompts, cache=cache)
    out = [prompts]
    temps = torch.tensor(temperatures, device=prompts.device, dtype=torch.float32)
    sample = bool((temps > 0).any())
    last = logits[:, -1].float()
    for _ in range(new_tokens):
        nxt = last.argmax(-1)
        if sample:  # `gen` lives on the device of `prompts`
            probs = torch.softmax(last / temps.clamp(min=1e-6).unsqueeze(1), dim=-1)
            sampled = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            nxt = torch.where(temps > 0, sampled, nxt)
        nxt = nxt.unsqueeze(1)
        out.append(nxt)
        logits, _, _ = target.forward(nxt, cache=cache)
        last = logits[:, -1].float()
    return torch.cat(out, dim=1)


def windows(stream, n, length, gen):
    """n windows of `length` tokens at random offsets of stream, on its device: [n, length].
    `gen` is a CPU generator, so the offsets are the same on any device."""
    starts = torch.randint(0, stream.numel() - length - 1, (n,), generator=gen)
    starts = starts.to(stream.device)
    return stream[starts.unsqueeze(1) + torch.arange(length, device=stream.device)]


class GeneratedPool:
    """The target's own continuations of training prompts, generated `size` rows at a time and
    handed out a few rows per step. A generation call is gen_len sequential target passes of
    this small target whatever its row count, which on a GPU are bound by kernel launches rather
    than by rows, so one large call serving several steps costs less than one small call a step
    (the run's log and summary give the calls' time)."""

    def __init__(self, target, train, size, prompt_len, gen_len, greedy_share, gen, sample_gen,
                 sync):
        self.target, self.train, self.size = target, train, size
        self.prompt_len, self.gen_len, self.greedy_share = prompt_len, gen_len, greedy_share
        self.gen, self.sample_gen, self.sync = gen, sample_gen, sync
        self.rows, self.next, self.calls, self.seconds = None, 0, 0, 0.0

    def refill(self):
        # Waiting for the device around a call makes `seconds` the generation's own time; calls
        # are a few seconds apart, so the waits cost little.
        self.sync()
        t = time.time()
        prompts = windows(self.train, self.size, self.prompt_len, self.gen)
        temps = [0.0 if random.random() < self.greedy_share else 0.8 for _ in range(self.size)]
        self.rows = generate(self.target, prompts, self.gen_len, temps, self.sample_gen)
        self.next = 0
        self.calls += 1
        self.sync()
        self.seconds += time.time() - t

    def take(self, n):
        """n generated rows [n, prompt_len + gen_len], refilling as needed."""
        parts = []
        while n > 0:
            if self.rows is None or self.next >= self.rows.shape[0]:
                self.refill()
            k = min(n, self.rows.shape[0] - self.next)
            parts.append(self.rows[self.next:self.next + k])
            self.next += k
            n -= k
        return torch.cat(parts) if len(parts) > 1 else parts[0]


@torch.no_grad()
def target_pass(target, seqs, taps, draft_ids, t2d):
    """One target pass over seqs [B, L]: the taps [B, L, 3 Ht] and, per position k (the
    distribution of token k + 1), the target's distribution over the draft vocabulary
    [B, L, Vd] fp32, its argmax over the whole vocabulary [B, L] and whether that argmax is in the
    draft vocabulary [B, L] bool. Computed once here rather than once per unrolled step."""
    tlogits, states, _ = target.forward(seqs, taps=taps)
    feats = torch.cat([states[t] for t in taps], dim=-1)
    want = tlogits.argmax(-1)
    p = torch.softmax(tlogits[..., draft_ids].float(), dim=-1)
    return feats, p, want, t2d[want]


# ------------------------------------------------------------------------------------------------
# the training-time test
# ------------------------------------------------------------------------------------------------

def ttt_forward(head, feats, tokens, depth):
    """Unrolls the head over every position of a batch. feats: [B, L, 3 Ht] target taps;
    tokens: [B, L]. Query j of step i is the draft node at depth i after the real pairs 0..j: it
    pairs the token x[j+1+i] with the previous step's output at j, sits at position j + i and
    attends to the step-0 keys of positions <= j and to its own keys at steps 1..i. Returns the
    outputs of each step, [B, L - 1, H] each (rows j > L - 2 - i have no token and are padding)."""
    b, length = tokens.shape
    t = length - 1
    device = tokens.device
    hidden = head.fc(feats[:, :t])
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    kv0 = []  # step 0's keys and values, repeated over the query groups, in the work dtype
    diag_k, diag_v = [], []  # each later step's, likewise
    outs = []
    pad = torch.zeros(b, depth, dtype=tokens.dtype, device=device)
    padded = torch.cat((tokens, pad), dim=1)
    for i in range(depth):
        tok = padded[:, 1 + i:1 + i + t]
        positions = (torch.arange(t, device=device) + i).unsqueeze(0).expand(b, t)

        def attend(q, k, v, i=i):
            group = q.shape[2] // k.shape[2]
            work = torch.float32 if q.dtype != torch.float64 else torch.float64
            kr = k.repeat_interleave(group, dim=2).to(work)
            vr = v.repeat_interleave(group, dim=2).to(work)
            if i == 0:
                kv0.extend((kr, vr))
            else:
                diag_k.append(kr)
                diag_v.append(vr)
            k0, v0 = kv0
            qf = q.to(work)
            scale = 1.0 / math.sqrt(q.shape[-1])
            s0 = torch.einsum("bthd,bshd->bhts", qf, k0) * scale
            s0 = s0.masked_fill(~causal, float("-inf"))
            ds = [(qf * dk).sum(-1).transpose(1, 2).unsqueeze(-1) * scale
                  for dk in diag_k]  # [B, h, T, 1] each
            p = torch.softmax(torch.cat([s0] + ds, dim=-1), dim=-1)
            o = torch.einsum("bhts,bshd->bthd", p[..., :t], v0)
            for s, dv in enumerate(diag_v):
                o = o + p[..., t + s].transpose(1, 2).unsqueeze(-1) * dv
            return o.to(q.dtype).reshape(b, t, -1)

        out = head(tok, hidden, positions, attend, fused=True)
        outs.append(out)
        hidden = out
    return outs


def ttt_loss(head, outs, p, want, in_draft, decay, with_stats=False):
    """Soft cross-entropy of each step against the target's distribution over the draft
    vocabulary (positions whose target argmax is outside it are skipped, as in EAGLE-3), weighted
    decay^i. p, want, in_draft: target_pass's, [B, L, Vd], [B, L], [B, L] (row k: token k + 1).
    Returns (loss, [depth, 2] tensor of each step's loss and top-1 accuracy, or None): the stats
    stay on the device, so steps that log nothing never wait for the GPU."""
    t = p.shape[1] - 1
    total = 0.0
    stats = []
    for i, out in enumerate(outs):
        n = t - i  # queries with a token and a target
        logits = head.logits(out[:, :n]).float()
        logq = torch.log_softmax(logits, dim=-1)
        ce = -(p[:, 1 + i:1 + i + n] * logq).sum(-1)
        mask = in_draft[:, 1 + i:1 + i + n].float()
        count = mask.sum().clamp(min=1.0)
        loss = (ce * mask).sum() / count
        total = total + (decay ** i) * loss
        if with_stats:
            with torch.no_grad():
                hit = (head.to_target(logits.argmax(-1)) == want[:, 1 + i:1 + i + n]).float()
                stats.append(torch.stack((loss.detach(), (hit * mask).sum() / count)))
    return total, (torch.stack(stats) if with_stats else None)


# ------------------------------------------------------------------------------------------------
# evaluation: speculative decoding simulated on held-out greedy continuations
# ------------------------------------------------------------------------------------------------

class TreeNode:
    __slots__ = ("token", "parent", "logprob", "depth", "out")

    def __init__(self, token, parent, logprob, depth):
        self.token, self.parent, self.logprob, self.depth = token, parent, logprob, depth
        self.out = None


def better(nodes, a, b):
    """specd's drafter order (engine/draft/draft_model_drafter.cc): cumulative log-probability, then
    shallower, then creation order."""
    na, nb = nodes[a], nodes[b]
    if na.logprob != nb.logprob:
        return na.logprob > nb.logprob
    if na.depth != nb.depth:
        return na.depth < nb.depth
    return a < b


def rank_key(nodes):
    return lambda i: (-nodes[i].logprob, nodes[i].depth, i)


def tree_step(root_logits, expand, tokens, v, depth, top_k, max_nodes, to_target):
    """One simulated target step from committed position v: drafts a tree as specd's
    DraftModelDrafter builds it (children of the root from root_logits [V_draft]; at each level
    the best top_k nodes of the level are expanded, unless max_nodes - 1 nodes already rank ahead;
    `expand(nodes, frontier, level)` returns the frontier nodes' logits [len(frontier), V_draft];
    the best max_nodes nodes are kept) and accepts the longest path that tokens[v + 1:] (the
    target's greedy continuation) follows. Returns the number of accepted draft tokens."""
    length = tokens.numel()
    nodes = []

    def children(parent, row_logits):
        d = 0 if parent < 0 else nodes[parent].depth + 1
        k = min(top_k, max_nodes - d)
        if k <= 0:
            return
        base = 0.0 if parent < 0 else nodes[parent].logprob
        lp = torch.log_softmax(row_logits.float(), dim=-1)
        top = torch.topk(lp, k)
        for dv, val in zip(top.indices.tolist(), top.values.tolist()):
            nodes.append(TreeNode(to_target[dv], parent, base + val, d))

    children(-1, root_logits)
    for level in range(depth - 1):
        at = sorted([i for i, n in enumerate(nodes) if n.depth == level], key=rank_key(nodes))
        frontier = []
        for i in at[:top_k]:
            ahead = sum(1 for j in range(len(nodes)) if j != i and better(nodes, j, i))
            if ahead < max_nodes - 1:
                frontier.append(i)
        if not frontier:
            break
        logits = expand(nodes, frontier, level)
        for j, i in enumerate(frontier):
            children(i, logits[j])
    chosen_set = set(sorted(range(len(nodes)), key=rank_key(nodes))[:max_nodes])
    # Walk: descend while a child of the current node holds the target's next token.
    a, cur = 0, -1
    while v + 1 + a < length:
        want = int(tokens[v + 1 + a])
        nxt = [i for i in chosen_set if nodes[i].parent == cur and nodes[i].token == want]
        if not nxt:
            break
        cur = nxt[0]
        a += 1
    return a


def run_steps(step, tokens, start):
    """Greedy speculative decoding of tokens[start + 1:] with `step(v)` giving the accepted draft
    tokens at committed position v: (tokens emitted, target steps, accepted draft tokens)."""
    length = tokens.numel()
    emitted = steps = accepted = 0
    v = start
    while v < length - 1:
        a = step(v)
        accepted += a
        emitted += min(a + 1, length - 1 - v)
        steps += 1
        v += a + 1
    return emitted, steps, accepted


@torch.no_grad()
def simulate(head, taps, tokens, start, depth, top_k, max_nodes):
    """Greedy speculative decoding of tokens[start + 1:] (the target's greedy continuation) with
    the head drafting EAGLE-2 trees as specd's DraftModelDrafter builds them. tokens[start] is the
    token the target produced after the prompt; the head holds the pairs up to it. Returns
    (tokens emitted, target steps, accepted draft tokens)."""
    length = tokens.numel()
    cfg = head.cfg
    feats = taps[:length - 1].unsqueeze(0)
    pairs = tokens[1:].unsqueeze(0)
    keys = {}

    def prefix_attend(q, k, v):
        keys["k"], keys["v"] = k[0], v[0]
        mask = torch.ones(k.shape[1], k.shape[1], dtype=torch.bool, device=k.device).tril()
        return ref.attention(q, k, v, mask.unsqueeze(0))

    out0 = head(pairs, feats, torch.arange(length - 1, device=tokens.device).unsqueeze(0),
                prefix_attend)[0]
    kp, vp = keys["k"], keys["v"]
    to_target = (torch.arange(cfg.draft_vocab_size) + head.d2t.cpu()).tolist()

    def step(v):
        scratch_k, scratch_v = [], []
        slot, outs_of = {}, {}  # node -> scratch index, layer output (nodes fed this step)

        def expand(nodes, frontier, level):
            n_old = len(slot)
            toks = torch.tensor([nodes[i].token for i in frontier], device=tokens.device)
            hid = torch.stack([out0[v - 1] if nodes[i].parent < 0 else outs_of[nodes[i].parent]
                               for i in frontier])
            pos = torch.tensor([v + level] * len(frontier), device=tokens.device)
            mask = torch.zeros(len(frontier), v + n_old + len(frontier), dtype=torch.bool,
                               device=tokens.device)
            mask[:, :v] = True
            for j, i in enumerate(frontier):
                slot[i] = n_old + j
                a = nodes[i].parent
                while a >= 0:
                    mask[j, v + slot[a]] = True
                    a = nodes[a].parent
                mask[j, v + n_old + j] = True

            def node_attend(q, k, v_):
                kk = torch.cat([kp[:v].unsqueeze(0)] + scratch_k + [k], dim=1)
                vv = torch.cat([vp[:v].unsqueeze(0)] + scratch_v + [v_], dim=1)
                scratch_k.append(k)
                scratch_v.append(v_)
                return ref.attention(q, kk, vv, mask.unsqueeze(0))

            outs = head(toks.unsqueeze(0), hid.unsqueeze(0), pos.unsqueeze(0), node_attend,
                        fused=True)[0]
            for j, i in enumerate(frontier):
                outs_of[i] = outs[j]
            return head.logits(outs)

        return tree_step(head.logits(out0[v - 1]), expand, tokens, v, depth, top_k, max_nodes,
                         to_target)

    return run_steps(step, tokens, start)


@torch.no_grad()
def simulate_draft_model(draft, tokens, start, depth, top_k, max_nodes):
    """simulate() for a standalone draft model (a LlamaTarget) drafting the same trees: a node's
    distribution is the model's after the committed tokens 0..v and the node's path. One cached
    pass over the whole sequence gives every prefix's K/V (causal), each level one batched pass
    over its frontier's paths."""
    cache = ref.TargetCache(draft.cfg.num_layers)
    ids = tokens.to(draft.device).unsqueeze(0)
    full, _, _ = draft.forward(ids, cache=cache)
    to_target = list(range(draft.cfg.vocab_size))

    def step(v):
        def expand(nodes, frontier, level):
            paths = []
            for i in frontier:
                path, a = [], i
                while a >= 0:
                    path.append(nodes[a].token)
                    a = nodes[a].parent
                paths.append(path[::-1])
            c = ref.TargetCache(draft.cfg.num_layers)
            c.k = [k[:, :v + 1].expand(len(frontier), -1, -1, -1) for k in cache.k]
            c.v = [x[:, :v + 1].expand(len(frontier), -1, -1, -1) for x in cache.v]
            c.length = v + 1
            logits, _, _ = draft.forward(torch.tensor(paths, device=draft.device), cache=c)
            return logits[:, -1]

        return tree_step(full[0, v], expand, tokens, v, depth, top_k, max_nodes, to_target)

    return run_steps(step, tokens, start)


def chain_stats(matches, k):
    """Greedy chain speculation with k draft tokens over one match sequence (True where the
    draft's argmax equals the target's greedy token): (emitted, steps, accepted)."""
    j = steps = emitted = accepted = 0
    n = len(matches)
    while j < n:
        a = 0
        while a < k and j + a < n and matches[j + a]:
            a += 1
        accepted += a
        emitted += min(a + 1, n - j)
        j += a + 1
        steps += 1
    return emitted, steps, accepted


@torch.no_grad()
def heldout_sequences(target, val, n, prompt_len, new_tokens, device):
    """n held-out prompts (evenly spaced windows) continued greedily by the target, cut at EOS."""
    stride = max(prompt_len, (val.numel() - prompt_len - 1) // n)
    starts = [i * stride for i in range(n) if i * stride + prompt_len < val.numel()]
    prompts = torch.stack([val[s:s + prompt_len] for s in starts]).to(device)
    seqs = generate(target, prompts, new_tokens, [0.0] * len(starts), None)
    out = []
    for row in seqs.cpu():
        cont = row[prompt_len:].tolist()
        cut = prompt_len + (cont.index(EOS) + 1 if EOS in cont else len(cont))
        out.append(row[:cut])
    return out


@torch.no_grad()
def evaluate(head, target, seqs, prompt_len, taps, draft=None, depth=7, draft_tree=True):
    """Held-out metrics of a head (and the standalone draft's greedy chains)."""
    res = {"sequences": len(seqs), "prompt_len": prompt_len,
           "continuation_tokens": sum(s.numel() - prompt_len for s in seqs)}
    shapes = {"chain4": (4, 1, 4), "tree_d4_k4_n16": (4, 4, 16)}
    totals = {k: [0, 0, 0] for k in shapes}
    hits = [[0, 0] for _ in range(depth)]
    for s in seqs:
        ids = s.unsqueeze(0).to(target.device)
        logits, states, _ = target.forward(ids, taps=taps)
        feats = torch.cat([states[t] for t in taps], dim=-1).to(torch.float32)
        head_dev = head.fc.weight.device
        tok = s.to(head_dev)
        f = feats[0].to(head_dev)
        for name, (d, k, m) in shapes.items():
            e, st, a = simulate(head, f, tok, prompt_len, d, k, m)
            for j, x in enumerate((e, st, a)):
                totals[name][j] += x
        # Per-depth top-1 agreement of the unrolled head with the target (teacher forcing).
        outs = ttt_forward(head, f.unsqueeze(0), tok.unsqueeze(0), depth)
        z = logits[0].to(head_dev).float()
        for i, out in enumerate(outs):
            n = tok.numel() - 1 - i
            pred = head.to_target(head.logits(out[0, :n]).argmax(-1))
            want = z[1 + i:1 + i + n].argmax(-1)
            sel = slice(max(0, prompt_len - 1 - i), n)  # the continuation only
            hits[i][0] += int((pred[sel] == want[sel]).sum())
            hits[i][1] += int(want[sel].numel())
    for name, (e, st, a) in totals.items():
        d, k, m = shapes[name]
        res[name] = {"tau": round(e / max(st, 1), 3), "steps": st,
                     "accepted_per_step": round(a / max(st, 1), 3)}
    res["top1_agreement_by_step"] = [round(h / max(n, 1), 4) for h, n in hits]
    # Continuation tokens the head can propose at all (the rest are outside its vocabulary).
    cont = torch.cat([s[prompt_len + 1:] for s in seqs]).to(head.t2d.device)
    res["continuation_in_draft_vocab"] = round(float(head.t2d[cont].float().mean()), 4)
    if draft is not None:
        matches = []
        for s in seqs:
            # From the token after the target's first one, as the head is measured.
            dl, _, _ = draft.forward(s.unsqueeze(0).to(draft.device))
            pred = dl[0, prompt_len:-1].argmax(-1).cpu()
            matches.append((pred == s[prompt_len + 1:]).tolist())
        for k in (4,):
            e = st = a = 0
            for ms in matches:
                e1, s1, a1 = chain_stats(ms, k)
                e, st, a = e + e1, st + s1, a + a1
            res[f"draft_model_chain{k}"] = {"tau": round(e / max(st, 1), 3), "steps": st}
        if draft_tree:
            # The same trees as the head's, drafted by the standalone model (what the router
            # serves it with), on the same tokens.
            e = st = a = 0
            for s in seqs:
                e1, s1, a1 = simulate_draft_model(draft, s, prompt_len, 4, 4, 16)
                e, st, a = e + e1, st + s1, a + a1
            res["draft_model_tree_d4_k4_n16"] = {"tau": round(e / max(st, 1), 3), "steps": st,
                                                 "accepted_per_step": round(a / max(st, 1), 3)}
    return res


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------

def head_config(target, taps, draft_vocab):
    c = target.cfg
    return ref.HeadConfig(kind="eagle3", vocab_size=c.vocab_size, draft_vocab_size=draft_vocab,
                          hidden_size=c.hidden_size, target_hidden_size=c.hidden_size,
                          intermediate_size=c.intermediate_size, num_heads=c.num_heads,
                          num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                          rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                          rope_scaling=c.rope_scaling,
                          max_position_embeddings=c.max_position_embeddings, taps=taps)


def save_head(head, out_dir, summary):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(head.cfg.to_json("bfloat16"), f, indent=2)
        f.write("\n")
    state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach())
             for k, v in head.state_dict().items()}
    safetensors_io.save(os.path.join(out_dir, "model.safetensors"), state,
                        metadata={"format": "pt"})
    with open(os.path.join(out_dir, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")


def grow_draft_vocab(head, target, counts, size):
    """A copy of `head` whose draft vocabulary adds the most frequent training tokens it lacks, up
    to `size`: every trained weight kept, the new LM head rows from the target's LM head (as a
    fresh head's rows start)."""
    old_ids = (torch.arange(head.cfg.draft_vocab_size) + head.d2t.cpu()).tolist()
    have = set(old_ids)
    extra = [i for i in torch.argsort(counts, descending=True, stable=True).tolist()
             if i not in have][:size - len(old_ids)]
    ids = sorted(old_ids + extra)
    cfg = head_config(target, head.cfg.taps, size)
    grown = ref.Eagle3Head(cfg, target.embed.float()).to(head.fc.weight.device)
    grown.set_draft_vocab(ids)
    state = {k: v for k, v in head.state_dict().items()
             if k not in ("lm_head.weight", "d2t", "t2d")}
    grown.load_state_dict(state, strict=False)
    old_row = {tid: r for r, tid in enumerate(old_ids)}
    with torch.no_grad():
        for r, tid in enumerate(ids):
            src = (head.lm_head.weight[old_row[tid]] if tid in old_row
                   else target.lm_head[tid].float())
            grown.lm_head.weight[r].copy_(src)
    return grown


def vocab_coverage(counts, seqs, prompt_len, sizes=(1024, 2048, 3072, 4096, 8192)):
    """Share of the training tokens and of the held-out greedy continuations inside the `size`
    most frequent training tokens: the ceiling a draft vocabulary of that size puts on a head's
    top-1 agreement."""
    order = torch.argsort(counts, descending=True, stable=True)
    cont = torch.cat([s[prompt_len + 1:] for s in seqs])
    out = {}
    for n in sizes:
        if n > counts.numel():
            continue
        inside = torch.zeros(counts.numel(), dtype=torch.bool)
        inside[order[:n]] = True
        out[str(n)] = {"train": round(float(counts[order[:n]].sum() / counts.sum()), 4),
                       "continuations": round(float(inside[cont].float().mean()), 4)}
    return out


def table(res, label):
    """The held-out results as a Markdown table (the model card's columns)."""
    top1 = " ".join(f"{a:.2f}" for a in res["top1_agreement_by_step"])
    def tau(key):
        x = res.get(key, {}).get("tau")
        return "-" if x is None else format(x, ".2f")

    return "\n".join([
        f"held-out: {res['sequences']} prompts of {res['prompt_len']} tokens, "
        f"{res['continuation_tokens']} continuation tokens",
        "| head | head chain of 4 | head tree (depth 4, top-k 4, 16 nodes) | "
        "top-1 agreement, steps 1..7 | continuations in draft vocab | pycoder-draft chain of 4 | "
        "pycoder-draft tree |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {label} | {tau('chain4')} | {tau('tree_d4_k4_n16')} | {top1} | "
        f"{res['continuation_in_draft_vocab']:.3f} | {tau('draft_model_chain4')} | "
        f"{tau('draft_model_tree_d4_k4_n16')} |"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "models", "pycoder-target"))
    ap.add_argument("--draft", default=os.path.join(ROOT, "models", "pycoder-draft"),
                    help="standalone draft model evaluated beside the head ('' to skip)")
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "pycoder-eagle3"))
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--minutes", type=float, default=5.0, help="training wall-clock budget")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps too")
    ap.add_argument("--taps", default=DEFAULT_TAPS, help="tap layer inputs (specd's spelling)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft vocabulary size (0: 2048 from scratch, the --init-from head's "
                         "when continuing; larger than that head's grows it)")
    ap.add_argument("--batch", type=int, default=8, help="rows per step")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=128,
                    help="rows are prompt-len + gen-len tokens, text rows too")
    ap.add_argument("--generated-share", type=float, default=1.0,
                    help="share of each step's rows that are the target's own continuations of "
                         "prompts; the rest are windows of the training files' own text, whose "
                         "target features and distributions take one target pass and no "
                         "generation (EAGLE-1's fixed data)")
    ap.add_argument("--gen-batch", type=int, default=0,
                    help="continuations generated per generation call, handed out over the "
                         "following steps (0: --batch)")
    ap.add_argument("--greedy-share", type=float, default=0.5,
                    help="share of continuations decoded greedily (the rest at temperature 0.8)")
    ap.add_argument("--depth", type=int, default=7, help="training-time test steps")
    ap.add_argument("--decay", type=float, default=0.8, help="weight of step i: decay^i")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the head's training forward (falls back to eager if the "
                         "first step fails to compile)")
    ap.add_argument("--profile-steps", type=int, default=3,
                    help="steps (after the first) timed phase by phase, waiting for the device")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-train-chars", type=int, default=4_000_000,
                    help="training files read (characters); they are tokenized up front")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-prompt-len", type=int, default=128)
    ap.add_argument("--eval-new", type=int, default=128)
    ap.add_argument("--max-val-files", type=int, default=200)
    ap.add_argument("--eval-only", action="store_true", help="evaluate the head in --out")
    ap.add_argument("--init-from", default="",
                    help="continue training the head in this folder (its taps and draft "
                         "vocabulary, grown by --draft-vocab; a fresh optimizer and schedule)")
    args = ap.parse_args()
    if not 0.0 <= args.generated_share <= 1.0:
        ap.error("--generated-share must be in [0, 1]")

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    taps = [int(x) for x in args.taps.split(",")]
    log(f"torch {torch.__version__} on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if cuda else f", {args.threads} threads"))

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    # The frozen target: bf16 on a GPU (as it is stored), fp32 on the CPU.
    target = ref.LlamaTarget(args.target, dtype=torch.bfloat16 if cuda else torch.float32,
                             device=device)
    # Evaluation runs in fp32 (specd's CPU numbers); on a GPU the fp32 copy stays small.
    target32 = target if not cuda else ref.LlamaTarget(args.target, torch.float32, device)
    draft = (ref.LlamaTarget(args.draft, torch.float32, device)
             if args.draft and os.path.isdir(args.draft) else None)
    # --eval-only reads no training files: the held-out split does not depend on them.
    train, val, data_info = load_corpus(os.path.join(args.target, "tokenizer.json"),
                                        0 if args.eval_only else args.max_train_chars,
                                        args.max_val_files)
    eval_seqs = heldout_sequences(target32, val, args.eval_prompts, args.eval_prompt_len,
                                  args.eval_new, device)

    if args.eval_only:
        head = ref.load_head(args.out, target32, dtype=torch.float32).to(device)
        res = evaluate(head, target32, eval_seqs, args.eval_prompt_len, head.cfg.taps, draft)
        log(json.dumps(res))
        print(table(res, os.path.basename(os.path.normpath(args.out))), flush=True)
        return

    if args.draft_vocab > target.cfg.vocab_size:
        ap.error(f"--draft-vocab {args.draft_vocab} is larger than the target's vocabulary "
                 f"({target.cfg.vocab_size})")
    counts = torch.bincount(train, minlength=target.cfg.vocab_size)
    coverage_by_size = vocab_coverage(counts, eval_seqs, args.eval_prompt_len)
    log(f"draft vocabulary size -> coverage of training tokens / held-out continuations: "
        f"{json.dumps(coverage_by_size)}")
    previous = None
    if args.init_from:
        head = ref.load_head(args.init_from, target32, dtype=torch.float32).to(device)
        taps = head.cfg.taps
        if args.draft_vocab and args.draft_vocab < head.cfg.draft_vocab_size:
            ap.error(f"--draft-vocab {args.draft_vocab} is smaller than the --init-from head's "
                     f"{head.cfg.draft_vocab_size}")
        if args.draft_vocab > head.cfg.draft_vocab_size:
            log(f"draft vocabulary grown from {head.cfg.draft_vocab_size} to {args.draft_vocab}")
            head = grow_draft_vocab(head, target32, counts, args.draft_vocab)
        draft_ids = (torch.arange(head.cfg.draft_vocab_size) + head.d2t.cpu()).sort().values
        summary_path = os.path.join(args.init_from, "train_summary.json")
        if os.path.exists(summary_path):
            with open(summary_path) as f:
                previous = json.load(f)
            previous.pop("history", None)
        log(f"continuing {args.init_from}")
    else:
        size = args.draft_vocab or 2048
        draft_ids = torch.topk(counts, size).indices.sort().values
        head = ref.Eagle3Head(head_config(target, taps, size),
                              target.embed.float()).to(device)
        head.set_draft_vocab(draft_ids.tolist())
        with torch.no_grad():
            # Start the LM head and final norm from the target's: the head's output then begins
            # in the space the target's own LM head reads.
            head.lm_head.weight.copy_(target.lm_head[draft_ids.to(device)].float())
            head.norm.weight.copy_(target.w["model.norm.weight"].float())
    coverage = float(counts[draft_ids].sum() / counts.sum())
    log(f"draft vocabulary: {draft_ids.numel()} tokens, covering {coverage:.4f} of the "
        f"training tokens")
    draft_ids = draft_ids.to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    decay_p = [p for p in params if p.dim() == 2]
    other_p = [p for p in params if p.dim() != 2]
    # fused: one kernel for the whole update on a GPU (the CPU build of Debian's torch has none).
    opt = torch.optim.AdamW([{"params": decay_p, "weight_decay": args.weight_decay},
                             {"params": other_p, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), **({"fused": True} if cuda else {}))
    n_params = sum(p.numel() for p in params)
    log(f"head: {n_params} parameters, taps {taps}, depth {args.depth}, lr {args.lr}")

    def head_loss(feats, seqs, p, want, in_draft, with_stats):
        outs = ttt_forward(head, feats, seqs, args.depth)
        return ttt_loss(head, outs, p, want, in_draft, args.decay, with_stats)

    compiled = None
    if args.compile:
        if hasattr(torch, "compile"):
            compiled = torch.compile(head_loss)
        else:
            log(f"torch {torch.__version__} has no torch.compile: running eagerly")
    train = train.to(device)
    gen = torch.Generator().manual_seed(args.seed)  # window offsets
    sample_gen = torch.Generator(device=device).manual_seed(args.seed + 1)  # continuations
    n_generated = round(args.generated_share * args.batch)
    pool = GeneratedPool(target, train, args.gen_batch or args.batch, args.prompt_len,
                         args.gen_len, args.greedy_share, gen, sample_gen, sync)
    row_len = args.prompt_len + args.gen_len
    log(f"rows per step: {args.batch - n_generated} of text, {n_generated} generated "
        f"({pool.size} per generation call), {row_len} tokens each")
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                else contextlib.nullcontext())
    # The training-time test's attention products run in fp32 outside autocast: TF32 while
    # training, plain fp32 again for the evaluation (specd's CPU numbers).
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = cuda
    budget = args.minutes * 60.0
    start = time.time()
    step = 0
    seen_tokens = 0
    history, profile = [], []
    while True:
        elapsed = time.time() - start
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 *
                                                             (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        timed = 1 <= step <= args.profile_steps  # step 0 warms up
        marks = []

        def mark(name):
            if timed:
                sync()
                marks.append((name, time.time()))

        mark("start")
        calls = pool.calls
        parts = []
        if n_generated:
            parts.append(pool.take(n_generated))
        mark("generate")
        if n_generated < args.batch:
            parts.append(windows(train, args.batch - n_generated, row_len, gen))
        seqs = torch.cat(parts) if len(parts) > 1 else parts[0]
        feats, p, want, in_draft = target_pass(target, seqs, taps, draft_ids, head.t2d)
        mark("target pass")
        logging = step % args.log_every == 0 or step == 0
        with autocast:
            if compiled is not None:
                try:
                    loss, stats = compiled(feats, seqs, p, want, in_draft, logging)
                except Exception as e:  # noqa: BLE001 (any compile failure: run eagerly)
                    log(f"torch.compile failed ({type(e).__name__}: {e}); running eagerly")
                    compiled = None
            if compiled is None:
                loss, stats = head_loss(feats, seqs, p, want, in_draft, logging)
        mark("head forward")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        mark("backward + optimizer")
        step += 1
        seen_tokens += seqs.numel()
        if timed:
            phases = {b[0]: round(b[1] - a[1], 4) for a, b in zip(marks, marks[1:])}
            phases["generation calls"] = pool.calls - calls
            profile.append(phases)
            log(f"step {step} phases (s): {json.dumps(phases)}")
        if logging:
            st = stats.tolist()
            history.append({"step": step, "seconds": round(time.time() - start, 1),
                            "lr": lr, "loss": round(float(loss), 4),
                            "acc": [round(a, 3) for _, a in st]})
            log(f"step {step} loss {float(loss):.3f} acc by step "
                f"{[round(a, 2) for _, a in st]} lr {lr:.2e} "
                f"({seen_tokens / (time.time() - start):.0f} tokens/s)")
    sync()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    train_s = time.time() - start
    log(f"trained {step} steps, {seen_tokens} tokens ({seen_tokens / train_s:.0f} tokens/s), "
        f"{pool.calls} generation calls taking {pool.seconds:.0f} s, {train_s:.0f} s in all")

    summary = {
        # The folder's last two parts ("models/pycoder-target"): no machine's absolute paths.
        "target": os.path.join(*os.path.normpath(os.path.abspath(args.target)).split(os.sep)[-2:]),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if cuda else ""),
        "torch": torch.__version__, "threads": args.threads if not cuda else None,
        "args": {k: (os.path.basename(os.path.normpath(v)) if k == "init_from" and v else v)
                 for k, v in vars(args).items() if k not in ("out", "target", "draft")},
        "parameters": n_params, "taps": taps, "draft_vocab_coverage": round(coverage, 4),
        "coverage_by_draft_vocab": coverage_by_size,
        "data": data_info, "steps": step, "train_tokens": seen_tokens,
        "generated_rows": pool.calls * pool.size, "generation_calls": pool.calls,
        "generation_seconds": round(pool.seconds, 1),
        "train_seconds": round(train_s, 1), "profile": profile, "history": history,
    }
    if previous is not None:
        summary["previous_stage"] = previous
    save_head(head, args.out, summary)
    # Evaluate the saved head as specd will read it: bf16 weights from the file, fp32 math.
    saved = ref.load_head(args.out, target32, dtype=torch.float32).to(device)
    t = time.time()
    summary["heldout"] = evaluate(saved, target32, eval_seqs, args.eval_prompt_len, taps, draft,
                                  args.depth)
    summary["eval_seconds"] = round(time.time() - t, 1)
    summary["total_seconds"] = round(time.time() - T0, 1)
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    log(f"held-out: {json.dumps(summary['heldout'])}")
    print(table(summary["heldout"], os.path.basename(os.path.normpath(args.out))), flush=True)


if __name__ == "__main__":
    main()
