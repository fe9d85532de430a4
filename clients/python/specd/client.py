"""The synchronous client."""

import time
from typing import Iterator, List, Optional

import grpc

from . import _common
from ._common import Metadata, RetryPolicy, pb
from .errors import from_rpc_error
from .types import Chunk, GenerateResult, ModelInfo


class Client:
    """A connection to a specd router (service specd.v1.Generation).

        with specd.Client("localhost:50050", timeout=30) as client:
            result = client.generate("def fib(n):", max_new_tokens=64)
            print(result.text, result.speculation.acceptance_rate)

    timeout: default deadline of each call in seconds (None: no deadline); a call's own
      `timeout=` overrides it. The deadline covers retries too and travels to the router,
      which passes it on to the draft and verify services.
    tls: False (plaintext), True (TLS with the system roots) or a specd.TLS (custom roots,
      mutual TLS, server name override).
    metadata: sent with every call, e.g. {"authorization": "Bearer ..."}; a call's own
      `metadata=` is added to it.
    retry: a specd.RetryPolicy (UNAVAILABLE, RESOURCE_EXHAUSTED before any response only); RetryPolicy(1) for none.
    options: extra gRPC channel options.
    """

    def __init__(self, address: str, *, timeout: Optional[float] = None, tls=False,
                 metadata: Metadata = None, retry: Optional[RetryPolicy] = None,
                 options=None):
        creds, tls_options = _common.channel_credentials(tls)
        opts = list(options or []) + tls_options
        self._channel = (grpc.secure_channel(address, creds, options=opts) if creds
                         else grpc.insecure_channel(address, options=opts))
        self._stub = _common.generation_pb2_grpc.GenerationStub(self._channel)
        self._timeout = timeout
        self._metadata = metadata
        self._retry = retry or RetryPolicy()

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- generation ---------------------------------------------------------------------------

    def generate_stream(self, prompt: Optional[str] = None, *, timeout=None,
                        metadata: Metadata = None, **params) -> Iterator[Chunk]:
        """Yields the completion chunk by chunk as the router streams it; the last chunk carries
        finish_reason, usage and speculation stats. Parameters as GenerateRequest:
        prompt or prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, stop,
        stop_token_ids, ignore_eos, speculation ("auto", "off", "draft_model", "ngram", "eagle3"),
        draft_depth, draft_top_k, draft_max_nodes, request_id. Leaving the loop early (or
        closing the generator) cancels the request in all three services."""
        request = _common.build_request(prompt, **params)
        deadline = self._deadline(timeout)
        md = _common.merge_metadata(self._metadata, metadata)
        attempt = 0
        while True:
            call = self._stub.Generate(request, timeout=_time_left(deadline), metadata=md)
            received = False
            try:
                for resp in call:
                    received = True
                    yield _common.to_chunk(resp)
                return
            except grpc.RpcError as e:
                if self._retry.should_retry(e.code(), attempt, received, _time_left(deadline)):
                    time.sleep(self._retry.backoff(attempt))
                    attempt += 1
                    continue
                raise from_rpc_error(e) from None
            finally:
                call.cancel()  # a no-op once the stream has ended

    def generate(self, prompt: Optional[str] = None, **params) -> GenerateResult:
        """The whole completion: text, token ids, finish reason, usage and speculation stats.
        Same parameters as generate_stream; n > 1 is generate_samples'."""
        _common.check_single(params)
        builder = _common.ResultBuilder()
        for chunk in self.generate_stream(prompt, **params):
            builder.add(chunk)
        return builder.result()

    def generate_samples(self, prompt: Optional[str] = None, *, n: int,
                         **params) -> List[GenerateResult]:
        """n independent samples of one prompt (sample i uses seed + i), in index order."""
        builders = _common.SampleBuilders(n)
        for chunk in self.generate_stream(prompt, n=n, **params):
            builders.add(chunk)
        return builders.results()

    # -- other calls --------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special_tokens=False, timeout=None,
                 metadata: Metadata = None) -> List[int]:
        resp = self._unary(self._stub.Tokenize,
                           pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                           timeout, metadata)
        return list(resp.ids)

    def detokenize(self, ids, *, skip_special_tokens=False, timeout=None,
                   metadata: Metadata = None) -> str:
        resp = self._unary(self._stub.Detokenize,
                           pb.DetokenizeRequest(ids=list(ids),
                                                skip_special_tokens=skip_special_tokens),
                           timeout, metadata)
        return resp.text

    def model_info(self, *, timeout=None, metadata: Metadata = None) -> ModelInfo:
        return _common.to_model_info(
            self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, metadata))

    def health(self, service: str = "", *, timeout=None) -> str:
        """grpc.health.v1 status of the router: SERVING, NOT_SERVING, SERVICE_UNKNOWN, ..."""
        check = self._channel.unary_unary(_common.HEALTH_METHOD,
                                          request_serializer=_common.encode_health_request,
                                          response_deserializer=_common.decode_health_response)
        return self._unary(check, service, timeout, None)

    def _unary(self, method, request, timeout, metadata):
        deadline = self._deadline(timeout)
        md = _common.merge_metadata(self._metadata, metadata)
        attempt = 0
        while True:
            try:
                return method(request, timeout=_time_left(deadline), metadata=md)
            except grpc.RpcError as e:
                if self._retry.should_retry(e.code(), attempt, False, _time_left(deadline)):
                    time.sleep(self._retry.backoff(attempt))
                    attempt += 1
                    continue
                raise from_rpc_error(e) from None

    def _deadline(self, timeout):
        t = self._timeout if timeout is None else timeout
        return None if t is None else time.monotonic() + t


def _time_left(deadline):
    return None if deadline is None else max(0.0, deadline - time.monotonic())
