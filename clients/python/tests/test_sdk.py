"""The Python SDK without a specd cluster: request building, error mapping, and the retry rules
(retry UNAVAILABLE only before the first chunk, never mid-stream) against an in-process gRPC
server that injects those faults on cue, which the real router cannot be made to do."""

import asyncio
import os
import threading
import time
from concurrent import futures

import grpc
import pytest

import specd
from specd import _common
from specd.v1 import generation_pb2 as pb
from specd.v1 import generation_pb2_grpc as pb_grpc


def test_the_installed_package_is_under_test():
    """ctest runs these tests in a venv with the SDK installed from its wheel
    (tests/deploy/python_sdk_venv.py); make sure that copy, not a source folder, was imported."""
    venv = os.environ.get("SPECD_SDK_INSTALLED")
    if not venv:
        pytest.skip("SPECD_SDK_INSTALLED not set: testing whatever `import specd` finds")
    assert os.path.realpath(specd.__file__).startswith(os.path.realpath(venv) + os.sep)
    assert os.path.isfile(os.path.join(os.path.dirname(specd.__file__), "py.typed"))


# -- request building and conversion ---------------------------------------------------------

def test_build_request_sets_only_given_sampling_fields():
    r = _common.build_request("hi", max_new_tokens=5, temperature=0.0, seed=3,
                              speculation="ngram", stop="END")
    assert r.prompt == "hi" and r.max_new_tokens == 5 and r.seed == 3
    assert r.HasField("temperature") and r.temperature == 0.0
    assert not r.HasField("top_p") and not r.HasField("top_k")
    assert list(r.stop) == ["END"]
    assert r.speculation == pb.SPECULATION_NGRAM
    r = _common.build_request(prompt_ids=[1, 2, 3])
    assert list(r.prompt_ids.ids) == [1, 2, 3] and r.WhichOneof("input") == "prompt_ids"


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "a", "prompt_ids": [1]}])
def test_build_request_needs_exactly_one_prompt(kwargs):
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(ValueError, match="exactly one"):
        _common.build_request(prompt, **kwargs)


def test_build_request_rejects_unknown_speculation():
    with pytest.raises(ValueError, match="speculation"):
        _common.build_request("a", speculation="eagle9")


def test_last_chunk_carries_stats():
    resp = pb.GenerateResponse(token_ids=[5], text="x", finish_reason=pb.FINISH_REASON_EOS)
    resp.usage.prompt_tokens, resp.usage.completion_tokens = 3, 7
    resp.speculation.steps, resp.speculation.draft_tokens = 2, 8
    resp.speculation.accepted_tokens = 6
    resp.speculation.mode = pb.SPECULATION_DRAFT_MODEL
    c = _common.to_chunk(resp)
    assert c.finish_reason == "eos" and c.usage == specd.Usage(3, 7)
    assert c.speculation.acceptance_rate == 0.75
    assert c.speculation.mean_accepted_length == 4.0
    assert c.speculation.mode == "draft_model"
    mid = _common.to_chunk(pb.GenerateResponse(token_ids=[1], text="a"))
    assert mid.finish_reason is None and mid.speculation is None
    assert specd.SpeculationStats().acceptance_rate is None


def test_model_info_names_the_modes_and_leaves_unknown_ones_out():
    m = pb.ModelInfo(target_model="t", has_chat_template=True,
                     chat_template_source="chat_template.jinja",
                     speculation_modes=[pb.SPECULATION_AUTO, pb.SPECULATION_OFF,
                                        pb.SPECULATION_NGRAM, pb.SPECULATION_EAGLE3])
    m.speculation_modes.append(99)  # a mode newer than this SDK
    info = _common.to_model_info(m)
    assert info.has_chat_template and info.chat_template_source == "chat_template.jinja"
    assert info.speculation_modes == ["auto", "off", "ngram", "eagle3"]
    empty = _common.to_model_info(pb.ModelInfo())
    assert not empty.has_chat_template and empty.speculation_modes == []


