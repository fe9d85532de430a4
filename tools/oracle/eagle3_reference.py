"""PyTorch reference of EAGLE draft heads (EAGLE-3 and EAGLE-1/2) and of the Llama target that
feeds them: the oracle of specd's head forward (tools/oracle/make_eagle_fixtures.py) and the model
the head trainer optimises (tools/eagle3/train_head.py).

Written from the EAGLE papers (Li et al., "EAGLE", ICML 2024; "EAGLE-2", EMNLP 2024; "EAGLE-3",
2025) and from reading the public implementations (SafeAILab/EAGLE, SGLang's and vLLM's
llama_eagle3.py, SpecForge); no code is taken from them.

specd's conventions (docs/eagle.md states them for users):

* Taps. A tap is named by the target decoder layer whose INPUT it is: tap L is the residual stream
  entering layer L (tap 0 is the token embeddings, tap N the last layer's output before the final
  norm). EAGLE-3 concatenates three taps in increasing L; the default is 2, N // 2, N - 3, the
  layers EAGLE, SGLang and vLLM capture by default. The config key
  `eagle_aux_hidden_state_layer_ids` (under `eagle_config`, written by SpecForge and read by SGLang)
  names layer OUTPUTS, so id i is tap i + 1; specd's own key `specd_tap_layer_inputs` names taps
  directly.
  EAGLE-1/2 heads take one feature: the target's last hidden state after its final norm.
* Head positions. The head's KV position p holds the pair (target feature at position p, token at
  position p + 1). A prefill of n prompt tokens t_0..t_{n-1} whose target step produced t_n feeds
  the pairs (f_0, t_1) .. (f_{n-1}, t_n) at positions 0..n-1; the head's output at position n - 1
  scores t_{n+1}. A draft node at tree depth d (d = 0 for the children of the last committed pair)
  sits at position n + d, takes its parent's output hidden state (for d = 0, the output at
  position n - 1) paired with its own token, and attends to the committed pairs and its ancestors.
* RoPE is computed from inv_freq for any position (no table), so a head serves the target's whole
  context, not only the `max_position_embeddings` (2048 in the published 8B head) of its config.
  The angle is fp32(position) * fp32(inv_freq) in fp32, as transformers and specd's kernels compute
  it; inv_freq is the double-precision value rounded to fp32 (specd's RopeInvFreq).

Everything here works in any dtype; the oracle runs it in float64 (modules `.double()`).
"""

import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from torch import nn

import safetensors_io

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


# ------------------------------------------------------------------------------------------------
# shared math
# ------------------------------------------------------------------------------------------------

