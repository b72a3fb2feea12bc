"""Continuous batching with chunked prefill, prefix-cache admission and preemption (plain Python, no torch).

Every step each running sequence's computed tokens catch up towards its total under one token
budget: a decode needs 1, a prefill takes what is left of the budget (a chunk). There are no
separate prefill and decode phases. Running sequences are served oldest first; when device blocks
run out the newest running sequence is preempted: swapped out to the host pool when it is long
enough to be worth copying and the host pool has room, recomputed otherwise. Swapped sequences
come back before any new request is admitted. Every block question goes to the KVCacheManager
(allocate_slots, swap_out, swap_in, free): the scheduler never touches a block pool.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int          # includes the draft tokens
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled or self.swap_out or self.swap_in)


class Scheduler:
    """schedule() picks a step's work; update() applies the step's sampled tokens and finishes sequences.

    eos_token_ids, max_model_len and stop_strings (seq -> True when its text now holds a stop string, which
    it then truncates) are what check_stop needs besides each sequence's own SamplingParams. A preempted
    sequence with fewer than swap_min_tokens computed tokens is recomputed rather than swapped; the
    watermark and the host swap pool belong to `kv`."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 swap_min_tokens: int = 0, eos_token_ids=(), max_model_len: Optional[int] = None,
                 stop_strings: Optional[Callable[[Sequence], bool]] = None):
        self.kv = kv
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.stop_strings = stop_strings
        # tokens proposed/accepted by speculation, decode entries and the tokens they produced
        self.counters = {"spec_proposed": 0, "spec_accepted": 0, "decode_entries": 0, "decode_tokens": 0}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.swap_min_tokens = swap_min_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.recomputed_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def schedule(self) -> SchedulerOutput:
        """One step's work: swap-ins first, then every running sequence oldest first (preempting the newest
        when blocks run out), then new admissions while the token budget lasts and nothing gave way."""
        out = SchedulerOutput()
        self._swap_in(out)
        budget = self.max_num_batched_tokens
        kv = self.kv
        allocate_slots = kv.allocate_slots
        running = self.running
        scheduled = out.scheduled
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = len(seq.token_ids) - seq.num_computed_tokens
            draft = seq.draft
            # drafts are optional: never preempt or chunk for them
            if draft and n + len(draft) <= budget and allocate_slots(seq, n, len(draft)) is not None:
                n += len(draft)
            else:
                draft = []
                if n > budget:
                    n = budget
                preempted_self = False
                while allocate_slots(seq, n) is None:
                    victim = running.pop()           # newest; never one already scheduled (index < i)
                    self._preempt(victim, out)
                    if victim is seq:
                        preempted_self = True
                        break
                if preempted_self:
                    break
            scheduled.append(ScheduledSeq(seq, n, draft))
            seq.draft = []
            budget -= n
            i += 1

        # admit new work only when nothing had to give way and nothing waits to swap back in
        while (not out.preempted and not self.swapped and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]                        # its table is empty: preemption freed it
            in_flight = lambda cached: self._prefix_in_flight(seq, cached)  # noqa: E731
            if kv.allocate_slots(seq, budget, wait_for_prefix=in_flight) is None:
                break
            self.waiting.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)   # past its cached prefix
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _prefix_in_flight(self, seq: Sequence, num_cached: int) -> bool:
        """True when a running sequence is still prefilling the block seq would hit next, after the
        num_cached tokens the prefix cache holds."""
        bs = self.kv.block_size
        if (seq.num_tokens - 1) // bs <= num_cached // bs:
            return False
        hi = num_cached + bs
        for other in self.running:
            if (other.num_computed_tokens < hi <= other.num_prompt_tokens
                    and other.token_ids[:hi] == seq.token_ids[:hi]):
                return True
        return False

    def _swap_in(self, out: SchedulerOutput) -> None:
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            pairs = self.kv.swap_in(seq)
            if pairs is None:
                break
            self.swapped.popleft()
            out.swap_in.extend(pairs)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.draft = []
        out.preempted.append(seq)
        self.num_preemptions += 1
        if seq.num_computed_tokens >= self.swap_min_tokens:
            pairs = self.kv.swap_out(seq)
            if pairs is not None:
                out.swap_out.extend(pairs)
                seq.status = SeqStatus.SWAPPED
                self.swapped.appendleft(seq)
                return
        # recompute: drop the KV, keep the tokens; it re-prefills prompt + output when readmitted
        self.recomputed_tokens += seq.num_computed_tokens
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def update(self, out: SchedulerOutput, sampled: dict[int, list[int]], now: float) -> list[Sequence]:
        """Apply one executed step: sampled maps id(entry) to its new tokens (the accepted drafts, then the
        model's own token) for every entry that reached its sequence's end. Computed tokens advance, tokens
        are appended up to a stop, rejected drafts' slots are trimmed, full blocks are published to the
        prefix cache, finished sequences are released. Returns the sequences that finished."""
        finished = []
        kv, c = self.kv, self.counters
        for e in out.scheduled:
            seq = e.seq
            tokens = sampled.get(id(e))
            if tokens is None:                      # a prefill chunk short of the end
                seq.num_computed_tokens += e.num_new_tokens
                kv.publish_full_blocks(seq)
                continue
            # K/V are valid for the fed tokens up to the last accepted draft
            seq.num_computed_tokens += e.num_new_tokens - len(e.draft) + len(tokens) - 1
            if e.draft:
                c["spec_proposed"] += len(e.draft)
                c["spec_accepted"] += len(tokens) - 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            elif e.num_new_tokens - len(e.draft) == 1:
                c["decode_entries"] += 1
                c["decode_tokens"] += len(tokens)
            reason = None
            for token in tokens:
                seq.token_ids.append(token)
                reason = self.check_stop(seq, token)
                if reason:
                    break
            if reason:
                self.finish(seq, reason)
                seq.finish_time = now
                finished.append(seq)
                continue
            if e.draft:
                kv.trim(seq, seq.num_tokens)       # release the slots of rejected drafts
            kv.publish_full_blocks(seq)
        self.remove_finished()
        return finished

    def check_stop(self, seq: Sequence, token: int) -> Optional[str]:
        """"stop" (a stop token, EOS unless ignored, a stop string), "length" (max_tokens or the model's
        length), or None to go on; `token` was just appended."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if p.stop and self.stop_strings is not None and seq.num_output_tokens >= p.min_tokens \
                and self.stop_strings(seq):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or (self.max_model_len is not None
                                                     and seq.num_tokens >= self.max_model_len):
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str, error: Optional[str] = None) -> None:
        """Mark `seq` finished and release its blocks; call remove_finished() once per step after."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        if seq.block_table or seq.host_blocks:
            self.kv.free(seq)

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]

    def abort(self, request_id: str) -> Optional[Sequence]:
        for queue in (self.running, self.waiting, self.swapped):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.finish(seq, "abort")
                    return seq
        return None
