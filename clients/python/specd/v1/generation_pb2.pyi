from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor
FINISH_REASON_CONTEXT: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_UNSPECIFIED: FinishReason
LOGPROBS_SOURCE_PROCESSED: LogprobsSource
LOGPROBS_SOURCE_RAW: LogprobsSource
SPECULATION_AUTO: Speculation
SPECULATION_DRAFT_MODEL: Speculation
SPECULATION_EAGLE3: Speculation
SPECULATION_NGRAM: Speculation
SPECULATION_OFF: Speculation

class DetokenizeRequest(_message.Message):
    __slots__ = ["ids", "skip_special_tokens"]
    IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: bool = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ["text"]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ["draft_depth", "draft_max_nodes", "draft_top_k", "frequency_penalty", "ignore_eos", "logit_bias", "logprobs", "logprobs_source", "max_new_tokens", "min_p", "min_tokens", "n", "presence_penalty", "prompt", "prompt_ids", "repetition_penalty", "request_id", "seed", "speculation", "stop", "stop_token_ids", "temperature", "top_k", "top_p"]
    class LogitBiasEntry(_message.Message):
        __slots__ = ["key", "value"]
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    DRAFT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    draft_depth: int
    draft_max_nodes: int
    draft_top_k: int
    frequency_penalty: float
    ignore_eos: bool
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    logprobs_source: LogprobsSource
    max_new_tokens: int
    min_p: float
    min_tokens: int
    n: int
    presence_penalty: float
    prompt: str
    prompt_ids: TokenIds
    repetition_penalty: float
    request_id: str
    seed: int
    speculation: Speculation
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: bool = ..., speculation: _Optional[_Union[Speculation, str]] = ..., draft_depth: _Optional[int] = ..., draft_top_k: _Optional[int] = ..., draft_max_nodes: _Optional[int] = ..., request_id: _Optional[str] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., logprobs_source: _Optional[_Union[LogprobsSource, str]] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ["finish_reason", "index", "logprobs", "matched_stop", "speculation", "text", "token_ids", "usage"]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    matched_stop: str
    speculation: SpeculationStats
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    usage: Usage
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., matched_stop: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ["chat_template_source", "draft_available", "draft_model", "eos_token_ids", "has_chat_template", "max_context", "max_new_tokens_limit", "speculation_modes", "supports_logits_processors", "supports_logprobs", "target_model", "vocab_size"]
    CHAT_TEMPLATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MODES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_LOGITS_PROCESSORS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    chat_template_source: str
    draft_available: bool
    draft_model: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    max_context: int
    max_new_tokens_limit: int
    speculation_modes: _containers.RepeatedScalarFieldContainer[Speculation]
    supports_logits_processors: bool
    supports_logprobs: bool
    target_model: str
    vocab_size: int
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens_limit: _Optional[int] = ..., draft_available: bool = ..., supports_logprobs: bool = ..., supports_logits_processors: bool = ..., has_chat_template: bool = ..., chat_template_source: _Optional[str] = ..., speculation_modes: _Optional[_Iterable[_Union[Speculation, str]]] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ["accepted_per_position", "accepted_tokens", "draft_tokens", "mode", "shape_changes", "steps", "target_only_steps"]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_CHANGES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ONLY_STEPS_FIELD_NUMBER: _ClassVar[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_tokens: int
    draft_tokens: int
    mode: Speculation
    shape_changes: int
    steps: int
    target_only_steps: int
    def __init__(self, steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., target_only_steps: _Optional[int] = ..., mode: _Optional[_Union[Speculation, str]] = ..., shape_changes: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ["ids"]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ["logprob", "rank", "token", "token_id", "top_logprobs"]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    rank: int
    token: str
    token_id: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ["add_special_tokens", "text"]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    add_special_tokens: bool
    text: str
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: bool = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ["ids"]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ["logprob", "token", "token_id"]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    token: str
    token_id: int
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ["completion_tokens", "prompt_tokens"]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    completion_tokens: int
    prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Speculation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class LogprobsSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