def test_every_status_code_has_a_typed_error():
    for code in grpc.StatusCode:
        if code == grpc.StatusCode.OK:
            continue
        err = specd.from_rpc_error(_FakeRpcError(code, "why"))
        assert err.code == code and err.details == "why"
        assert isinstance(err, specd.SpecdError)
        assert type(err) is not specd.SpecdError, code
    assert isinstance(specd.from_rpc_error(_FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "")),
                      specd.ResourceExhaustedError)


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_health_encoding():
    assert _common.encode_health_request("") == b""
    assert _common.encode_health_request("specd.v1.Generation")[:2] == b"\x0a\x13"
    assert _common.decode_health_response(b"\x08\x01") == "SERVING"
    assert _common.decode_health_response(b"\x08\x02") == "NOT_SERVING"


# -- a fault-injecting Generation server --------------------------------------------------------

class FaultServer(pb_grpc.GenerationServicer):
    """Answers Generate with `plan`: a list, one entry per call, of
    ("fail", code) | ("chunk_then_fail", code) | ("ok", n_chunks) | ("hang", None)."""

    def __init__(self):
        self.plan = []
        self.calls = 0
        self.tokenize_failures = 0
        self.metadata = []
        self.cancelled = threading.Event()
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            step = self.plan[self.calls] if self.calls < len(self.plan) else ("ok", 2)
            self.calls += 1
            self.metadata.append(dict(context.invocation_metadata()))
        kind, arg = step
        if kind == "fail":
            context.abort(arg, f"injected {arg.name}")
        if kind == "chunk_then_fail":
            yield pb.GenerateResponse(token_ids=[1], text="a")
            context.abort(arg, f"injected {arg.name} mid-stream")
        if kind == "hang":
            context.add_callback(self.cancelled.set)
            yield pb.GenerateResponse(token_ids=[1], text="a")
            self.cancelled.wait(10)
            return
        for i in range(arg - 1):
            yield pb.GenerateResponse(token_ids=[10 + i], text=f"t{i}")
        last = pb.GenerateResponse(token_ids=[99], text="!", finish_reason=pb.FINISH_REASON_LENGTH)
        last.usage.completion_tokens = arg
        last.speculation.steps, last.speculation.draft_tokens = 1, 4
        last.speculation.accepted_tokens = 3
        yield last

    def Tokenize(self, request, context):
        with self.lock:
            if self.tokenize_failures > 0:
                self.tokenize_failures -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "injected")
        return pb.TokenizeResponse(ids=[ord(c) for c in request.text])


