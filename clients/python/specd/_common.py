"""What the sync and asyncio clients share: request building, message conversion, channel
credentials, retry policy."""

import random
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Tuple, Union

import grpc

from .types import (Chunk, GenerateResult, ModelInfo, SpeculationStats, TokenLogprob,
                    TopLogprob, Usage)

from .v1 import generation_pb2, generation_pb2_grpc  # noqa: F401  (gen_protos.py)

pb = generation_pb2

SPECULATION = {
    "auto": pb.SPECULATION_AUTO,
    "off": pb.SPECULATION_OFF,
    "draft_model": pb.SPECULATION_DRAFT_MODEL,
    "ngram": pb.SPECULATION_NGRAM,
    "eagle3": pb.SPECULATION_EAGLE3,
}
_SPECULATION_NAMES = {v: k for k, v in SPECULATION.items()}
_FINISH = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_STOP_TOKEN: "stop_token",
    pb.FINISH_REASON_STOP_STRING: "stop_string",
    pb.FINISH_REASON_CONTEXT: "context",
}

Metadata = Union[None, Mapping[str, str], Sequence[Tuple[str, str]]]


@dataclass(frozen=True)
class TLS:
    """TLS settings. `tls=True` on a client means TLS with the system's root certificates;
    pass a TLS for custom roots, mutual TLS (client key and certificate chain, PEM bytes) or a
    server name override."""

    root_certificates: Optional[bytes] = None
    private_key: Optional[bytes] = None
    certificate_chain: Optional[bytes] = None
    server_name: Optional[str] = None


def channel_credentials(tls):
    """(credentials or None for plaintext, extra channel options)."""
    if tls is None or tls is False:
        return None, []
    if tls is True:
        tls = TLS()
    if not isinstance(tls, TLS):
        raise TypeError("tls must be a bool or a specd.TLS")
    creds = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key,
                                         tls.certificate_chain)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return creds, options


def merge_metadata(base: Metadata, extra: Metadata):
    out = []
    for md in (base, extra):
        if md is None:
            continue
        items = md.items() if isinstance(md, Mapping) else md
        for k, v in items:
            out.append((str(k).lower(), v))
    return tuple(out) or None


def build_request(prompt=None, *, prompt_ids=None, max_new_tokens=0, temperature=None,
                  top_p=None, top_k=None, seed=None, stop: Iterable[str] = (),
                  stop_token_ids: Iterable[int] = (), ignore_eos=False, speculation="auto",
                  draft_depth=0, draft_top_k=0, draft_max_nodes=0, request_id="", min_p=0.0,
                  logit_bias: Optional[Mapping[int, float]] = None, repetition_penalty=None,
                  presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0, logprobs=None,
                  logprobs_source="raw", n=1):
    """A GenerateRequest. Exactly one of prompt (text) and prompt_ids (token ids). Range checks
    are the router's: it answers a bad value with INVALID_ARGUMENT naming the field.
    logprobs: None = none, 0 = each token's own, k = also the top k alternatives (up to 20);
    logprobs_source "raw" (the model's log_softmax) or "processed" (what the token was drawn
    from). n: independent samples (sample i uses seed + i), streamed with Chunk.index."""
    if logprobs_source not in _LOGPROBS_SOURCE:
        raise ValueError(f"logprobs_source must be one of {sorted(_LOGPROBS_SOURCE)}, "
                         f"got {logprobs_source!r}")
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of prompt and prompt_ids")
    if isinstance(stop, str):
        stop = [stop]
    if speculation not in SPECULATION:
        raise ValueError(f"speculation must be one of {sorted(SPECULATION)}, "
                         f"got {speculation!r}")
    req = pb.GenerateRequest(
        max_new_tokens=max_new_tokens, stop=list(stop), stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos, speculation=SPECULATION[speculation], draft_depth=draft_depth,
        draft_top_k=draft_top_k, draft_max_nodes=draft_max_nodes, request_id=request_id)
    if prompt is not None:
        req.prompt = prompt
    else:
        req.prompt_ids.ids.extend(prompt_ids)
    if temperature is not None:
        req.temperature = temperature
    if top_p is not None:
        req.top_p = top_p
    if top_k is not None:
        req.top_k = top_k
    if seed is not None:
        req.seed = seed
    req.min_p = min_p
    for token_id, bias in (logit_bias or {}).items():
        req.logit_bias[int(token_id)] = bias
    if repetition_penalty is not None:
        req.repetition_penalty = repetition_penalty
    req.presence_penalty = presence_penalty
    req.frequency_penalty = frequency_penalty
    req.min_tokens = min_tokens
    if logprobs is not None:
        req.logprobs = logprobs
    req.logprobs_source = _LOGPROBS_SOURCE[logprobs_source]
    req.n = n
    return req


_LOGPROBS_SOURCE = {"raw": pb.LOGPROBS_SOURCE_RAW, "processed": pb.LOGPROBS_SOURCE_PROCESSED}


def to_logprob(lp) -> TokenLogprob:
    return TokenLogprob(token_id=lp.token_id, token=lp.token, logprob=lp.logprob, rank=lp.rank,
                        top=[TopLogprob(t.token_id, t.token, t.logprob)
                             for t in lp.top_logprobs])


