"""Tests of the EAGLE oracle and head tools (tools/oracle, tools/eagle3), on the CPU with Debian's
python3-torch:

* the reference Llama target against transformers' logits (tests/fixtures/models);
* its KV-cached forward against the full one;
* tests/fixtures/eagle3 against the reference as it is now (the fixtures are its outputs);
* the trainer's unrolled training-time-test forward against the reference's tree forward (what
  specd serves), its simulated chain speculation against a plain step-by-step one, and the draft
  model's simulated chain against chain_stats;
* the pure-Python BPE against the `tokenizers` library's own encodings;
* convert_eagle_bin.py on a .bin written by torch.save;
* the CUDA head's bf16 roundings, emulated (eagle_bf16_emulate.py), inside the GPU test's bound;
* tests/fixtures/eagle1_pycoder (make_eagle1_serving_head.py) read by the reference as specd reads
  it, its chain over the target's final norm output proposing the target's greedy tokens.

  /usr/bin/python3 -m pytest -q tests/tools/test_eagle_oracle.py
"""

import json
import os
import sys
import tempfile

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools", "oracle"))
sys.path.insert(0, os.path.join(ROOT, "tools", "eagle3"))
import bpe_tokenizer  # noqa: E402
import convert_eagle_bin  # noqa: E402
import eagle_bf16_emulate  # noqa: E402
import eagle3_reference as ref  # noqa: E402
import make_eagle_fixtures  # noqa: E402
import safetensors_io  # noqa: E402
import train_head  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
EAGLE = os.path.join(FIXTURES, "eagle3")

torch.set_num_threads(1)


def test_reference_target_matches_transformers():
    assert make_eagle_fixtures.check_target_against_transformers(FIXTURES) < 1e-5


def test_cached_forward_matches_the_full_forward():
    target = ref.LlamaTarget(os.path.join(EAGLE, "target"))
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    full, states, _ = target.forward(ids, taps=(1, 8))
    cache = ref.TargetCache(target.cfg.num_layers)
    first, s0, _ = target.forward(ids[:, :6], cache=cache, taps=(1, 8))
    rows = [first]
    tap_rows = [s0[8]]
    for t in range(6, 11):
        step, s, _ = target.forward(ids[:, t:t + 1], cache=cache, taps=(1, 8))
        rows.append(step)
        tap_rows.append(s[8])
    assert torch.allclose(torch.cat(rows, dim=1), full, rtol=0, atol=1e-10)
    assert torch.allclose(torch.cat(tap_rows, dim=1), states[8], rtol=0, atol=1e-10)


def oracle_tensors():
    return safetensors_io.load(os.path.join(EAGLE, "oracle.safetensors"))


@pytest.mark.parametrize("name", ["eagle3", "eagle3_nbr", "eagle1"])
def test_fixtures_are_the_reference_outputs(name):
    with open(os.path.join(EAGLE, "oracle.json")) as f:
        oracle = json.load(f)
    stored = oracle_tensors()
    target = ref.LlamaTarget(os.path.join(EAGLE, "target"))
    ids = oracle["ids"]
    logits, states, final = target.forward(torch.tensor([ids]), taps=oracle["taps"],
                                           want_final=True)
    taps = torch.cat([states[t][0] for t in oracle["taps"]], dim=-1).float()
    assert torch.equal(taps, stored["taps"])
    assert torch.equal(final[0].float(), stored["final_hidden"])
    scenario = oracle["scenarios"][name]
    head = ref.load_head(os.path.join(EAGLE, scenario["head"]), target)
    features = stored[scenario["features"]].double()
    tensors = {}
    with torch.no_grad():
        calls = make_eagle_fixtures.run_scenario(head, name, features, ids, tensors)
    assert calls == scenario["calls"]
    for key, value in tensors.items():
        assert torch.equal(value, stored[key]), key


def random_head(target, seed, taps=(1, 4, 6), draft_vocab=64):
    cfg = ref.HeadConfig(kind="eagle3", vocab_size=256, draft_vocab_size=draft_vocab,
                         hidden_size=32, target_hidden_size=32, intermediate_size=64,
                         num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=5000.0,
                         taps=list(taps))
    head = ref.Eagle3Head(cfg, target.embed).double()
    gen = torch.Generator().manual_seed(seed)
    make_eagle_fixtures.randomise(gen, head)
    head.set_draft_vocab(torch.randperm(256, generator=gen)[:draft_vocab].tolist())
    return head


