"""Prompt-lookup (n-gram) speculative decoding: the proposer and its adaptive switches (plain Python).

For a decoding sequence, the most recent earlier occurrence of its last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) in its own prompt + output is found, and the up to
k tokens that followed it are proposed. Each sequence keeps a hash index per n-gram size that is
extended by the tokens appended since its last proposal, so a proposal costs O(n_max) dictionary
look-ups however long the history is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class SpecConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: Optional[int] = 32   # no proposals when more sequences decode in a step
    min_acceptance: float = 0.1                 # a sequence below this stops proposing...
    warmup_proposals: int = 16                  # ...once it has had this many draft tokens checked

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> Optional["SpecConfig"]:
        if not d:
            return None
        d = dict(d)
        method = d.pop("method", "ngram")
        if method != "ngram":
            raise ValueError(f"speculative_config.method {method!r}: only 'ngram' (prompt lookup) is supported")
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size", "min_acceptance", "warmup_proposals"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        k = int(d.pop("num_speculative_tokens", 0))
        if k < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be >= 1")
        n_max = int(d.pop("prompt_lookup_max", 4))
        n_min = int(d.pop("prompt_lookup_min", n_max))
        if not 1 <= n_min <= n_max:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min ({n_min}) "
                             f"<= prompt_lookup_max ({n_max})")
        return cls(k, n_max, n_min, **d)


@dataclass
class SeqSpecState:
    index: list[dict[tuple, int]] = field(default_factory=list)   # per n: n-gram -> end position
    indexed: int = 0          # n-grams ending before this position are in the index
    proposed: int = 0
    accepted: int = 0
    enabled: bool = True


class NgramProposer:
    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.sizes = list(range(cfg.prompt_lookup_max, cfg.prompt_lookup_min - 1, -1))

    def _extend(self, st: SeqSpecState, tokens: list[int]) -> None:
        # index n-grams ending at positions [st.indexed, len - 1): each has a follower token
        if not st.index:
            st.index = [dict() for _ in self.sizes]
        end = len(tokens) - 1
        for e in range(st.indexed, end):
            for n, idx in zip(self.sizes, st.index):
                if e + 1 >= n:
                    idx[tuple(tokens[e + 1 - n:e + 1])] = e     # later positions overwrite: most recent wins
        st.indexed = max(st.indexed, end)

    def propose(self, st: SeqSpecState, tokens: list[int], max_len: int) -> list[int]:
        """Up to min(k, max_len) draft tokens continuing `tokens`, or [] when no n-gram recurs."""
        k = min(self.cfg.num_speculative_tokens, max_len)
        if k <= 0 or not st.enabled:
            return []
        self._extend(st, tokens)
        L = len(tokens)
        for n, idx in zip(self.sizes, st.index):
            if L < n:
                continue
            e = idx.get(tuple(tokens[L - n:]))
            if e is not None:
                return tokens[e + 1:e + 1 + k]
        return []

    def record(self, st: SeqSpecState, proposed: int, accepted: int) -> None:
        st.proposed += proposed
        st.accepted += accepted
        cfg = self.cfg
        if st.proposed >= cfg.warmup_proposals and st.accepted < cfg.min_acceptance * st.proposed:
            st.enabled = False