def rope_inv_freq(head_dim, theta, scaling=None):
    """[head_dim / 2] fp32, as specd's RopeInvFreq: double precision rounded to fp32, then the
    llama3 or linear scaling of a rope_scaling / rope_parameters dict (None, "default": none)."""
    inv = [float(torch.tensor(1.0 / theta ** (2.0 * i / head_dim), dtype=torch.float32))
           for i in range(head_dim // 2)]
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    if kind == "linear":
        inv = [float(torch.tensor(f / scaling["factor"], dtype=torch.float32)) for f in inv]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        orig = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = orig / low, orig / high
        out = []
        for f in inv:
            wavelen = 2.0 * math.pi / f
            if wavelen > low_wavelen:
                f = f / factor
            elif wavelen >= high_wavelen:
                smooth = (orig / wavelen - low) / (high - low)
                f = (1.0 - smooth) * f / factor + smooth * f
            out.append(float(torch.tensor(f, dtype=torch.float32)))
        inv = out
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3)")
    return torch.tensor(inv, dtype=torch.float32)


def rope_cos_sin(positions, inv_freq, dtype):
    """positions: int tensor [...]; returns cos, sin [..., head_dim / 2] in `dtype`, taken in at
    least fp32 of fp32 angles (a bf16 angle would be off by whole radians at position 300)."""
    angle = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return angle.to(work).cos().to(dtype), angle.to(work).sin().to(dtype)


def apply_rope(x, cos, sin):
    """x: [..., T, heads, head_dim] (rotate-half layout); cos, sin: [..., T, head_dim / 2]."""
    half = x.shape[-1] // 2
    c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rms_norm(x, weight, eps):
    """Hugging Face Llama's RMSNorm: statistics in at least fp32, scaled in the input dtype."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(work)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def attention(q, k, v, mask):
    """q: [B, T, h, d]; k, v: [B, S, kvh, d]; mask: bool [B or 1, T, S] (True: attend) or None
    (all keys). Returns [B, T, h * d]. Softmax in at least fp32."""
    b, t, h, d = q.shape
    group = h // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("bthd,bshd->bhts", q.to(work), k.to(work)) / math.sqrt(d)
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhts,bshd->bthd", p, v.to(work)).to(q.dtype)
    return out.reshape(b, t, h * d)


# ------------------------------------------------------------------------------------------------
# the target (Llama family: Llama 2/3/3.1, Mistral within its window)
# ------------------------------------------------------------------------------------------------

@dataclass
class TargetConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    tie_word_embeddings: bool
    max_position_embeddings: int

    @staticmethod
    def from_json(c):
        if c.get("model_type") not in ("llama", "mistral"):
            raise ValueError(f"model_type {c.get('model_type')!r}: the reference target is Llama")
        if c.get("attention_bias") or c.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias are not supported by the reference target")
        rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
        heads = c["num_attention_heads"]
        return TargetConfig(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=rope if rope.get("rope_type", rope.get("type")) not in (None, "default")
            else None,
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            max_position_embeddings=c.get("max_position_embeddings", 2048))


class TargetCache:
    """K/V of every layer for a batch of equal-length sequences ([B, S, kvh, d] each)."""

    def __init__(self, num_layers):
        self.k = [None] * num_layers
        self.v = [None] * num_layers
        self.length = 0


class LlamaTarget:
    """The frozen target: a plain-torch Llama forward over Hugging Face weights (no transformers).
    tests/tools/test_eagle_oracle.py checks it against transformers' logits in
    tests/fixtures/models/{llama31,mistral}."""

    def __init__(self, folder, dtype=torch.float64, device="cpu", tensors=None):
        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = TargetConfig.from_json(json.load(f))
        raw = tensors if tensors is not None else safetensors_io.load_folder(folder)
        self.w = {k: t.to(device=device, dtype=dtype) for k, t in raw.items()}
        self.dtype, self.device = dtype, device
        c = self.cfg
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(device)
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.embed if c.tie_word_embeddings else self.w["lm_head.weight"]

    def forward(self, ids, cache=None, taps=(), want_final=False):
        """ids: int64 [B, T], continuing `cache` (None: a fresh causal prefill). Returns
        (logits [B, T, V], {tap: residual stream entering layer tap, [B, T, H]}, the final
        normed hidden state [B, T, H] when want_final, else None)."""
        c, w = self.cfg, self.w
        b, t = ids.shape
        start = cache.length if cache is not None else 0
        pos = torch.arange(start, start + t, device=ids.device)
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.dtype)
        mask = None
        if t > 1:
            keys = torch.arange(start + t, device=ids.device)
            mask = (keys.unsqueeze(0) <= pos.unsqueeze(1)).unsqueeze(0)
        x = self.embed[ids]
        states = {}
        for layer in range(c.num_layers):
            if layer in taps:
                states[layer] = x
            p = f"model.layers.{layer}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(b, t, c.num_heads, c.head_dim)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(b, t, c.num_kv_heads, c.head_dim)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(b, t, c.num_kv_heads, c.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if cache is not None:
                if cache.k[layer] is not None:
                    k = torch.cat((cache.k[layer], k), dim=1)
                    v = torch.cat((cache.v[layer], v), dim=1)
                cache.k[layer], cache.v[layer] = k, v
            a = attention(q, k, v, mask)
            x = x + a @ w[p + "self_attn.o_proj.weight"].T
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
        if c.num_layers in taps:
            states[c.num_layers] = x
        if cache is not None:
            cache.length += t
        final = rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)
        return final @ self.lm_head.T, states, (final if want_final else None)


def default_taps(num_layers):
    return [2, num_layers // 2, num_layers - 3]


# ------------------------------------------------------------------------------------------------
# heads
# ------------------------------------------------------------------------------------------------

@dataclass
class HeadConfig:
    kind: str  # "eagle3" or "eagle1"
    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    taps: List[int] = field(default_factory=list)  # tap layer inputs (EAGLE-3)
    norm_before_residual: bool = False
    fc_bias: bool = True  # EAGLE-1/2

    def to_json(self, dtype_name="float32"):
        c = {
            "architectures": ["LlamaForCausalLMEagle3" if self.kind == "eagle3"
                              else "LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "torch_dtype": dtype_name,
        }
        if self.rope_scaling:
            c["rope_scaling"] = self.rope_scaling
        if self.kind == "eagle3":
            c["draft_vocab_size"] = self.draft_vocab_size
            if self.target_hidden_size != self.hidden_size:
                c["target_hidden_size"] = self.target_hidden_size
            # Both spellings (docs/eagle.md): SGLang/SpecForge's layer outputs, specd's inputs.
            c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in self.taps],
                                 "use_aux_hidden_state": True}
            c["specd_tap_layer_inputs"] = list(self.taps)
            if self.norm_before_residual:
                c["norm_before_residual"] = True
        else:
            c["bias"] = self.fc_bias
        return c


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """q/k/v/o projections; `attend(q, k, v)` (RoPE applied) supplies the keys and the mask."""

    def __init__(self, cfg, in_features):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(in_features, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attend):
        c = self.cfg
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(*shape, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(*shape, c.num_kv_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(attend(q, k, v))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """EAGLE-3's one decoder layer: attention reads concat(input_layernorm(embedding),
    hidden_norm(hidden)) (2H), and the residual stream starts from the un-normed hidden input
    (or the normed one with norm_before_residual, a flag some checkpoints carry)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, emb, hidden, cos, sin, attend):
        normed = self.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(emb), normed), dim=-1)
        h = residual + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """Parameters and buffers named as the published checkpoints (state_dict() is the file);
    the embedding is the target's and is not saved."""

    def __init__(self, cfg, embed):
        super().__init__()
        assert cfg.kind == "eagle3"
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool)
                             if cfg.draft_vocab_size == cfg.vocab_size
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                                       cfg.rope_scaling), persistent=False)

    def set_draft_vocab(self, target_ids):
        """The draft vocabulary: sorted target ids (len draft_vocab_size); fills d2t and t2d."""
        ids = torch.as_tensor(sorted(target_ids), dtype=torch.int64, device=self.d2t.device)
        assert len(ids) == self.cfg.draft_vocab_size
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    def forward(self, tokens, inputs, positions, attend, fused=False):
        """tokens: [..., T] target ids; inputs: [..., T, 3 * target H] taps (fused=False) or
        [..., T, H] (fc already applied, or the head's own output); positions: [..., T].
        Returns the layer output [..., T, H] (before the final norm: what deeper steps take)."""
        hidden = inputs if fused else self.fc(inputs)
        cos, sin = rope_cos_sin(positions, self.inv_freq, hidden.dtype)
        emb = self.embed[tokens].to(hidden.dtype)
        return self.midlayer(emb, hidden, cos, sin, attend)

    def logits(self, out):
        """Draft-vocabulary logits of layer outputs."""
        return self.lm_head(self.norm(out))