def test_training_unroll_is_the_tree_forward():
    """Step i of the unrolled head at query j is the draft node at tree depth i - 1 below the
    real pairs 0..j, its token x[j+1+i], its input the output of its parent."""
    target = ref.LlamaTarget(os.path.join(EAGLE, "target"))
    head = random_head(target, 5)
    gen = torch.Generator().manual_seed(6)
    length = 10
    tokens = torch.randint(0, 256, (length,), generator=gen)
    feats = torch.randn(length, 96, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        outs = train_head.ttt_forward(head, feats.unsqueeze(0), tokens.unsqueeze(0), 4)
        for j in (0, 3, 5):
            seq = ref.HeadSequence(head)
            chain = seq.feed(tokens[1:j + 2].tolist(), list(range(-1, j)), feats[:j + 1])
            assert torch.allclose(chain[j], outs[0][0, j], atol=1e-12)
            seq.commit(list(range(j + 1)))
            hidden, parent = chain[j], -1
            for i in range(1, 4):
                if j + 1 + i >= length:
                    break
                out = seq.feed([int(tokens[j + 1 + i])], [parent], hidden.unsqueeze(0),
                               fused=True)
                assert torch.allclose(out[0], outs[i][0, j], atol=1e-12), (j, i)
                hidden, parent = out[0], i - 1


def test_simulated_chain_matches_a_step_by_step_chain():
    """With top-k 1 and 4 nodes the simulated tree is a greedy chain of 4; a continuation made of
    the head's own greedy drafts (with a wrong token now and then) gives real acceptances."""
    target = ref.LlamaTarget(os.path.join(EAGLE, "target"))
    head = random_head(target, 7, draft_vocab=256)  # full vocabulary
    gen = torch.Generator().manual_seed(8)
    prompt = 6
    length = 30
    feats = torch.randn(length, 96, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 256, (prompt + 1,), generator=gen).tolist()
    with torch.no_grad():
        while len(tokens) < length:  # the head's greedy next token after the real pairs
            seq = ref.HeadSequence(head)
            n = len(tokens) - 1
            out = seq.feed(tokens[1:], list(range(-1, n - 1)), feats[:n])
            nxt = int(head.to_target(head.logits(out[-1]).argmax()))
            if len(tokens) % 5 == 0:
                nxt = (nxt + 1) % 256
            tokens.append(nxt)
        tokens = torch.tensor(tokens)
        got = train_head.simulate(head, feats, tokens, prompt, 4, 1, 4)
        # Step by step: draft 4 tokens greedily from the committed pairs, accept the matching
        # prefix, add the bonus token.
        emitted = steps = accepted = 0
        v = prompt
        while v < length - 1:
            seq = ref.HeadSequence(head)
            out = seq.feed(tokens[1:v + 1].tolist(), list(range(-1, v - 1)), feats[:v])
            seq.commit(list(range(v)))
            hidden, parent, drafts = out[-1], -1, []
            for d in range(4):
                tok = int(head.to_target(head.logits(hidden).argmax()))
                drafts.append(tok)
                hidden = seq.feed([tok], [parent], hidden.unsqueeze(0), fused=True)[0]
                parent = d
            a = 0
            while a < 4 and v + 1 + a < length and drafts[a] == int(tokens[v + 1 + a]):
                a += 1
            accepted += a
            emitted += min(a + 1, length - 1 - v)
            steps += 1
            v += a + 1
    assert got == (emitted, steps, accepted)
    assert accepted >= 5  # the check saw real acceptances (10 in 13 steps as written)


def test_simulated_draft_model_tree_matches_its_chain():
    """With top-k 1 and 4 nodes the draft model's simulated tree is its greedy chain of 4, which
    chain_stats scores from one pass's argmax; on its own greedy text with a wrong token now and
    then, so that drafts are both accepted and rejected."""
    draft = ref.LlamaTarget(os.path.join(EAGLE, "target"), torch.float32)
    prompt, length = 6, 40
    tokens = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        while tokens.shape[1] < length:
            logits, _, _ = draft.forward(tokens)
            nxt = int(logits[0, -1].argmax())
            if tokens.shape[1] % 6 == 0:
                nxt = (nxt + 1) % 256
            tokens = torch.cat((tokens, torch.tensor([[nxt]])), dim=1)
        tokens = tokens[0]
        logits, _, _ = draft.forward(tokens.unsqueeze(0))
        matches = (logits[0, prompt:-1].argmax(-1) == tokens[prompt + 1:]).tolist()
        got = train_head.simulate_draft_model(draft, tokens, prompt, 4, 1, 4)
        wider = train_head.simulate_draft_model(draft, tokens, prompt, 4, 4, 16)
    want = train_head.chain_stats(matches, 4)
    assert got == want
    assert 5 <= want[2] < len(matches)  # real acceptances and real rejections
    assert wider[0] == want[0] and wider[2] >= 5  # the 16-node tree runs and accepts too


@pytest.mark.parametrize("name", ["llama3_pattern", "gpt2_bytelevel"])
def test_python_bpe_matches_the_tokenizers_library(name):
    folder = os.path.join(FIXTURES, "tokenizers", name)
    tok = bpe_tokenizer.ByteLevelBPE(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "cases.json")) as f:
        cases = json.load(f)["encode"]
    for case in cases:
        assert tok.encode(case["text"]) == case["ids"], case["text"]


def test_python_bpe_encodes_the_reference_prompts():
    tok = bpe_tokenizer.ByteLevelBPE(os.path.join(ROOT, "models", "pycoder-target",
                                                  "tokenizer.json"))
    with open(os.path.join(FIXTURES, "reference_greedy.json")) as f:
        cases = json.load(f)["models"]["pycoder-target"]["cases"]
    for case in cases:
        assert tok.encode(case["text"]) == case["prompt_ids"]


