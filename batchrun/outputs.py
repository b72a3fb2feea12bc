"""Request-level types shared by the engine and the Python API: SamplingParams and RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from batchrun.structured_outputs import StructuredOutputsParams, as_params


@dataclass
class SamplingParams:
    """How to sample one request, with vLLM's names.

    temperature: 0 means greedy.
    top_p, top_k, min_p: nucleus, top-k (-1 or 0 disables) and min-p filtering.
    seed: per-request seed; the same seed gives the same tokens whatever shares the batch.
    max_tokens: most tokens to generate.
    stop: strings that end generation (not included in the text).
    stop_token_ids: token ids that end generation, in addition to EOS.
    ignore_eos: keep generating past EOS (benchmarks).
    include_stop_str_in_output: keep the matched stop string in the text.
    skip_special_tokens: drop special tokens when decoding the text.
    n: samples per prompt (each its own seed stream: seed + sample index); they share the prompt's
        KV blocks through the prefix cache (engine/engine.py).
    presence_penalty, frequency_penalty: in [-2, 2], subtracted once / per occurrence for each token
        already in the output. repetition_penalty: > 0; tokens in the prompt or the output have positive
        logits divided by it, negative ones multiplied (1 = off).
    logit_bias: {token id: bias} added to the logits (bias clamped to [-100, 100], as vLLM).
    min_tokens: EOS and stop_token_ids are banned (and stop strings not checked) until this many tokens.
    bad_words: words never generated: each tokenized with and without a leading space; a one-token
        word is banned always, a longer one when the output ends with all its tokens but the last.
    logprobs: k -> each sampled token's logprob, rank and the top k (0: the sampled token's alone).
    prompt_logprobs: k -> each prompt token's logprob given its prefix (the first: None) and the top k.
        Both come from the raw distribution: log_softmax of the model's logits before penalties,
        bias, temperature and filters (vLLM's default logprobs_mode raw_logprobs). k <= MAX_LOGPROBS.
    structured_outputs: a StructuredOutputsParams (or a dict of its keys): the output follows a JSON
        schema, a regex, a choice list or a grammar (engine/structured.py); no n-gram speculation for it.
    The processors run in vLLM's order: bad_words, min_tokens, logit_bias, then the penalties
    (engine/logits_processors.py).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    min_tokens: int = 0
    bad_words: Optional[list[str]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Union[dict, StructuredOutputsParams, None] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        check_penalties(self)
        self.structured_outputs = as_params(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """True when a logits processor applies (engine/logits_processors.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words)

    @property
    def plain(self) -> bool:
        """No processor and no logprobs: the runner's fast paths and n-gram speculation apply."""
        return (not self.processed and self.logprobs is None and self.prompt_logprobs is None
                and self.structured_outputs is None)


MAX_LOGPROBS = 20       # as OpenAI's top_logprobs


def check_penalties(p: SamplingParams) -> None:
    """vLLM's ranges for the penalties, biases and logprobs; normalises logit_bias and bad_words."""
    if not -2.0 <= p.presence_penalty <= 2.0:
        raise ValueError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}")
    if not -2.0 <= p.frequency_penalty <= 2.0:
        raise ValueError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}")
    if not p.repetition_penalty > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    if isinstance(p.min_tokens, bool) or not isinstance(p.min_tokens, int) or p.min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {p.min_tokens!r}")
    if p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens={p.min_tokens} must be <= max_tokens={p.max_tokens}")
    bias = {}
    for k, v in (p.logit_bias or {}).items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: key {k!r} is not a token id") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise ValueError(f"logit_bias[{k}]: the bias must be a number, got {v!r}")
        bias[tid] = max(-100.0, min(100.0, float(v)))
    p.logit_bias = bias or None
    if isinstance(p.bad_words, str):
        p.bad_words = [p.bad_words]
    if p.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in p.bad_words):
        raise ValueError("bad_words must be a list of non-empty strings")
    p.bad_words = list(p.bad_words) if p.bad_words else None
    for key in ("logprobs", "prompt_logprobs"):
        k = getattr(p, key)
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"{key} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    output_tokens: int = 0
    queued_s: float = 0.0          # arrival -> first scheduled
    first_token_s: Optional[float] = None  # arrival -> first output token
    total_s: float = 0.0           # arrival -> finished


@dataclass
class Logprob:
    """One token's log-probability under the raw distribution, its rank (1: the most likely) and text."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# per position: token id -> Logprob, the sampled (or prompt) token and the top k
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample of a request, as vLLM's: outputs[i] of a RequestOutput."""
    index: int
    text: Optional[str]
    token_ids: list[int]
    finish_reason: str
    logprobs: Optional[list[PositionLogprobs]] = None      # one dict per output token, with logprobs=k
    cumulative_logprob: Optional[float] = None


@dataclass
class RequestOutput:
    """The result of one request. finish_reason is "stop", "length" or "error".

    text, token_ids and finish_reason are the first sample's; outputs holds every sample (n of them,
    vLLM's shape: outputs[i].logprobs), prompt_logprobs one entry per prompt token (the first None)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    text: Optional[str]
    token_ids: list[int]
    finish_reason: str
    error: Optional[str] = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