class Eagle1Layer(nn.Module):
    """A Llama decoder layer over H; the first one has no input norm (EAGLE-1/2)."""

    def __init__(self, cfg, index):
        super().__init__()
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if index > 0 else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attend):
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle1Head(nn.Module):
    """EAGLE-1/2: fc(concat(embedding, feature)) with bias, then num_layers decoder layers; the
    feature is the target's final normed hidden state, the logits the target's LM head of the
    output (no norm)."""

    def __init__(self, cfg, embed, lm_head):
        super().__init__()
        assert cfg.kind == "eagle1"
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([Eagle1Layer(cfg, i) for i in range(cfg.num_layers)])
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("target_lm_head", lm_head, persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                                       cfg.rope_scaling), persistent=False)

    def to_target(self, draft_ids):
        return draft_ids

    def forward(self, tokens, inputs, positions, attend, fused=False):
        """`attend` is called as attend(layer, q, k, v). `fused` has no meaning here: the
        feature and the head's own output are both H wide and both go through fc."""
        emb = self.embed[tokens].to(inputs.dtype)
        x = self.fc(torch.cat((emb, inputs), dim=-1))
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, lambda q, k, v, i=i: attend(i, q, k, v))
        return x

    def logits(self, out):
        return out @ self.target_lm_head.T.to(out.dtype)


# ------------------------------------------------------------------------------------------------
# the head's per-sequence KV: a committed chain plus a scratch tree (specd's KV model)
# ------------------------------------------------------------------------------------------------