def test_convert_eagle_bin_round_trip():
    stored = safetensors_io.load(os.path.join(EAGLE, "eagle3_head", "model.safetensors"))
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in stored.items()}
    state["lm_head.weight"] = state["lm_head.weight"][:, :]  # a view sharing storage
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "bin"), os.path.join(tmp, "st")
        os.makedirs(src)
        torch.save(state, os.path.join(src, "pytorch_model.bin"))
        with open(os.path.join(EAGLE, "eagle3_head", "config.json")) as f:
            config = f.read()
        with open(os.path.join(src, "config.json"), "w") as f:
            f.write(config)
        convert_eagle_bin.convert(src, dst)
        back = safetensors_io.load(os.path.join(dst, "model.safetensors"))
        assert sorted(back) == sorted(state)
        for k in state:
            assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k
        with open(os.path.join(dst, "config.json")) as f:
            assert f.read() == config
        convert_eagle_bin.convert(src, dst, dtype="float32")
        back = safetensors_io.load(os.path.join(dst, "model.safetensors"))
        assert back["fc.weight"].dtype == torch.float32
        assert back["d2t"].dtype == torch.int64 and back["t2d"].dtype == torch.bool


def test_committed_head_predicts_the_reference_target():
    """models/pycoder-eagle3 is a trained head: its first draft step agrees with the target's
    greedy token on the reference continuations (0.69 when written; a random head scores ~0)."""
    target = ref.LlamaTarget(os.path.join(ROOT, "models", "pycoder-target"), torch.float32)
    head = ref.load_head(os.path.join(ROOT, "models", "pycoder-eagle3"), target, torch.float32)
    assert head.cfg.taps == [1, 2, 4]
    with open(os.path.join(FIXTURES, "reference_greedy.json")) as f:
        cases = json.load(f)["models"]["pycoder-target"]["cases"]
    hit = count = 0
    with torch.no_grad():
        for case in cases:
            ids = torch.tensor(case["prompt_ids"] + case["continuation_ids"])
            n = len(case["prompt_ids"])
            _, states, _ = target.forward(ids.unsqueeze(0), taps=head.cfg.taps)
            feats = torch.cat([states[t] for t in head.cfg.taps], dim=-1)
            out = train_head.ttt_forward(head, feats, ids.unsqueeze(0), 1)[0][0]
            pred = head.to_target(head.logits(out).argmax(-1))  # row j scores token j + 2
            sel = slice(n - 1, ids.numel() - 2)
            hit += int((pred[sel] == ids[2:][sel]).sum())
            count += ids[2:][sel].numel()
    assert hit / count >= 0.5, hit / count


def test_serving_eagle1_head_reads_the_final_norm_output():
    """tests/fixtures/eagle1_pycoder loads in the published EAGLE-1/2 layout against the
    reference target, and fed the target's final norm output (the feature the verify service
    exports as tap N + 1) its chain proposes the target's greedy token on the reference
    continuations far more often than chance (1 in 8,192): fc was fitted to that feature."""
    target = ref.LlamaTarget(os.path.join(ROOT, "models", "pycoder-target"), torch.float32)
    head = ref.load_head(os.path.join(FIXTURES, "eagle1_pycoder"), target, torch.float32)
    assert head.cfg.kind == "eagle1" and head.cfg.fc_bias
    assert tuple(head.fc.weight.shape) == (320, 640)
    with open(os.path.join(FIXTURES, "reference_greedy.json")) as f:
        cases = json.load(f)["models"]["pycoder-target"]["cases"]
    hit = count = 0
    with torch.no_grad():
        for case in cases:
            ids = torch.tensor(case["prompt_ids"] + case["continuation_ids"])
            n = len(case["prompt_ids"])
            _, _, final = target.forward(ids.unsqueeze(0), want_final=True)
            seq = ref.HeadSequence(head)
            # Pairs (feature p, token p + 1) as one chain: output p scores token p + 2.
            out = seq.feed(ids[1:].tolist(), list(range(-1, ids.numel() - 2)), final[0, :-1])
            pred = head.logits(out).argmax(-1)
            sel = slice(n - 1, ids.numel() - 2)
            hit += int((pred[sel] == ids[2:][sel]).sum())
            count += ids[2:][sel].numel()
    assert hit / count >= 0.15, hit / count


@pytest.mark.parametrize("name", ["eagle3", "eagle3_nbr", "eagle1"])
def test_emulated_bf16_head_within_the_cuda_bound(name):
    # tests/gpu/cuda_eagle_head_test.cc's bound (kCudaTol); the emulation stays away from both
    # ends: a rounding left out would show as an error near 0, a broken emulation as one near 1.
    with open(os.path.join(EAGLE, "oracle.json")) as f:
        scenario = json.load(f)["scenarios"][name]
    target = ref.LlamaTarget(os.path.join(EAGLE, "target"))
    oracle = safetensors_io.load_folder(EAGLE)
    worst = eagle_bf16_emulate.worst_error(scenario, oracle, target, round_fc_out=False)
    assert 1e-3 < worst < 2e-2
