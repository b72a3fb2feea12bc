"""A Ray replica of a job: one actor, one engine (weights loaded once), a UnitPipeline fed by the driver.

The driver (job/ray_runner.py) assigns units a few at a time; the replica's feed hands them to the
pipeline's reader in windows, blocking while more may come. Results go through the same sink and ledger
as a local run (UnitCommitter: part file, then a create-only done marker, each checked against the
driver's job lock), so a unit is committed at most once whoever finishes it. A unit whose input fails is
reported to the driver (it retries it elsewhere); on its last attempt, or when the driver gave up on it,
its rows are committed as error rows. Imported only on Ray workers and by the Ray driver.
"""
from __future__ import annotations

import collections
import os
import socket
import sys
import threading
import time
from typing import Any, Optional

import pyarrow as pa

from batchrun.connectors import InputError, ParquetSink, Unit
from batchrun.job.commit import UnitCommitter, lock_fence, writer_identity
from batchrun.job.hooks import CRASH_ENV, CrashHook
from batchrun.job.ledger import Ledger
from batchrun.job.lock import JobLock
from batchrun.job.pipeline import Prepared, UnitPipeline, default_engine
from batchrun.job.plan import Rendered, fingerprint_hash, make_plan
from batchrun.job.spec import JobSpec


class _UnitFailed(Exception):
    """The driver gave up on this unit: commit its rows as errors with this message."""


