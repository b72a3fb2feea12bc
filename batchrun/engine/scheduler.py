"""Continuous batching with chunked prefill and preemption (plain Python, no torch).

Every step each running sequence's computed tokens catch up towards its total under one token
budget: a decode needs 1, a prefill takes what is left of the budget (a chunk). There are no
separate prefill and decode phases. Running sequences are served oldest first; when blocks run
out the newest running sequence is preempted and recomputed later.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 watermark: float = 0.01):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * kv.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv = self.kv
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = kv.num_new_blocks(seq, seq.num_computed_tokens + n)
            preempted_self = False
            while need > kv.pool.num_free:
                victim = self.running.pop()          # newest; never one already scheduled (index < i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                break
            kv.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        # admit new work only when nothing had to give way this step
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = kv.num_new_blocks(seq, seq.num_computed_tokens + n)
            reserve = self.watermark_blocks if self.running else 0
            if not kv.can_allocate(need, reserve):
                break
            self.waiting.popleft()
            kv.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        # recompute: drop the KV, keep the tokens; it re-prefills prompt + output when readmitted
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, error: Optional[str] = None) -> None:
        """Mark `seq` finished and release its blocks; call remove_finished() once per step after."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        if seq.block_table:
            self.kv.free(seq)

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]

    def abort(self, request_id: str) -> Optional[Sequence]:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.finish(seq, "abort")
                    return seq
        return None
