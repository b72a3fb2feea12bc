"""Sequence: one request's tokens, state, block table and counters (plain Python)."""
from __future__ import annotations

import enum
import time
from typing import Any, Optional


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    __slots__ = ("request_id", "prompt", "token_ids", "num_prompt_tokens", "params", "status",
                 "num_computed_tokens", "block_table", "finish_reason", "error", "text",
                 "arrival_time", "first_scheduled_time", "first_token_time", "finish_time",
                 "generator", "num_cached_tokens", "spec", "arrival_index", "block_keys",
                 "host_blocks", "draft", "sample_index", "proc_state", "logprobs", "prompt_logprobs",
                 "grammar")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: Any,
                 prompt: Optional[str] = None, arrival_index: int = 0):
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)     # prompt + output
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0        # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_keys: list = []          # prefix-cache keys of the full blocks in block_table
        self.host_blocks: list[int] = []    # block ids in the host pool while swapped out
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.text: Optional[str] = None     # set when stop strings were checked
        self.arrival_time = time.perf_counter()
        self.arrival_index = arrival_index
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self.generator = None               # per-request torch.Generator when params.seed is set
        self.num_cached_tokens = 0          # prompt tokens served by the prefix cache
        self.spec: Any = None               # speculative-decoding state (SeqSpecState)
        self.draft: list[int] = []          # draft tokens proposed for this step
        self.sample_index = 0               # which of the request's n samples (engine/engine.py)
        self.proc_state: Any = None         # logits processors' state (engine/logits_processors.py)
        self.logprobs: Optional[list] = None         # per output token: (ids, logprobs, rank), logprobs=k
        self.prompt_logprobs: Optional[list] = None  # per prompt token from the 2nd, prompt_logprobs=k
        self.grammar: Any = None            # structured-output matcher state (engine/structured.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
