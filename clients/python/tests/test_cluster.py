"""The Python SDK against the real specd services (specd-verify, specd-draft, specd-router
started from the build on loopback with a random-weight model). ctest reports it skipped when
the executables are not built."""

import asyncio
import subprocess
import tempfile

import pytest

import specd
import specd_cluster  # tests/deploy, on PYTHONPATH through ctest



@pytest.fixture(scope="module")
def cluster():
    with specd_cluster.Cluster() as c:
        yield c


@pytest.fixture
def client(cluster):
    with specd.Client(cluster.address, timeout=60) as c:
        yield c


def test_model_info_and_health(client):
    info = client.model_info()
    assert info.vocab_size == 320  # tests/testutil/random_checkpoint.h's default
    assert info.draft_available
    assert info.max_new_tokens_limit > 0 and info.eos_token_ids
    # The CPU verify backend serves logprobs and the logits processors.
    assert info.supports_logprobs and info.supports_logits_processors
    # The random test model's folder has no chat template; the draft service has a draft model.
    assert not info.has_chat_template and info.chat_template_source == ""
    assert info.speculation_modes == ["auto", "off", "draft_model", "ngram"]
    assert client.health() == "SERVING"


def test_tokenize_detokenize_round_trip(client):
    ids = client.tokenize("def f(x):\n    return x + 1\n")
    assert ids and all(0 <= i < 320 for i in ids)
    assert client.detokenize(ids) == "def f(x):\n    return x + 1\n"


def test_generate_returns_text_ids_and_stats(client):
    r = client.generate("def fib(n):", max_new_tokens=16, ignore_eos=True,
                        speculation="draft_model")
    assert len(r.token_ids) == 16 and r.finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 0
    assert r.speculation.steps > 0 and r.speculation.draft_tokens > 0
    assert 0 <= r.speculation.accepted_tokens <= r.speculation.draft_tokens
    # Streamed text leaves special tokens out, like detokenize with skip_special_tokens.
    assert r.text == client.detokenize(r.token_ids, skip_special_tokens=True)


def test_stream_equals_generate_and_speculation_is_lossless(client):
    kw = dict(max_new_tokens=20, ignore_eos=True)
    whole = client.generate("import os", speculation="draft_model", **kw)
    chunks = list(client.generate_stream("import os", speculation="draft_model", **kw))
    assert [i for c in chunks for i in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None
                                                        for c in chunks[:-1])
    off = client.generate("import os", speculation="off", **kw)
    assert off.token_ids == whole.token_ids  # greedy: identical with speculation on or off
    assert off.speculation.steps == 0


