"""Drives the engine over a job's units and commits results unit by unit.

Three threads, bounded queues between them, so the engine never waits on I/O:
    reader  (background): read a window of units -> render prompts -> tokenize -> order the window
    engine  (main thread): add requests, topping up from the next window before this one drains;
                           step(); route finished outputs to their unit
    writer  (background): once every row of a unit is finished: decode, build the Arrow table,
                          Sink.commit(unit), then Ledger.mark_done(unit)
SIGTERM / SIGINT stop admission; units already complete are committed, the rest are abandoned
uncommitted (a resume redoes them), and the runner raises Interrupted (exit code 75).
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pyarrow as pa

from batchrun.connectors import ParquetSink, Unit
from batchrun.connectors.secrets import redact
from batchrun.connectors.sink import check_partition_types
# Exit codes (README: "Exit codes"), defined where the CLI can load them before torch; re-exported here.
from batchrun.errors import (EXIT_BAD_JOB, EXIT_FINGERPRINT, EXIT_INPUT, EXIT_INTERRUPTED,  # noqa: F401
                             EXIT_LOCKED, EXIT_OK, EXIT_STORAGE, EXIT_UNEXPECTED, StartupInterrupted)
from batchrun.job.commit import LockLost, lock_fence, writer_identity
from batchrun.job.dedupe import RUN, WAIT, Deduper, request_key
from batchrun.job.hooks import CRASH_ENV, CrashHook
from batchrun.job.ledger import SUCCESS, SUMMARY, FingerprintMismatch, Ledger
from batchrun.job.lock import JobLock, LockHeld
from batchrun.job.plan import JobPlan, Rendered, fingerprint_hash, length_order, render, windows
from batchrun.job.progress import EngineAccount, ProgressTracker, Publisher, bar_postfix, progress_interval
from batchrun.job.results import job_summary, result_table
from batchrun.job.spec import JobSpec

PROGRESS_INTERVAL_S = 2.0
READER_JOIN_S = 60.0      # a failed run waits this long for a unit read in flight (retries bound it)
__all__ = ["JobRunner", "Interrupted", "FingerprintMismatch", "run_job", "EXIT_OK", "EXIT_UNEXPECTED",
           "EXIT_BAD_JOB", "EXIT_INPUT", "EXIT_FINGERPRINT", "EXIT_INTERRUPTED", "EXIT_LOCKED", "LockHeld"]


class Interrupted(Exception):
    """The job stopped on a signal; committed units stay, a re-submit resumes."""


@dataclass
class _Prepared:
    """One unit read and rendered: what the collector and writer need."""
    unit: Unit
    table: pa.Table          # id + passthrough columns, input order
    rendered: Rendered


class _UnitState:
    __slots__ = ("prep", "outputs", "remaining", "shared")

    def __init__(self, prep: _Prepared):
        self.prep = prep
        self.outputs: list[Any] = [None] * prep.unit.num_rows
        self.shared: list[bool] = [False] * prep.unit.num_rows     # output computed for an identical row
        self.remaining = sum(1 for e in prep.rendered.errors if e is None)


_END = object()


class _ReaderError:
    def __init__(self, error: BaseException):
        self.error = error


class JobRunner:
    """Runs one job to completion (or to a signal) over a plan from batchrun.job.plan.make_plan.

    engine_factory(tokenizer) -> LLMEngine: injectable for embedding; default builds LLMEngine from
    the job's model and engine sections.
    """

    def __init__(self, plan: JobPlan, restart: bool = False, progress_bar: bool = True,
                 engine_factory: Optional[Callable[[Any], Any]] = None, log: Callable[[str], None] = None):
        self.plan = plan
        self.spec: JobSpec = plan.spec
        self.restart = restart
        self.progress_bar = progress_bar
        self.engine_factory = engine_factory or self._default_engine
        self.log = log or (lambda msg: print(redact(msg), file=sys.stderr, flush=True))
        self.crash = CrashHook(os.environ.get(CRASH_ENV))
        self.params = self.spec.sampling_params()
        self.stop = threading.Event()
        self.stop_reason: Optional[str] = None
        self._lock = threading.Lock()
        self._committed_rows = 0
        self._committed_units = 0
        self._committed_out_tokens = 0
        self._finished_rows = 0
        self._writer_error: Optional[BaseException] = None
        self._stop_reading = False      # the engine loop is over: the reader must not block on it
        self._starting = False          # the engine is being built (a signal raises StartupInterrupted)
        # Reported while the run goes (progress, a replica's poll from another thread), so set up front.
        self.engine_s = 0.0             # inside engine.step()
        self.loop_s = 0.0               # the engine loop's wall time
        self.idle_s = 0.0               # engine loop time spent with nothing to run, waiting for input
        self.rows_todo = 0
        self.stats: dict = {}
        self.tracker: Optional[ProgressTracker] = None
        # who writes part files and how it proves the job lock is still its run's (batchrun/job/commit.py)
        self.writer: dict = writer_identity(None)
        self.fence: Callable[[], None] = lambda: None
        self.deduper: Optional[Deduper] = None
        self.units_done_before = self.rows_done_before = 0
        self._bar_n = 0                 # rows shown on the tqdm bar so far
        self.live_progress = True       # a Publisher thread rewrites progress.json (the Ray driver: its loop)
        # rows admitted to / finished by the engine, for the ETA's credit of rows in flight (engine thread)
        self._eng = EngineAccount()
        self.memory_ledger: dict = {}
        # Hooks for a replica of a distributed run (batchrun.job.ray_runner); None in a local run.
        self.on_commit: Optional[Callable[[Unit, dict], None]] = None      # after a unit's done marker
        # read/render of a unit failed: instead of failing the job, skip it (None) or commit the returned
        # _Prepared (its rows all errors)
        self.on_unit_error: Optional[Callable[[Unit, BaseException], Optional[_Prepared]]] = None

    def _default_engine(self, tokenizer):
        from batchrun.engine.config import EngineConfig
        from batchrun.engine.engine import LLMEngine
        cfg = EngineConfig(model=self.spec.model.path, dtype=self.spec.model.dtype, **self.spec.engine_kwargs())
        return LLMEngine(cfg, tokenizer=tokenizer)

    # -- entry ---------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run the job under the output's lock; returns the summary. Raises LockHeld (another live run),
        FingerprintMismatch, Interrupted, InputError. The lock is taken before the ledger opens, so
        --restart can never reset the output under a live run."""
        self.sink = ParquetSink(self.spec.output.uri, self.spec.output.storage_options)
        self.job_lock = JobLock(self.sink, self.spec.name, log=self.log)
        # handlers first: a signal while the lock is taken or the ledger opens stops the run cleanly
        # (the lock released), instead of killing the process with the lock left behind
        old_handlers = self._install_signals()
        try:
            self.job_lock.acquire()
            self.writer = writer_identity(self.job_lock.token)      # recorded in every part file
            self.fence = lock_fence(self.job_lock, self.job_lock.token)
            self.job_lock.start_heartbeat(PROGRESS_INTERVAL_S, self._lock_lost)
            try:
                return self._run_locked()
            finally:
                self.job_lock.release()
        finally:
            self._restore_signals(old_handlers)

    def _lock_lost(self, message: str) -> None:
        self.stop_reason = message
        self.stop.set()

    def _run_locked(self) -> dict:
        spec, plan = self.spec, self.plan
        self.t_start = time.time()
        check_partition_types(plan.source.schema, spec.output.partition_by)
        self._check_stop()
        self.ledger = Ledger(self.sink)
        done = self.ledger.open(plan.fingerprint, plan.info(), restart=self.restart)
        todo = [u for u in plan.units if u.index not in done]
        self.units_done_before = len(done)
        self.rows_done_before = sum(int(m.get("rows", 0)) for m in done.values())
        self.rows_todo = sum(u.num_rows for u in todo)
        self._check_stop()
        if done:
            self.log(f"batchrun: resuming {spec.name}: {len(done)} of {len(plan.units)} units already "
                     f"committed, {len(todo)} to go")
        if not todo and self.ledger.exists(SUCCESS):
            stored = self.ledger.read_json(SUMMARY) or {}   # a finished job: report it, rewrite nothing
            return {**stored, "units_committed": 0, "units_skipped": len(done), "rows_this_run": 0}
        self.ledger.remove(SUCCESS)
        self.tracker = ProgressTracker(self.rows_todo)
        self._progress("running")        # at once: `status` names this attempt, not a killed one
        publisher = Publisher(lambda: self._progress("running"), log=self.log).start() \
            if self.live_progress else None
        try:
            if todo:
                self._run_units(todo)
            if publisher is not None:
                publisher.stop()
            if self.stop.is_set():
                self._progress("interrupted")
                self._check_stop()
            summary = self._summary()
            if spec.output.openai_jsonl:     # from the committed parts, so exactly once like them
                summary["openai_output"] = self._write_openai_output(summary["fingerprint"])
            self.ledger.finish(summary, before_success=lambda: self.crash("before_success"))
            self._progress("finished")
            return summary
        except (Interrupted, FingerprintMismatch):
            raise
        except BaseException:
            if publisher is not None:
                publisher.stop()
            self._progress("failed")
            raise
        finally:
            if publisher is not None:
                publisher.stop()

    def _check_stop(self) -> None:
        """Raise Interrupted if a signal (or a lost lock) asked this run to stop."""
        if self.stop.is_set():
            raise Interrupted(f"stopped by {self.stop_reason}: {self._committed_units} unit(s) committed "
                              f"this run; re-submit to resume")

    def _write_openai_output(self, fingerprint: str) -> str:
        from batchrun.connectors.openai_output import write_openai_output
        from batchrun.job.ledger import marker_files
        parts = [(self.sink.path(n), float(m.get("committed_at") or 0))
                 for k, m in sorted(self.ledger.done_markers().items()) for n in marker_files(k, m)]
        model = os.path.basename(self.spec.model.path.rstrip("/")) or self.spec.model.path
        return write_openai_output(self.sink, parts, model, fingerprint)

    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            if self.stop.is_set():      # a second signal: leave now, nothing half-visible stays
                if getattr(self, "job_lock", None) is not None:
                    self.job_lock.release(wait_s=2.0)
                os._exit(EXIT_INTERRUPTED)
            self.stop_reason = signal.Signals(signum).name
            self.stop.set()
            if self._starting:       # loading weights can take minutes: stop it, not just what follows
                raise StartupInterrupted(self.stop_reason)
        return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    @staticmethod
    def _restore_signals(old) -> None:
        for s, h in (old or {}).items():
            signal.signal(s, h)

    def run_units(self, feed, sink: ParquetSink, ledger: Ledger) -> None:
        """The pipeline alone, over an already-open output: no ledger.open, no summary, no signals.

        feed: an iterable of windows (lists of units), which may block while more work is coming; a
        Ray replica feeds the units its driver hands it. Fields read by _summary-like reports (engine_s,
        loop_s, idle_s, stats, committed counters) are filled in as the run goes."""
        self.t_start = time.time()
        self.sink, self.ledger = sink, ledger
        self._pipeline(feed)

    # -- the three stages -------------------------------------------------------------------------
    def _run_units(self, todo: list[Unit]) -> None:
        self._pipeline(windows(todo, self.spec.plan.window_units))

    def _pipeline(self, feed) -> None:
        """feed: an iterable of windows (lists of units)."""
        spec = self.spec
        read_q: queue.Queue = queue.Queue(maxsize=1)        # one window ready ahead of the engine
        write_q: queue.Queue = queue.Queue(maxsize=max(2, 2 * spec.plan.window_units))
        reader = threading.Thread(target=self._reader, args=(feed, read_q), name="batchrun-reader", daemon=True)
        writer = threading.Thread(target=self._writer, args=(write_q,), name="batchrun-writer", daemon=True)
        reader.start()               # reads and tokenizes while the weights load
        writer.start()
        bar = self._bar()
        try:
            self._starting = True        # a signal now stops the weight load itself (the handler raises)
            try:
                self.engine = self.engine_factory(self.plan.tokenizer)
            except StartupInterrupted:
                self._check_stop()
                raise
            finally:
                self._starting = False
            self.memory_ledger = dict(self.engine.memory_ledger)
            self._engine_loop(read_q, write_q, bar)
        finally:
            self._stop_reading = True
            # joined on every path: a reader left inside pyarrow when the interpreter exits can hang it
            reader.join(READER_JOIN_S)
            self._put(write_q, _END, force=True)
            writer.join()
            if hasattr(self, "engine"):
                self.stats = dict(self.engine.stats)
                self._sample(bar)           # the last units' commits, on the bar too
            if bar is not None:
                bar.close()
        if self._writer_error is not None:
            raise self._writer_error

    def _put(self, q: queue.Queue, item, force: bool = False) -> bool:
        """Put with a timeout loop so a stop or a dead consumer never deadlocks us."""
        while True:
            if not force and (self.stop.is_set() or self._stop_reading):
                return False
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                if force and self._writer_error is not None:
                    return False

    def _reader(self, feed, read_q: queue.Queue) -> None:
        spec, plan = self.spec, self.plan
        cols = [c for c in spec.input.columns()]
        try:
            for window in feed:
                preps = []
                for unit in window:
                    if self.stop.is_set() or self._stop_reading:
                        return
                    try:
                        table = plan.source.read(unit, cols)
                        rendered = render(spec, table, plan.tokenizer)
                    except Exception as e:   # noqa: BLE001 - a replica reports it; a local run fails
                        if self.on_unit_error is None:
                            raise
                        replacement = self.on_unit_error(unit, e)   # None: skip; a _Prepared: commit it
                        if replacement is not None:
                            preps.append(replacement)
                        continue
                    keep = [c for c in [spec.input.id_column, *spec.input.passthrough] if c]
                    preps.append(_Prepared(unit, table.select(list(dict.fromkeys(keep))), rendered))
                reqs = [(p.unit.index, i, ids, p.rendered.prompts[i],
                         (p.rendered.params[i] if p.rendered.params else None) or self.params) for p in preps
                        for i, ids in enumerate(p.rendered.token_ids) if p.rendered.errors[i] is None]
                if spec.dedupe:          # hashed here, off the engine thread
                    reqs = [(*r, request_key(r[2], r[4])) for r in reqs]
                if spec.plan.order == "length":
                    order = length_order([r[2] for r in reqs], [r[4].max_tokens for r in reqs],   # per-row limits
                                         spec.engine.block_size)
                    reqs = [reqs[i] for i in order]
                if not self._put(read_q, (preps, reqs)):
                    return
            self._put(read_q, _END)
        except BaseException as e:   # noqa: BLE001 - handed to the main thread, which re-raises
            self._put(read_q, _ReaderError(e))

    def _engine_loop(self, read_q: queue.Queue, write_q: queue.Queue, bar=None) -> None:
        eng = self.engine
        max_seqs = eng.config.max_num_seqs      # resolved: the device's default when the job leaves it
        target = 2 * max_seqs            # queued beyond the running batch, so admission never starves
        states: dict[int, _UnitState] = {}
        pending: deque = deque()
        reader_done = False
        t0 = time.perf_counter()
        last_sample = 0.0
        dd = Deduper() if self.spec.dedupe else None
        self.deduper = dd
        try:
            while not self.stop.is_set():
                if self._writer_error is not None:
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
                                self.idle_s += time.perf_counter() - w0
                        if item is _END:
                            reader_done = True
                            break
                        if isinstance(item, _ReaderError):
                            raise item.error
                        preps, reqs = item
                        for p in preps:
                            st = _UnitState(p)
                            with self._lock:     # rows that failed to render are finished already
                                self._finished_rows += p.unit.num_rows - st.remaining
                            if st.remaining == 0:        # every row failed to render
                                self._put(write_q, st, force=True)
                            else:
                                states[p.unit.index] = st
                        pending.extend(reqs)
                        continue
                    k, i, ids, prompt, params, *key = pending.popleft()
                    rid = f"{k}:{i}"
                    verdict = dd.admit(rid, key[0]) if dd is not None else RUN
                    if verdict is RUN:
                        eng.add_request(rid, ids, params, prompt=prompt)   # per-row params: openai_batch
                        self._eng.admitted(params.max_tokens)
                    elif verdict is not WAIT:        # an identical row finished earlier: its output, shared
                        self._deliver(rid, verdict, states, write_q, shared=True)
                if not eng.has_unfinished_requests():
                    if reader_done and not pending:
                        break
                    continue
                s = time.perf_counter()
                outs = eng.step()
                self.engine_s += time.perf_counter() - s
                self.crash("step")
                for out in outs:
                    self._engine_finished(out, states)
                    self._deliver(out.request_id, out, states, write_q)
                    if dd is not None:
                        followers = dd.finished(out)
                        if followers:
                            self.crash("fanout")      # computed once, not yet given to its identical rows
                        for f in followers:
                            self._deliver(f, out, states, write_q, shared=True)
                now = time.perf_counter()
                if now - last_sample >= 0.5:
                    self.loop_s = now - t0
                    self._sample(bar)
                    last_sample = now
        finally:
            self.loop_s = time.perf_counter() - t0
            self._sample(bar)

    def _engine_finished(self, out, states: dict) -> None:
        """Account an output of the engine itself (not a shared one): the ETA's in-flight credit."""
        k, _, i = out.request_id.partition(":")
        rp = states[int(k)].prep.rendered.params
        self._eng.finished(out, ((rp[int(i)] if rp else None) or self.params).max_tokens)

    def _deliver(self, rid: str, out, states: dict, write_q: queue.Queue, shared: bool = False) -> None:
        """Give row `rid` its output; a unit whose rows all have one goes to the writer."""
        k, _, i = rid.partition(":")
        st = states[int(k)]
        st.outputs[int(i)] = out
        if shared:
            st.shared[int(i)] = True
        st.remaining -= 1
        with self._lock:
            self._finished_rows += 1
        if st.remaining == 0:
            del states[int(k)]
            self._put(write_q, st, force=True)

    def _sample(self, bar) -> None:
        """Feed the progress tracker (and the bar) from counters at hand: no store I/O here."""
        tokens, credit = self._eng.generated(int(self.engine.stats.get("decode_tokens", 0)))
        with self._lock:
            fin, units = self._finished_rows, self._committed_units
        if self.tracker is None:
            self.tracker = ProgressTracker(self.rows_todo)
        self.tracker.sample(fin, tokens, credit)
        if bar is not None:
            if fin > self._bar_n:
                bar.update(fin - self._bar_n)
                self._bar_n = fin
            bar.set_postfix_str(bar_postfix(self.tracker.snapshot(), self.units_done_before + units,
                                            len(self.plan.units)), refresh=False)

    def _writer(self, write_q: queue.Queue) -> None:
        spec = self.spec
        meta = {"batchrun.job": spec.name, "batchrun.model": spec.model.path,
                "batchrun.sampling": spec.sampling.model_dump(mode="json"),
                "batchrun.fingerprint": fingerprint_hash(self.plan.fingerprint)}
        while True:
            st = write_q.get()
            if st is _END:
                return
            if self._writer_error is not None:
                continue
            try:
                table, stats = self._result_table(st)
                unit = st.prep.unit
                # parts, then a create-only done marker; None: another worker committed this unit first
                try:
                    marker = self.ledger.commit_unit(
                        unit.index, table, {**meta, "batchrun.unit": str(unit.index)},
                        {"rows": table.num_rows, **stats, "committed_at": time.time(),
                         "input": {"path": unit.path, "row_start": unit.row_start, "num_rows": unit.num_rows}},
                        partition_by=spec.output.partition_by, before_publish=lambda: self.crash("mid_write"),
                        after_publish=lambda: self.crash("after_part"), writer=self.writer, fence=self.fence,
                        log=self.log)
                except LockLost as e:       # another run took the lock over: commit nothing more
                    self._lock_lost(str(e))
                    continue
                if marker is None:
                    self.log(f"batchrun: unit {unit.index} was committed by another worker; not counted here")
                    if self.on_commit is not None:
                        self.on_commit(unit, {"rows": 0, "errors": 0, "prompt_tokens": 0, "output_tokens": 0,
                                              "committed_elsewhere": True})
                    continue
                self.crash("after_done")
                with self._lock:
                    self._committed_units += 1
                    self._committed_rows += table.num_rows
                    self._committed_out_tokens += stats["output_tokens"]
                if self.on_commit is not None:
                    self.on_commit(unit, {"rows": table.num_rows, **stats})
            except BaseException as e:   # noqa: BLE001 - surfaced by the main thread
                self._writer_error = e
                self.stop.set()
                self.stop_reason = "writer error"

    def _result_table(self, st: _UnitState) -> tuple[pa.Table, dict]:
        """The output rows of one unit, in input order, and its done-marker stats."""
        return result_table(self.spec, st.prep, st.outputs, st.shared, self.plan.tokenizer,
                            self.params.skip_special_tokens)

    # -- reporting -----------------------------------------------------------------------------
    def _bar(self):
        if not self.progress_bar:
            return None
        from tqdm import tqdm
        return tqdm(total=self.rows_todo, desc=self.spec.name, unit="row", file=sys.stderr, dynamic_ncols=True,
                    mininterval=0.5)

    def _progress(self, state: str) -> None:
        """Rewrite _batchrun/progress.json (read by `batchrun status` from any process): the tracker's
        live numbers (rows finished in the engine, tokens and tok/s over the last minute, ETA) and the
        units committed. Called by the Publisher thread every few seconds, and once per state change."""
        with self._lock:
            units, rows, otok, fin = (self._committed_units, self._committed_rows, self._committed_out_tokens,
                                      self._finished_rows)
        now = time.time()
        snap = self.tracker.snapshot() if self.tracker is not None else {}
        try:
            self.ledger.write_progress({
                **snap, "state": state, "job": self.spec.name, "pid": os.getpid(), "host": socket.gethostname(),
                "started_at": self.t_start, "updated_at": now, "elapsed_s": max(now - self.t_start, 1e-9),
                "units_total": len(self.plan.units), "units_done": self.units_done_before + units,
                "units_committed_this_run": units,
                "rows_total": self.plan.num_rows, "rows_done": self.rows_done_before + rows,
                "rows_finished": self.rows_done_before + max(fin, rows), "rows_finished_this_run": fin,
                "output_tokens_this_run": otok,
                "eta_s": snap.get("eta_s") if state == "running" else None,
                "engine_busy_fraction": self.engine_s / self.loop_s if self.loop_s > 0 else None,
                "dedupe": self.deduper.stats() if self.deduper is not None else None,
                "interval_s": progress_interval()})
        except Exception as e:   # noqa: BLE001 - progress is advisory; never fail the job for it
            self.log(f"batchrun: could not write progress: {e}")

    def _summary(self) -> dict:
        return job_summary(self)


def run_job(spec: JobSpec, restart: bool = False, progress_bar: bool = True) -> dict:
    """Plan (no weights), then run. The Python counterpart of `batchrun submit`."""
    from batchrun.job.plan import make_plan
    return JobRunner(make_plan(spec), restart=restart, progress_bar=progress_bar).run()