def to_chunk(resp) -> Chunk:
    last = resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return Chunk(
        token_ids=list(resp.token_ids), text=resp.text,
        finish_reason=_FINISH.get(resp.finish_reason, "unspecified") if last else None,
        usage=Usage(resp.usage.prompt_tokens, resp.usage.completion_tokens) if last else None,
        speculation=to_stats(resp.speculation) if last else None,
        matched_stop=resp.matched_stop or None,
        logprobs=[to_logprob(lp) for lp in resp.logprobs], index=resp.index)


def to_stats(s) -> SpeculationStats:
    return SpeculationStats(steps=s.steps, draft_tokens=s.draft_tokens,
                            accepted_tokens=s.accepted_tokens,
                            accepted_per_position=list(s.accepted_per_position),
                            target_only_steps=s.target_only_steps,
                            mode=_SPECULATION_NAMES.get(s.mode, "auto"),
                            shape_changes=s.shape_changes)


class ResultBuilder:
    """Joins chunks into a GenerateResult."""

    def __init__(self):
        self.text, self.ids, self.logprobs, self.last = [], [], [], None

    def add(self, chunk: Chunk):
        self.text.append(chunk.text)
        self.ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.last = chunk

    def result(self) -> GenerateResult:
        if self.last is None:
            raise RuntimeError("the stream ended without a last chunk (no finish reason)")
        return GenerateResult(text="".join(self.text), token_ids=self.ids,
                              finish_reason=self.last.finish_reason, usage=self.last.usage,
                              speculation=self.last.speculation,
                              matched_stop=self.last.matched_stop, logprobs=self.logprobs,
                              index=self.last.index)


def to_model_info(m) -> ModelInfo:
    return ModelInfo(target_model=m.target_model, draft_model=m.draft_model,
                     vocab_size=m.vocab_size, max_context=m.max_context,
                     eos_token_ids=list(m.eos_token_ids),
                     max_new_tokens_limit=m.max_new_tokens_limit,
                     draft_available=m.draft_available,
                     supports_logprobs=m.supports_logprobs,
                     supports_logits_processors=m.supports_logits_processors,
                     has_chat_template=m.has_chat_template,
                     chat_template_source=m.chat_template_source,
                     # A mode newer than this SDK is left out rather than misnamed.
                     speculation_modes=[_SPECULATION_NAMES[s] for s in m.speculation_modes
                                        if s in _SPECULATION_NAMES])


# grpc.health.v1.Health/Check, encoded by hand so that no health stubs are needed:
# HealthCheckRequest {string service = 1}, HealthCheckResponse {ServingStatus status = 1}.
HEALTH_METHOD = "/grpc.health.v1.Health/Check"
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def encode_health_request(service: str) -> bytes:
    data = service.encode()
    if not data:
        return b""
    if len(data) > 127:
        raise ValueError("health service name too long")
    return b"\x0a" + bytes([len(data)]) + data


def decode_health_response(data: bytes) -> str:
    if not data:
        return _HEALTH_STATUS[0]
    if data[0] != 0x08 or len(data) < 2:
        raise ValueError(f"unexpected health response {data!r}")
    return _HEALTH_STATUS.get(data[1], f"STATUS_{data[1]}")


class RetryPolicy:
    """Retries only what cannot duplicate or lose output: a call that failed with UNAVAILABLE
    (the router was unreachable, restarting or draining) or RESOURCE_EXHAUSTED (its queue was
    full) before any response arrived. Tokenize, Detokenize and GetModelInfo are idempotent;
    Generate is retried only until its first chunk arrives, never mid-stream (the client has
    already seen part of the output). The wait before retry n (n = 1, 2, ...) is
    min(max_backoff, initial_backoff * 2^(n-1)) times a random factor in [1 - jitter,
    1 + jitter], so clients refused together do not come back together."""

    RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

    def __init__(self, max_attempts=3, initial_backoff=0.1, max_backoff=2.0, jitter=0.2,
                 retryable_codes=RETRYABLE):
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not 0 <= jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        self.max_attempts = max_attempts
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.jitter = jitter
        self.retryable_codes = tuple(retryable_codes)

    def backoff(self, attempt):
        base = min(self.max_backoff, self.initial_backoff * (2 ** attempt))
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)

    def should_retry(self, code, attempt, received_any, time_left):
        return (code in self.retryable_codes and not received_any and
                attempt + 1 < self.max_attempts and
                (time_left is None or
                 time_left > min(self.max_backoff, self.initial_backoff * (2 ** attempt))))


def check_single(params):
    """generate() returns one result; several samples are generate_samples'."""
    if params.get("n", 1) > 1:
        raise ValueError("n > 1: use generate_samples (or generate_stream and Chunk.index)")


class SampleBuilders:
    """Joins the chunks of n samples, told apart by Chunk.index."""

    def __init__(self, n: int):
        self.builders = [ResultBuilder() for _ in range(max(1, n))]

    def add(self, chunk: Chunk):
        self.builders[chunk.index].add(chunk)

    def results(self):
        return [b.result() for b in self.builders]
