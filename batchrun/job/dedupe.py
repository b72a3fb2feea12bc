"""Identical rows computed once: the same rendered prompt token ids and the same deterministic sampling.

A request is deterministic when it is greedy (temperature 0; its seed changes nothing then) or carries an
explicit seed (the engine's per-request generator gives the same tokens whatever shares the batch). Such
a request's key is a hash of its token ids and its SamplingParams. The first request with a key runs in
the engine (the leader); one arriving while the leader runs waits for it (a follower); one arriving after
the leader finished takes the cached output. The output object is given to every such row; the runner
marks those rows `shared` and each keeps its own id, passthrough columns and token counts.

Only the engine's work is shared: each row is still committed with its own unit, through the same
ledger, so a crash anywhere (a leader committed, its followers' units not yet) leaves the followers'
units uncommitted and a resume computes them again. Nothing about sharing is persisted.

The cache of finished outputs (for rows in later windows) is bounded by the tokens it holds
(CACHE_TOKENS, prompt and output), least recently used first out.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from array import array
from collections import OrderedDict
from typing import Any, Optional, Sequence

CACHE_TOKENS = 1 << 21
RUN = object()       # send the request to the engine
WAIT = object()      # an identical request is in the engine: wait for its output


_params_json: dict[int, tuple[Any, bytes]] = {}      # id(params) -> (params, its canonical JSON)


def request_key(token_ids: Sequence[int], params: Any) -> Optional[bytes]:
    """The dedupe key of a request, or None when its output is not deterministic."""
    greedy = params.temperature == 0.0
    if not greedy and params.seed is None:
        return None
    cached = _params_json.get(id(params))
    if cached is None or cached[0] is not params:
        fields = dataclasses.asdict(params)
        if greedy:
            fields["seed"] = None        # argmax ignores the generator
        cached = (params, json.dumps(fields, sort_keys=True, default=str).encode())
        if len(_params_json) > 4096:     # per-row params (OpenAI Batch): do not keep them all
            _params_json.clear()
        _params_json[id(params)] = cached
    h = hashlib.sha256(cached[1])
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class Deduper:
    """Leaders in flight, their followers, and a bounded cache of finished outputs (engine thread only)."""

    def __init__(self, cache_tokens: int = CACHE_TOKENS):
        self.cache_tokens = cache_tokens
        self.waiting: dict[bytes, list[str]] = {}      # key of a leader in flight -> follower request ids
        self.leader_key: dict[str, bytes] = {}         # leader request id -> key
        self.cache: OrderedDict[bytes, Any] = OrderedDict()
        self.cached_tokens = 0
        self.rows_shared = 0
        self.prompt_tokens_saved = 0
        self.output_tokens_saved = 0

    def admit(self, rid: str, key: Optional[bytes]):
        """RUN, WAIT, or the output a finished identical request left in the cache. key: request_key()."""
        if key is None:
            return RUN
        if key in self.waiting:
            self.waiting[key].append(rid)
            return WAIT
        out = self.cache.get(key)
        if out is not None:
            self.cache.move_to_end(key)
            self._count(out)
            return out
        self.waiting[key] = []
        self.leader_key[rid] = key
        return RUN

    def finished(self, out) -> list[str]:
        """The engine finished `out`: the request ids of the rows that share it."""
        key = self.leader_key.pop(out.request_id, None)
        if key is None:
            return []
        followers = self.waiting.pop(key)
        for _ in followers:
            self._count(out)
        size = len(out.prompt_token_ids) + len(out.token_ids)
        if size <= self.cache_tokens:
            self.cache[key] = out
            self.cached_tokens += size
            while self.cached_tokens > self.cache_tokens:
                _, old = self.cache.popitem(last=False)
                self.cached_tokens -= len(old.prompt_token_ids) + len(old.token_ids)
        return followers

    def _count(self, out) -> None:
        self.rows_shared += 1
        if out.finish_reason != "error":
            self.prompt_tokens_saved += len(out.prompt_token_ids)
            self.output_tokens_saved += len(out.token_ids)

    def stats(self) -> dict[str, int]:
        return {"rows_shared": self.rows_shared, "prompt_tokens_saved": self.prompt_tokens_saved,
                "output_tokens_saved": self.output_tokens_saved}


def shared_stats(shared: Sequence[bool], prompt_tokens: Sequence[int], output_tokens: Sequence[int]) -> dict:
    """A unit's done-marker fields: rows whose output was shared, and the tokens they did not cost."""
    idx = [i for i, s in enumerate(shared) if s]
    return {"shared_rows": len(idx), "shared_prompt_tokens": sum(prompt_tokens[i] for i in idx),
            "shared_output_tokens": sum(output_tokens[i] for i in idx)}


def dedupe_summary(markers: dict, enabled: bool) -> dict:
    """The saving over every committed unit (all attempts), from the done markers."""
    ms = markers.values()
    return {"enabled": enabled, "rows_shared": sum(int(m.get("shared_rows", 0)) for m in ms),
            "prompt_tokens_saved": sum(int(m.get("shared_prompt_tokens", 0)) for m in ms),
            "output_tokens_saved": sum(int(m.get("shared_output_tokens", 0)) for m in ms)}
