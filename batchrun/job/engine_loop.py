"""The engine stage of a UnitPipeline (job/pipeline.py): admit rows, step the engine, route outputs.

Runs on the pipeline's calling thread. Keeps 2 x max_num_seqs requests queued beyond the running batch,
topping up from the next window before this one drains; identical deterministic rows are admitted once
(job/dedupe.py) and their output given to each; a unit whose rows all have an output goes to the writer.
"""
from __future__ import annotations

import queue
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchrun.connectors import Unit
from batchrun.job.dedupe import RUN, WAIT, Deduper
from batchrun.job.plan import Rendered

END = object()          # the reader's (and the writer queue's) end of input


@dataclass
class Prepared:
    """One unit read and rendered: what the engine stage and the writer need."""
    unit: Unit
    table: pa.Table          # id + passthrough columns, input order
    rendered: Rendered


class ReaderError:
    """The reader failed: carried through its queue, raised on the engine thread."""

    def __init__(self, error: BaseException):
        self.error = error


class UnitState:
    """A unit in flight: its rows' outputs so far, and how many are still missing."""
    __slots__ = ("prep", "outputs", "remaining", "shared")

    def __init__(self, prep: Prepared):
        self.prep = prep
        self.outputs: list[Any] = [None] * prep.unit.num_rows
        self.shared: list[bool] = [False] * prep.unit.num_rows     # output computed for an identical row
        self.remaining = sum(1 for e in prep.rendered.errors if e is None)


def engine_loop(p, read_q: queue.Queue, write_q: queue.Queue) -> None:
    """Drive p.engine (p: the UnitPipeline) until the reader is done and every row has its output, or a
    stop; fills p's engine_s, loop_s, idle_s, finished_rows and deduper as it goes."""
    eng = p.engine
    max_seqs = eng.config.max_num_seqs      # resolved: the device's default when the job leaves it
    target = 2 * max_seqs            # queued beyond the running batch, so admission never starves
    states: dict[int, UnitState] = {}
    pending: deque = deque()
    reader_done = False
    t0 = time.perf_counter()
    last_sample = 0.0
    dd = Deduper() if p.spec.dedupe else None
    p.deduper = dd
    try:
        while not p.stop.is_set():
            if p.writer_error is not None:
                return
            # top up from the next window before this one drains
            while eng.num_unfinished_requests() < target:
                if not pending:
                    if reader_done:
                        break
                    idle = not eng.has_unfinished_requests()
                    w0 = time.perf_counter()
                    try:
                        item = read_q.get(timeout=0.2) if idle else read_q.get_nowait()
                    except queue.Empty:
                        break
                    finally:
                        if idle:
                            p.idle_s += time.perf_counter() - w0
                    if item is END:
                        reader_done = True
                        break
                    if isinstance(item, ReaderError):
                        raise item.error
                    preps, reqs = item
                    for prep in preps:
                        st = UnitState(prep)
                        with p.lock:     # rows that failed to render are finished already
                            p.finished_rows += prep.unit.num_rows - st.remaining
                        if st.remaining == 0:        # every row failed to render
                            p.put(write_q, st, force=True)
                        else:
                            states[prep.unit.index] = st
                    pending.extend(reqs)
                    continue
                k, i, ids, prompt, params, *key = pending.popleft()
                rid = f"{k}:{i}"
                verdict = dd.admit(rid, key[0]) if dd is not None else RUN
                if verdict is RUN:
                    eng.add_request(rid, ids, params, prompt=prompt)   # per-row params: openai_batch
                    p.account.admitted(params.max_tokens * params.n)     # n samples: n x the work
                elif verdict is not WAIT:        # an identical row finished earlier: its output, shared
                    _deliver(p, rid, verdict, states, write_q, shared=True)
            if not eng.has_unfinished_requests():
                if reader_done and not pending:
                    break
                continue
            s = time.perf_counter()
            outs = eng.step()
            p.engine_s += time.perf_counter() - s
            p.crash("step")
            for out in outs:
                _engine_finished(p, out, states)
                _deliver(p, out.request_id, out, states, write_q)
                if dd is not None:
                    followers = dd.finished(out)
                    if followers:
                        p.crash("fanout")      # computed once, not yet given to its identical rows
                    for f in followers:
                        _deliver(p, f, out, states, write_q, shared=True)
            now = time.perf_counter()
            if now - last_sample >= 0.5:
                p.loop_s = now - t0
                p.sample()
                last_sample = now
    finally:
        p.loop_s = time.perf_counter() - t0
        p.sample()


def _engine_finished(p, out, states: dict) -> None:
    """Account an output of the engine itself (not a shared one): the ETA's in-flight credit."""
    k, _, i = out.request_id.partition(":")
    rp = states[int(k)].prep.rendered.params
    params = (rp[int(i)] if rp else None) or p.params
    p.account.finished(out, params.max_tokens * params.n)


def _deliver(p, rid: str, out, states: dict, write_q: queue.Queue, shared: bool = False) -> None:
    """Give row `rid` its output; a unit whose rows all have one goes to the writer."""
    k, _, i = rid.partition(":")
    st = states[int(k)]
    st.outputs[int(i)] = out
    if shared:
        st.shared[int(i)] = True
    st.remaining -= 1
    with p.lock:
        p.finished_rows += 1
    if st.remaining == 0:
        del states[int(k)]
        p.put(write_q, st, force=True)
