"""The asyncio client (grpc.aio)."""

import asyncio
import time
from typing import AsyncIterator, List, Optional

import grpc
import grpc.aio

from . import _common
from ._common import Metadata, RetryPolicy, pb
from .errors import from_rpc_error
from .types import Chunk, GenerateResult, ModelInfo


class AsyncClient:
    """The asyncio twin of specd.Client, with the same arguments and methods as coroutines:

        async with specd.AsyncClient("localhost:50050") as client:
            async for chunk in client.generate_stream("def fib(n):"):
                print(chunk.text, end="")
    """

    def __init__(self, address: str, *, timeout: Optional[float] = None, tls=False,
                 metadata: Metadata = None, retry: Optional[RetryPolicy] = None,
                 options=None):
        creds, tls_options = _common.channel_credentials(tls)
        opts = list(options or []) + tls_options
        self._channel = (grpc.aio.secure_channel(address, creds, options=opts) if creds
                         else grpc.aio.insecure_channel(address, options=opts))
        self._stub = _common.generation_pb2_grpc.GenerationStub(self._channel)
        self._timeout = timeout
        self._metadata = metadata
        self._retry = retry or RetryPolicy()

    async def close(self):
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def generate_stream(self, prompt: Optional[str] = None, *, timeout=None,
                              metadata: Metadata = None, **params) -> AsyncIterator[Chunk]:
        """See Client.generate_stream."""
        request = _common.build_request(prompt, **params)
        deadline = self._deadline(timeout)
        md = _common.merge_metadata(self._metadata, metadata)
        attempt = 0
        while True:
            call = self._stub.Generate(request, timeout=_time_left(deadline), metadata=md)
            received = False
            try:
                async for resp in call:
                    received = True
                    yield _common.to_chunk(resp)
                return
            except grpc.aio.AioRpcError as e:
                if self._retry.should_retry(e.code(), attempt, received, _time_left(deadline)):
                    await asyncio.sleep(self._retry.backoff(attempt))
                    attempt += 1
                    continue
                raise from_rpc_error(e) from None
            finally:
                call.cancel()

    async def generate(self, prompt: Optional[str] = None, **params) -> GenerateResult:
        _common.check_single(params)
        builder = _common.ResultBuilder()
        async for chunk in self.generate_stream(prompt, **params):
            builder.add(chunk)
        return builder.result()

    async def generate_samples(self, prompt: Optional[str] = None, *, n: int,
                               **params) -> List[GenerateResult]:
        """See Client.generate_samples."""
        builders = _common.SampleBuilders(n)
        async for chunk in self.generate_stream(prompt, n=n, **params):
            builders.add(chunk)
        return builders.results()

    async def tokenize(self, text: str, *, add_special_tokens=False, timeout=None,
                       metadata: Metadata = None) -> List[int]:
        resp = await self._unary(
            self._stub.Tokenize,
            pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
            timeout, metadata)
        return list(resp.ids)

    async def detokenize(self, ids, *, skip_special_tokens=False, timeout=None,
                         metadata: Metadata = None) -> str:
        resp = await self._unary(
            self._stub.Detokenize,
            pb.DetokenizeRequest(ids=list(ids), skip_special_tokens=skip_special_tokens),
            timeout, metadata)
        return resp.text

    async def model_info(self, *, timeout=None, metadata: Metadata = None) -> ModelInfo:
        return _common.to_model_info(await self._unary(
            self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, metadata))

    async def health(self, service: str = "", *, timeout=None) -> str:
        check = self._channel.unary_unary(_common.HEALTH_METHOD,
                                          request_serializer=_common.encode_health_request,
                                          response_deserializer=_common.decode_health_response)
        return await self._unary(check, service, timeout, None)

    async def _unary(self, method, request, timeout, metadata):
        deadline = self._deadline(timeout)
        md = _common.merge_metadata(self._metadata, metadata)
        attempt = 0
        while True:
            try:
                return await method(request, timeout=_time_left(deadline), metadata=md)
            except grpc.aio.AioRpcError as e:
                if self._retry.should_retry(e.code(), attempt, False, _time_left(deadline)):
                    await asyncio.sleep(self._retry.backoff(attempt))
                    attempt += 1
                    continue
                raise from_rpc_error(e) from None

    def _deadline(self, timeout):
        t = self._timeout if timeout is None else timeout
        return None if t is None else time.monotonic() + t


def _time_left(deadline):
    return None if deadline is None else max(0.0, deadline - time.monotonic())