def test_invalid_argument_names_the_field(client):
    with pytest.raises(specd.InvalidArgumentError) as info:
        client.generate("x", temperature=-1.0)
    assert "temperature" in info.value.details
    with pytest.raises(specd.InvalidArgumentError):
        client.generate(prompt_ids=[10**6])
    assert client.generate("x", max_new_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_logprobs_sampling_fields_and_samples(client):
    kw = dict(max_new_tokens=16, ignore_eos=True, logprobs=3, repetition_penalty=1.3,
              presence_penalty=0.5, logit_bias={101: 3.0}, min_tokens=4)
    off = client.generate("def fib(n):", speculation="off", **kw)
    spec = client.generate("def fib(n):", speculation="draft_model", **kw)
    plain = client.generate("def fib(n):", max_new_tokens=16, ignore_eos=True)
    assert spec.token_ids == off.token_ids  # penalties stay lossless under speculation
    assert plain.token_ids != off.token_ids  # and they were applied
    assert len(off.logprobs) == 16 and [lp.token_id for lp in off.logprobs] == off.token_ids
    for a, b in zip(off.logprobs, spec.logprobs):
        assert abs(a.logprob - b.logprob) < 1e-4 and len(a.top) == 3
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
        assert a.rank >= 1 and a.logprob <= 0
    processed = client.generate("def fib(n):", logprobs_source="processed", **kw)
    assert all(lp.rank == 1 for lp in processed.logprobs)  # greedy on the processed logits
    with pytest.raises(ValueError):
        client.generate("x", n=2)
    samples = client.generate_samples("import re", n=3, max_new_tokens=8, ignore_eos=True,
                                      temperature=1.0, seed=21)
    assert [s.index for s in samples] == [0, 1, 2]
    for i, s in enumerate(samples):
        one = client.generate("import re", max_new_tokens=8, ignore_eos=True, temperature=1.0,
                              seed=21 + i)
        assert s.token_ids == one.token_ids
    with pytest.raises(specd.InvalidArgumentError) as info:
        client.generate("x", min_p=2.0)
    assert info.value.details.startswith("min_p")


def test_deadline_exceeded(client):
    with pytest.raises(specd.DeadlineExceededError):
        client.generate("x", max_new_tokens=4000, ignore_eos=True, timeout=0.05)


def test_leaving_a_stream_early_leaves_the_cluster_serving(client):
    stream = client.generate_stream("while True:", max_new_tokens=500, ignore_eos=True)
    next(stream)
    stream.close()
    assert len(client.generate("x", max_new_tokens=3, ignore_eos=True).token_ids) == 3


def test_async_client_matches_sync(cluster, client):
    want = client.generate("class A:", max_new_tokens=12, ignore_eos=True).token_ids

    async def run():
        async with specd.AsyncClient(cluster.address, timeout=60) as c:
            r = await c.generate("class A:", max_new_tokens=12, ignore_eos=True)
            ids = []
            async for chunk in c.generate_stream("class A:", max_new_tokens=12,
                                                 ignore_eos=True):
                ids += chunk.token_ids
            assert (await c.model_info()).vocab_size == 320
            results = await asyncio.gather(*[
                c.generate("class A:", max_new_tokens=12, ignore_eos=True) for _ in range(4)])
            return r.token_ids, ids, [x.token_ids for x in results]

    r_ids, stream_ids, concurrent = asyncio.run(run())
    assert r_ids == want and stream_ids == want
    assert all(ids == want for ids in concurrent)


def test_router_killed_mid_stream_raises_without_retry():
    with specd_cluster.Cluster() as c, specd.Client(
            c.address, retry=specd.RetryPolicy(5, 0.05)) as client:
        stream = client.generate_stream("for", max_new_tokens=4000, ignore_eos=True)
        got = [next(stream)]
        c.kill("specd-router")
        with pytest.raises(specd.UnavailableError):
            for chunk in stream:
                got.append(chunk)
        # Before any chunk, UNAVAILABLE is retried: the router comes back during the retries.
        c.restart("specd-router")
        assert len(client.generate("x", max_new_tokens=2, ignore_eos=True).token_ids) == 2


def make_certificates(d):
    """A CA and a server certificate for 127.0.0.1/localhost, made by openssl."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)
    run("openssl", "req", "-x509", *key, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem",
        "-days", "2", "-subj", "/CN=sdk-test-ca", "-addext", "basicConstraints=critical,CA:TRUE")
    with open(f"{d}/server.ext", "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("openssl", "req", *key, "-keyout", f"{d}/server.key", "-out", f"{d}/server.csr",
        "-subj", "/CN=server")
    run("openssl", "x509", "-req", "-in", f"{d}/server.csr", "-CA", f"{d}/ca.pem", "-CAkey",
        f"{d}/ca.key", "-CAcreateserial", "-days", "2", "-out", f"{d}/server.pem", "-extfile",
        f"{d}/server.ext")
    with open(f"{d}/ca.pem", "rb") as f:
        return f.read()


def test_tls_and_bearer_token_against_a_real_router():
    with tempfile.TemporaryDirectory() as d:
        ca = make_certificates(d)
        with open(f"{d}/tokens", "w") as f:
            f.write("sdk-token\n")
        args = [f"--tls_cert={d}/server.pem", f"--tls_key={d}/server.key",
                f"--token_file={d}/tokens"]
        with specd_cluster.Cluster(router_args=args, router_root_certificates=ca) as c:
            tls = specd.TLS(root_certificates=ca)
            good = {"authorization": "Bearer sdk-token"}
            with specd.Client(c.address, tls=tls, metadata=good, timeout=60) as client:
                off = client.generate("def f(x):", max_new_tokens=24, temperature=0,
                                      ignore_eos=True, speculation="off")
                spec = client.generate("def f(x):", max_new_tokens=24, temperature=0,
                                       ignore_eos=True, speculation="draft_model")
                assert spec.token_ids == off.token_ids and len(off.token_ids) == 24
            with specd.Client(c.address, tls=tls, timeout=10,
                              metadata={"authorization": "Bearer nope"}) as client, \
                    pytest.raises(specd.SpecdError) as info:
                client.model_info()
            assert info.value.code.name == "UNAUTHENTICATED"
            assert info.value.details == "missing or invalid bearer token"
            # Plaintext to the TLS port never gets an answer.
            with specd.Client(c.address, metadata=good, timeout=5,
                              retry=specd.RetryPolicy(max_attempts=1)) as client, \
                    pytest.raises(specd.SpecdError):
                client.model_info()

            async def run():
                async with specd.AsyncClient(c.address, tls=tls, metadata=good,
                                             timeout=60) as client:
                    return await client.tokenize("abc")
            assert asyncio.run(run())
