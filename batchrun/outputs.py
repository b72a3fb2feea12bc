"""Request-level types shared by the engine and the Python API: SamplingParams and RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


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
        if self.n != 1:
            raise ValueError("n > 1 is not supported yet; submit the prompt n times with different seeds")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    output_tokens: int = 0
    queued_s: float = 0.0          # arrival -> first scheduled
    first_token_s: Optional[float] = None  # arrival -> first output token
    total_s: float = 0.0           # arrival -> finished


@dataclass
class RequestOutput:
    """The result of one request. finish_reason is "stop", "length" or "error"."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    text: Optional[str]
    token_ids: list[int]
    finish_reason: str
    error: Optional[str] = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