@pytest.fixture
def server():
    fault = FaultServer()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(fault, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    fault.address = f"127.0.0.1:{port}"
    yield fault
    srv.stop(0)


FAST = specd.RetryPolicy(max_attempts=3, initial_backoff=0.01)


def test_generate_retries_unavailable_before_first_chunk(server):
    server.plan = [("fail", grpc.StatusCode.UNAVAILABLE)] * 2 + [("ok", 3)]
    with specd.Client(server.address, retry=FAST, timeout=10) as c:
        r = c.generate("x")
    assert server.calls == 3
    assert r.text == "t0t1!" and r.token_ids == [10, 11, 99] and r.finish_reason == "length"
    assert r.speculation.acceptance_rate == 0.75


def test_generate_gives_up_after_max_attempts(server):
    server.plan = [("fail", grpc.StatusCode.UNAVAILABLE)] * 5
    with specd.Client(server.address, retry=FAST) as c, \
            pytest.raises(specd.UnavailableError, match="injected"):
        c.generate("x")
    assert server.calls == 3


def test_stream_never_retried_after_a_chunk(server):
    server.plan = [("chunk_then_fail", grpc.StatusCode.UNAVAILABLE), ("ok", 3)]
    got = []
    with specd.Client(server.address, retry=FAST) as c, pytest.raises(specd.UnavailableError):
        for chunk in c.generate_stream("x"):
            got.append(chunk.text)
    assert got == ["a"] and server.calls == 1


def test_generate_retries_resource_exhausted_with_backoff(server):
    server.plan = [("fail", grpc.StatusCode.RESOURCE_EXHAUSTED)] * 2 + [("ok", 2)]
    policy = specd.RetryPolicy(max_attempts=3, initial_backoff=0.2, jitter=0)
    start = time.monotonic()
    with specd.Client(server.address, retry=policy, timeout=10) as c:
        r = c.generate("x")
    assert server.calls == 3 and r.token_ids == [10, 99]
    assert time.monotonic() - start >= 0.2 + 0.4  # both waits, doubling


def test_resource_exhausted_retries_end_typed(server):
    server.plan = [("fail", grpc.StatusCode.RESOURCE_EXHAUSTED)] * 5
    with specd.Client(server.address, retry=FAST) as c, \
            pytest.raises(specd.ResourceExhaustedError):
        c.generate("x")
    assert server.calls == 3


def test_backoff_jitter_stays_in_its_band():
    policy = specd.RetryPolicy(initial_backoff=1.0, max_backoff=2.0, jitter=0.2)
    waits = [policy.backoff(3) for _ in range(200)]
    assert all(1.6 <= w <= 2.4 for w in waits) and len(set(waits)) > 1
    with pytest.raises(ValueError):
        specd.RetryPolicy(jitter=1.0)


@pytest.mark.parametrize("code,cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, specd.InvalidArgumentError),
    (grpc.StatusCode.INTERNAL, specd.InternalError),
])
def test_other_errors_are_typed_and_not_retried(server, code, cls):
    server.plan = [("fail", code), ("ok", 2)]
    with specd.Client(server.address, retry=FAST) as c, pytest.raises(cls) as info:
        c.generate("x")
    assert server.calls == 1 and info.value.code == code
    assert f"injected {code.name}" in str(info.value)


def test_unary_calls_retry_unavailable(server):
    server.tokenize_failures = 2
    with specd.Client(server.address, retry=FAST) as c:
        assert c.tokenize("ab") == [97, 98]
    server.tokenize_failures = 5
    with specd.Client(server.address, retry=FAST) as c, pytest.raises(specd.UnavailableError):
        c.tokenize("ab")


def test_metadata_of_client_and_call_are_sent(server):
    with specd.Client(server.address, metadata={"authorization": "Bearer t"}) as c:
        c.generate("x", metadata=[("x-request-tag", "7")])
    assert server.metadata[0]["authorization"] == "Bearer t"
    assert server.metadata[0]["x-request-tag"] == "7"


def test_leaving_a_stream_early_cancels_it(server):
    server.plan = [("hang", None)]
    with specd.Client(server.address) as c:
        stream = c.generate_stream("x")
        assert next(stream).text == "a"
        stream.close()
    assert server.cancelled.wait(5), "the server never saw the cancellation"


def test_async_client_retries_and_never_mid_stream(server):
    async def run():
        server.plan = [("fail", grpc.StatusCode.UNAVAILABLE), ("ok", 2),
                       ("chunk_then_fail", grpc.StatusCode.UNAVAILABLE)]
        async with specd.AsyncClient(server.address, retry=FAST, timeout=10) as c:
            r = await c.generate("x")
            assert r.token_ids == [10, 99] and server.calls == 2
            got = []
            with pytest.raises(specd.UnavailableError):
                async for chunk in c.generate_stream("y"):
                    got.append(chunk.text)
            assert got == ["a"] and server.calls == 3
            server.tokenize_failures = 1
            assert await c.tokenize("a") == [97]

    asyncio.run(run())


def test_tls_settings():
    creds, opts = _common.channel_credentials(True)
    assert isinstance(creds, grpc.ChannelCredentials) and opts == []
    _, opts = _common.channel_credentials(specd.TLS(server_name="specd.internal"))
    assert opts == [("grpc.ssl_target_name_override", "specd.internal")]
    assert _common.channel_credentials(False) == (None, [])
    with pytest.raises(TypeError):
        _common.channel_credentials("yes")