class _DirectedSource:
    """The plan's source, except that units the driver gave up on fail with the driver's message (so
    they take the reader's error path and become error rows without touching possibly-poisonous input)."""

    def __init__(self, inner, give_up: dict[int, str]):
        self._inner, self._give_up = inner, give_up

    def read(self, unit: Unit, columns):
        msg = self._give_up.get(unit.index)
        if msg is not None:
            raise _UnitFailed(msg)
        return self._inner.read(unit, columns)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class ReplicaWorker:
    """One engine replica. Wrapped with ray.remote by the driver (threaded: max_concurrency > 1), so
    poll/assign/steal are answered while run() drives the engine.

    assign(items): [(unit, directive)]; directive None, "last" (if the input fails again, commit error
    rows) or ("fail", message) (commit error rows without reading the prompts)."""

    def __init__(self, spec: JobSpec, fingerprint: str, index: int, threads: int, lock_token: Optional[str] = None):
        self.index = index
        self.init_error: Optional[BaseException] = None
        self.lock_token = lock_token          # the driver's job lock: commits check it is still held
        try:
            self._setup(spec, fingerprint, threads)
        except Exception as e:   # noqa: BLE001 - raised by info(): a bad node fails the job, not restarts
            self.init_error = e

    def _setup(self, spec: JobSpec, fingerprint: str, threads: int) -> None:
        import torch
        torch.set_num_threads(max(1, threads))
        t0 = time.perf_counter()
        index = self.index
        plan = make_plan(spec, stage_input=False)     # input.sql: the driver staged it; only read it here
        got = fingerprint_hash(plan.fingerprint)
        if got != fingerprint:
            raise InputError(f"replica {index} on {socket.gethostname()} sees a different job than the "
                               f"driver (fingerprint {got} != {fingerprint}): every node must read the same "
                               f"model directory ({spec.model.path}) and input ({spec.input.uri})")
        self.plan = plan
        self.give_up: dict[int, str] = {}
        self.last_attempt: set[int] = set()
        self.inner_source = plan.source
        plan.source = _DirectedSource(plan.source, self.give_up)
        self.stop_event = threading.Event()
        self.sink = ParquetSink(spec.output.uri, spec.output.storage_options)
        self.ledger = Ledger(self.sink)
        log = lambda m: print(m, file=sys.stderr)  # noqa: E731
        crash = CrashHook(os.environ.get(CRASH_ENV))
        # parts record the driver's lock token; each commit checks the driver still holds the lock
        committer = UnitCommitter(self.ledger, writer_identity(self.lock_token),
                                  lock_fence(JobLock(self.sink), self.lock_token), crash, log)
        self.engine = default_engine(spec, plan.tokenizer, plan)      # the weights, once per actor
        self.pipeline = UnitPipeline(plan, lambda tokenizer: self.engine, committer, self.stop_event,
                                     self._request_stop, crash=crash, log=log, on_commit=self._committed,
                                     on_unit_error=self._unit_error)
        self.load_s = time.perf_counter() - t0
        self.cv = threading.Condition()
        self.local: collections.deque = collections.deque()
        self.finished = False
        self.events: list[tuple] = []

    # -- driver calls ------------------------------------------------------------------------------
    def info(self) -> dict:
        """Where this replica runs; answering means the weights are loaded."""
        import ray
        if self.init_error is not None:      # its own type, so the CLI maps it to the usual exit code
            raise self.init_error
        return {"replica": self.index, "pid": os.getpid(), "host": socket.gethostname(),
                "node_ip": ray.util.get_node_ip_address(), "load_s": round(self.load_s, 3),
                "memory_ledger": dict(self.engine.memory_ledger)}

    def run(self) -> dict:
        """Drive the engine over whatever the driver assigns until finish() or stop(); returns the final
        stats and any events not yet polled."""
        self.pipeline.run(self._feed())
        with self.cv:
            events, self.events = self.events, []
        return {"stats": self._stats(), "events": events}

    def assign(self, items: list[tuple[Unit, Any]]) -> None:
        with self.cv:
            for unit, directive in items:
                if isinstance(directive, tuple) and directive[0] == "fail":
                    self.give_up[unit.index] = directive[1]
                elif directive == "last":
                    self.last_attempt.add(unit.index)
                self.local.append(unit)
            self.cv.notify_all()

    def steal(self, n: int) -> list[Unit]:
        """Give back up to n assigned units the reader has not taken yet (the driver re-queues them)."""
        with self.cv:
            out = [self.local.pop() for _ in range(min(n, len(self.local)))]
            return out[::-1]

    def poll(self, timeout: float) -> dict:
        """Events since the last poll (commits, unit failures) and live stats; waits up to `timeout`
        for an event."""
        with self.cv:
            if not self.events:
                self.cv.wait(timeout)
            events, self.events = self.events, []
        return {"stats": self._stats(), "events": events}

    def finish(self) -> None:
        """No more units: run() returns once the assigned ones are committed."""
        with self.cv:
            self.finished = True
            self.cv.notify_all()

    def stop(self) -> None:
        """Stop now (the driver got SIGTERM/SIGINT): complete units are committed, the rest abandoned."""
        self._request_stop("driver stop")
        self.finish()

    # -- inside the replica ------------------------------------------------------------------------
    def _feed(self):
        """Windows for the reader: up to plan.window_units of the units assigned so far; blocks while
        the driver has more to give."""
        w = self.plan.spec.plan.window_units
        p = self.pipeline
        while True:
            with self.cv:
                while not self.local and not self.finished and not p.stop.is_set() and not p.stop_reading:
                    self.cv.wait(0.2)
                if not self.local or p.stop.is_set():
                    return
                window = [self.local.popleft() for _ in range(min(w, len(self.local)))]
            yield window

    def _request_stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.stop_event.set()

    def _committed(self, unit: Unit, info: dict) -> None:
        with self.cv:
            self.events.append(("commit", unit.index, info))
            self.cv.notify_all()

    def _unit_error(self, unit: Unit, e: BaseException) -> Optional[Prepared]:
        msg = str(e) if isinstance(e, _UnitFailed) else f"{type(e).__name__}: {e}"
        if isinstance(e, _UnitFailed) or unit.index in self.last_attempt:
            return self._error_prep(unit, msg)
        with self.cv:
            self.events.append(("error", unit.index, msg))
            self.cv.notify_all()
        return None

    def _error_prep(self, unit: Unit, msg: str) -> Prepared:
        """Every row of `unit` as an error row; ids and passthrough columns read alone if they can be."""
        spec = self.plan.spec
        keep = list(dict.fromkeys(c for c in [spec.input.id_column, *spec.input.passthrough] if c))
        n = unit.num_rows
        table = None
        if keep:
            try:
                table = self.inner_source.read(unit, keep).select(keep)
                if table.num_rows != n:
                    table = None
            except Exception:   # noqa: BLE001 - the id column is unreadable too: nulls of its type
                table = None
            if table is None:
                schema = self.inner_source.schema
                table = pa.table({c: pa.nulls(n, schema.field(c).type) for c in keep})
        else:
            table = pa.table({"_": pa.nulls(n)}).select([])
        return Prepared(unit, table, Rendered([None] * n, [None] * n, [msg] * n))

    def _stats(self) -> dict:
        p = self.pipeline
        units, rows, _, fin = p.counts()
        s = {"units_committed": units, "rows_committed": rows, "rows_finished": fin}
        for _ in range(5):
            try:
                st = dict(self.engine.stats)      # the engine thread may be adding a key right now
                break
            except RuntimeError:
                st = {}
        s.update(engine_s=p.engine_s, loop_s=p.loop_s, idle_s=p.idle_s, queued=len(self.local),
                 output_tokens=int(st.get("output_tokens", 0)),
                 engine={k: st[k] for k in st if isinstance(st[k], (int, float))})
        return s
