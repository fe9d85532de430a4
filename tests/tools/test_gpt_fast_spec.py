"""bench/tools/gpt_fast_spec_bench.py's conversion of a specd synthetic pair into gpt-fast's
format is exact: on a tiny pair (specd-make-synthetic-pair --shape reference), gpt-fast's greedy
output (eager, fp32, on the CPU) with and without speculative decoding equals specd's greedy
output for the same prompt ids, served by real specd-verify / specd-draft / specd-router
processes; the prompt ids the benchmark feeds equal the router's own tokenization of the
prompts' text; and a conversion that skips the RoPE row permutation diverges (the check can
fail).

Skips unless gpt-fast's sources are in .carry-gptfast/gpt-fast (bench/tools/fetch_gpt_fast.sh,
never committed) and the build's executables are in $SPECD_BIN (default build/bin).

  SPECD_BIN=build/bin python3 -m pytest -q tests/tools/test_gpt_fast_spec.py
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.path.join(ROOT, "bench", "tools", "gpt_fast_spec_bench.py")
GPT_FAST = os.path.join(ROOT, ".carry-gptfast", "gpt-fast")
BIN = os.path.abspath(os.environ.get("SPECD_BIN", os.path.join(ROOT, "build", "bin")))
PROMPTS = os.path.join(ROOT, "bench", "prompts", "code_prompts.json")
NUM_PROMPTS = 2
NEW_TOKENS = 24

pytestmark = [
    pytest.mark.skipif(not all(os.path.isfile(os.path.join(GPT_FAST, f))
                               for f in ("model.py", "generate_spec.py")),
                       reason="no gpt-fast sources in .carry-gptfast (fetch_gpt_fast.sh)"),
    pytest.mark.skipif(not all(os.access(os.path.join(BIN, e), os.X_OK) for e in (
        "specd-make-synthetic-pair", "specd-verify", "specd-draft", "specd-router",
        "specd-cli")), reason=f"no specd executables in {BIN}"),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args, timeout=60):
    return subprocess.run([os.path.join(BIN, "specd-cli"), *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pair():
    with tempfile.TemporaryDirectory() as tmp:
        t, d = os.path.join(tmp, "t"), os.path.join(tmp, "d")
        subprocess.run([os.path.join(BIN, "specd-make-synthetic-pair"), "--shape", "reference",
                        "--draft_layers", "1", "--epsilon", "0.3", "--num_threads", "1",
                        "--tokenizer_dir", os.path.join(ROOT, "models", "pycoder-target"),
                        "--target_dir", t, "--draft_dir", d], check=True,
                       capture_output=True, timeout=120)
        yield tmp, t, d


@pytest.fixture(scope="module")
def router(pair):
    tmp, t, d = pair
    v, dr, r = (f"127.0.0.1:{free_port()}" for _ in range(3))
    cmds = [
        ["specd-verify", "--address", v, "--model", t],
        ["specd-draft", "--address", dr, "--model", d],
        ["specd-router", "--address", r, "--model", t, "--verify_address", v,
         "--draft_address", dr],
    ]
    procs = []
    for c in cmds:
        extra = [] if c[0] == "specd-router" else ["--device", "cpu", "--num_threads", "1"]
        log = open(os.path.join(tmp, c[0] + ".log"), "w")
        procs.append(subprocess.Popen([os.path.join(BIN, c[0]), *c[1:], "--metrics_port",
                                       str(free_port()), *extra], stdout=log, stderr=log))
    try:
        end = time.time() + 120
        while True:
            assert all(p.poll() is None for p in procs), "a service exited"
            info = cli("info", "--server", r)
            if info.returncode == 0 and '"draft_available":true' in info.stdout:
                break
            assert time.time() < end, "the services did not come up"
            time.sleep(0.2)
        yield r
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def gpt_fast(pair, *extra):
    tmp, t, d = pair
    out = os.path.join(tmp, f"gf{len(os.listdir(tmp))}.json")
    run = subprocess.run([sys.executable, BENCH, "--target", t, "--draft", d, "--device", "cpu",
                          "--dtype", "fp32", "--no-compile", "--num-prompts", str(NUM_PROMPTS),
                          "--max-new-tokens", str(NEW_TOKENS), "--ks", "3", "--warmup", "0",
                          "--tokens-json", out, *extra],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    with open(out) as f:
        return json.load(f)


def specd_greedy(router, ids, speculation):
    res = cli("generate", "--server", router, "--prompt-ids", ",".join(map(str, ids)),
              "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--speculation",
              speculation, "--json")
    assert res.returncode == 0, res.stderr
    tokens = []
    for line in res.stdout.splitlines():
        tokens += json.loads(line).get("token_ids", [])
    return tokens


def test_gpt_fast_greedy_equals_specd_greedy(pair, router):
    doc = gpt_fast(pair)
    assert set(doc["cases"]) == {"plain", "k3"}
    for i, ids in enumerate(doc["prompt_ids"]):
        want = specd_greedy(router, ids, "off")
        assert len(want) == NEW_TOKENS
        assert specd_greedy(router, ids, "draft_model") == want
        assert doc["cases"]["plain"][i] == want, f"prompt {i}: plain decode differs"
        assert doc["cases"]["k3"][i] == want, f"prompt {i}: speculative decode differs"


def test_prompt_ids_are_the_routers_tokenization(router):
    with open(PROMPTS) as f:
        prompts = json.load(f)["prompts"][:NUM_PROMPTS]
    for p in prompts:
        res = cli("tokenize", "--server", router, "--text", p["text"], "--add-special-tokens")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == p["ids"]


def test_a_conversion_without_the_rope_permutation_diverges(pair, router):
    doc = gpt_fast(pair, "--skip-rope-permute")
    want = specd_greedy(router, doc["prompt_ids"][0], "off")
    assert doc["cases"]["plain"][0] != want
