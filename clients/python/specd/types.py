"""Plain result types: what the SDK returns instead of protobuf messages."""

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class SpeculationStats:
    """Speculation counters of one request (see docs/metrics.md for the definitions)."""

    steps: int = 0                 # verify steps that carried a draft tree
    draft_tokens: int = 0          # draft nodes sent to verify
    accepted_tokens: int = 0       # draft tokens accepted (bonus tokens not counted)
    accepted_per_position: List[int] = field(default_factory=list)
    target_only_steps: int = 0     # verify steps without a draft
    mode: str = "auto"             # the speculation used in the end
    shape_changes: int = 0         # steps whose tree shape differed from the previous step's

    @property
    def acceptance_rate(self) -> Optional[float]:
        """accepted / draft tokens; None when no draft token was sent."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> Optional[float]:
        """Tokens emitted per speculative step, bonus included: 1 + accepted / steps."""
        return 1 + self.accepted_tokens / self.steps if self.steps else None


@dataclass(frozen=True)
class TopLogprob:
    """One alternative at a position."""

    token_id: int
    token: str  # its text alone
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target (raw: the model's log_softmax;
    processed: the distribution it was drawn from)."""

    token_id: int
    token: str
    logprob: float
    rank: int  # 1 + the number of tokens with a strictly higher log-probability
    top: List[TopLogprob] = field(default_factory=list)  # most likely first


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of a completion. finish_reason, usage and speculation are set on the
    last chunk only."""

    token_ids: List[int]
    text: str
    finish_reason: Optional[str] = None  # length, eos, stop_token, stop_string, context
    usage: Optional[Usage] = None
    speculation: Optional[SpeculationStats] = None
    matched_stop: Optional[str] = None
    logprobs: List[TokenLogprob] = field(default_factory=list)  # one per token id, if asked
    index: int = 0  # which of the request's n samples


@dataclass(frozen=True)
class GenerateResult:
    text: str
    token_ids: List[int]
    finish_reason: str
    usage: Usage
    speculation: SpeculationStats
    matched_stop: Optional[str] = None
    logprobs: List[TokenLogprob] = field(default_factory=list)
    index: int = 0


@dataclass(frozen=True)
class ModelInfo:
    target_model: str
    draft_model: str
    vocab_size: int
    max_context: int
    eos_token_ids: List[int]
    max_new_tokens_limit: int
    draft_available: bool
    # Whether the verify service's backend serves logprobs, and min_p, logit_bias, min_tokens
    # and the penalties (a request for one it lacks fails with UNIMPLEMENTED naming the field).
    supports_logprobs: bool = False
    supports_logits_processors: bool = False
    # Whether the router's model folder has a chat template, and where: "chat_template.jinja" or
    # "tokenizer_config.json" ("" without one). The router does not render it.
    has_chat_template: bool = False
    chat_template_source: str = ""
    # The speculation modes a request can get now, by name ("auto", "off" and "ngram" always;
    # "draft_model" and "eagle3" while a draft service that has them is up). An unavailable
    # mode is not refused: the request runs target-only, with the same output.
    speculation_modes: List[str] = field(default_factory=list)