class HeadSequence:
    """One sequence's head KV for every head layer, mirroring specd's Backend: feed() appends
    scratch nodes (each attends to the committed pairs, its scratch ancestors and itself, at
    position committed + depth); commit(path) keeps one root-to-node path and drops the rest."""

    def __init__(self, head):
        self.head = head
        layers = 1 if head.cfg.kind == "eagle3" else head.cfg.num_layers
        self.k = [None] * layers  # committed + scratch keys [1, S, kvh, d]
        self.v = [None] * layers
        self.committed = 0
        self.parents = []  # scratch parents (-1: the committed end)
        self.depths = []

    def _ancestors(self, node):
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out

    def feed(self, tokens, parents, inputs, fused=False):
        """tokens: list of target ids; parents: scratch indices (-1: child of the committed end;
        earlier nodes of this call count); inputs: [T, width]. Returns outputs [T, H]."""
        base = len(self.parents)
        for j, p in enumerate(parents):
            assert -1 <= p < base + j
            self.parents.append(p)
            self.depths.append(0 if p < 0 else self.depths[p] + 1)
        n_new = len(tokens)
        total = self.committed + base + n_new
        mask = torch.zeros(n_new, total, dtype=torch.bool)
        mask[:, :self.committed] = True
        for j in range(n_new):
            for a in self._ancestors(base + j):
                mask[j, self.committed + a] = True
        positions = torch.tensor([self.committed + d for d in self.depths[base:]])

        def attend_layer(layer, q, k, v):
            if self.k[layer] is not None:
                k = torch.cat((self.k[layer], k), dim=1)
                v = torch.cat((self.v[layer], v), dim=1)
            self.k[layer], self.v[layer] = k, v
            return attention(q, k, v, mask.unsqueeze(0))

        tok = torch.tensor(tokens, dtype=torch.int64).unsqueeze(0)
        x = inputs.unsqueeze(0)
        if self.head.cfg.kind == "eagle3":
            out = self.head(tok, x, positions.unsqueeze(0),
                            lambda q, k, v: attend_layer(0, q, k, v), fused=fused)
        else:
            out = self.head(tok, x, positions.unsqueeze(0), attend_layer)
        return out[0]

    def commit(self, path):
        """Keeps scratch nodes `path` (path[0] a child of the committed end, each later one a
        child of the one before) as committed pairs; drops every other scratch node."""
        for j, node in enumerate(path):
            assert self.parents[node] == (path[j - 1] if j else -1)
        keep = list(range(self.committed)) + [self.committed + n for n in path]
        for layer in range(len(self.k)):
            if self.k[layer] is not None:
                self.k[layer] = self.k[layer][:, keep]
                self.v[layer] = self.v[layer][:, keep]
        self.committed += len(path)
        self.parents, self.depths = [], []


def load_head(head_folder, target, dtype=torch.float64):
    """Reads a head folder in the published layout against `target` (a LlamaTarget), as specd's
    C++ loader reads it (same key names, same tap spellings)."""
    with open(os.path.join(head_folder, "config.json")) as f:
        c = json.load(f)
    t = safetensors_io.load_folder(head_folder)
    tc = target.cfg
    heads = c["num_attention_heads"]
    common = dict(vocab_size=c.get("vocab_size", tc.vocab_size), hidden_size=c["hidden_size"],
                  target_hidden_size=c.get("target_hidden_size", c["hidden_size"]),
                  intermediate_size=c["intermediate_size"], num_heads=heads,
                  num_kv_heads=c.get("num_key_value_heads") or heads,
                  head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                  num_layers=c.get("num_hidden_layers", 1),
                  rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                  rope_theta=c.get("rope_theta", 10000.0), rope_scaling=c.get("rope_scaling"),
                  max_position_embeddings=c.get("max_position_embeddings", 2048))
    embed = t.get("embed_tokens.weight", target.embed).to(dtype)
    if any(a in EAGLE3_ARCHITECTURES for a in c.get("architectures", [])):
        ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        taps = c.get("specd_tap_layer_inputs")
        if taps is None:
            taps = [i + 1 for i in ids] if ids is not None else default_taps(tc.num_layers)
        cfg = HeadConfig(kind="eagle3", draft_vocab_size=c.get("draft_vocab_size",
                                                               common["vocab_size"]),
                         taps=sorted(taps),
                         norm_before_residual=c.get("norm_before_residual", False), **common)
        head = Eagle3Head(cfg, embed)
    else:
        cfg = HeadConfig(kind="eagle1", draft_vocab_size=common["vocab_size"],
                         fc_bias="fc.bias" in t, **common)
        head = Eagle1Head(cfg, embed, target.lm_head.to(dtype))
    missing, unexpected = head.load_state_dict({k: v for k, v in t.items()
                                                if k != "embed_tokens.weight"}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{head_folder}: missing {missing}, unexpected {unexpected}")
    return head.to(dtype)
