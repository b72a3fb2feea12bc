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
import resource
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
from batchrun.connectors.sink import check_partition_types
from batchrun.job.ledger import SUCCESS, SUMMARY, FingerprintMismatch, Ledger
from batchrun.job.lock import JobLock, LockHeld
from batchrun.job.plan import JobPlan, Rendered, fingerprint_hash, length_order, render, windows
from batchrun.job.spec import JobSpec

# Exit codes (README: "Exit codes"). A scheduler should retry 1, 73, 74 and 75, not 2, 3 or 4.
EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_BAD_JOB = 2          # bad job file or command line
EXIT_INPUT = 3            # input or model unusable (missing column, corrupt file, unknown architecture)
EXIT_FINGERPRINT = 4      # output holds a different job's results; --restart to discard them
EXIT_LOCKED = 73          # EX_CANTCREAT: another live run holds _batchrun/lock.json; re-submit later
EXIT_STORAGE = 74         # EX_IOERR: object-store I/O failed for good (retries spent, or denied); re-submit resumes
EXIT_INTERRUPTED = 75     # EX_TEMPFAIL: SIGTERM/SIGINT; re-submit to resume

PROGRESS_INTERVAL_S = 2.0
# Engine counters copied into summary.json: batching, preemption (swap / recompute), prefix cache, speculation.
SUMMARY_ENGINE_STATS = ("steps", "tokens_per_step", "num_blocks", "peak_blocks_used", "preemptions",
                        "swapped_out_blocks", "swapped_in_blocks", "recomputed_tokens", "prefix_cache_queries",
                        "prefix_cache_hits", "prefix_cache_hit_rate", "spec_proposed", "spec_accepted",
                        "spec_acceptance_rate", "mean_tokens_per_decode_step")
CRASH_ENV = "BATCHRUN_TEST_CRASH_AT"

__all__ = ["JobRunner", "Interrupted", "FingerprintMismatch", "run_job", "EXIT_OK", "EXIT_UNEXPECTED",
           "EXIT_BAD_JOB", "EXIT_INPUT", "EXIT_FINGERPRINT", "EXIT_INTERRUPTED", "EXIT_LOCKED", "LockHeld"]


class Interrupted(Exception):
    """The job stopped on a signal; committed units stay, a re-submit resumes."""


class _CrashHook:
    """Test hook: BATCHRUN_TEST_CRASH_AT=point:n SIGKILLs this process the n-th time `point` is reached.
    Points: step (after an engine step), mid_write (part bytes written, not yet published), after_part
    (published, no done marker yet), after_done (marker written), before_success (summary written)."""

    def __init__(self, value: Optional[str]):
        self.point, self.n, self.count = None, 1, 0
        if value:
            point, _, n = value.partition(":")
            self.point, self.n = point, int(n or 1)
        self.lock = threading.Lock()

    def __call__(self, point: str) -> None:
        if point != self.point:
            return
        with self.lock:
            self.count += 1
            if self.count >= self.n:
                os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class _Prepared:
    """One unit read and rendered: what the collector and writer need."""
    unit: Unit
    table: pa.Table          # id + passthrough columns, input order
    rendered: Rendered


class _UnitState:
    __slots__ = ("prep", "outputs", "remaining")

    def __init__(self, prep: _Prepared):
        self.prep = prep
        self.outputs: list[Any] = [None] * prep.unit.num_rows
        self.remaining = sum(1 for e in prep.rendered.errors if e is None)


_END = object()


class _ReaderError:
    def __init__(self, error: BaseException):
        self.error = error


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.crash = _CrashHook(os.environ.get(CRASH_ENV))
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
        # Reported while the run goes (progress, a replica's poll from another thread), so set up front.
        self.engine_s = 0.0             # inside engine.step()
        self.loop_s = 0.0               # the engine loop's wall time
        self.idle_s = 0.0               # engine loop time spent with nothing to run, waiting for input
        self.rows_todo = 0
        self.stats: dict = {}
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
        self.job_lock.acquire()
        self.job_lock.start_heartbeat(PROGRESS_INTERVAL_S, self._lock_lost)
        try:
            return self._run_locked()
        finally:
            self.job_lock.release()

    def _lock_lost(self, message: str) -> None:
        self.stop_reason = message
        self.stop.set()

    def _run_locked(self) -> dict:
        spec, plan = self.spec, self.plan
        self.t_start = time.time()
        check_partition_types(plan.source.schema, spec.output.partition_by)
        self.ledger = Ledger(self.sink)
        done = self.ledger.open(plan.fingerprint, plan.info(), restart=self.restart)
        todo = [u for u in plan.units if u.index not in done]
        self.units_done_before = len(done)
        self.rows_done_before = sum(int(m.get("rows", 0)) for m in done.values())
        self.rows_todo = sum(u.num_rows for u in todo)
        if done:
            self.log(f"batchrun: resuming {spec.name}: {len(done)} of {len(plan.units)} units already "
                     f"committed, {len(todo)} to go")
        if not todo and self.ledger.exists(SUCCESS):
            stored = self.ledger.read_json(SUMMARY) or {}   # a finished job: report it, rewrite nothing
            return {**stored, "units_committed": 0, "units_skipped": len(done), "rows_this_run": 0}
        self.ledger.remove(SUCCESS)
        old_handlers = self._install_signals()
        try:
            if todo:
                self._run_units(todo)
            if self.stop.is_set():
                self._progress("interrupted")
                raise Interrupted(f"stopped by {self.stop_reason}: {self._committed_units} unit(s) committed "
                                  f"this run; re-submit to resume")
            summary = self._summary()
            if spec.output.openai_jsonl:     # from the committed parts, so exactly once like them
                summary["openai_output"] = self._write_openai_output(summary["fingerprint"])
            self.ledger.finish(summary, before_success=lambda: self.crash("before_success"))
            self._progress("finished")
            return summary
        except (Interrupted, FingerprintMismatch):
            raise
        except BaseException:
            self._progress("failed")
            raise
        finally:
            self._restore_signals(old_handlers)

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
        try:
            self.engine = self.engine_factory(self.plan.tokenizer)
            self.memory_ledger = dict(self.engine.memory_ledger)
            self._engine_loop(read_q, write_q)
        finally:
            self._stop_reading = True
            self._put(write_q, _END, force=True)
            writer.join()
            if hasattr(self, "engine"):
                self.stats = dict(self.engine.stats)
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
                if spec.plan.order == "length":
                    order = length_order([r[2] for r in reqs], self.params.max_tokens, spec.engine.block_size)
                    reqs = [reqs[i] for i in order]
                if not self._put(read_q, (preps, reqs)):
                    return
            self._put(read_q, _END)
        except BaseException as e:   # noqa: BLE001 - handed to the main thread, which re-raises
            self._put(read_q, _ReaderError(e))

    def _engine_loop(self, read_q: queue.Queue, write_q: queue.Queue) -> None:
        eng = self.engine
        max_seqs = self.spec.engine.max_num_seqs
        target = 2 * max_seqs            # queued beyond the running batch, so admission never starves
        states: dict[int, _UnitState] = {}
        pending: deque = deque()
        reader_done = False
        bar = self._bar()
        t0 = time.perf_counter()
        last_progress = last_bar = 0.0
        finished_since_bar = 0
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
                            if st.remaining == 0:        # every row failed to render
                                self._put(write_q, st, force=True)
                            else:
                                states[p.unit.index] = st
                        pending.extend(reqs)
                        continue
                    k, i, ids, prompt, params = pending.popleft()
                    eng.add_request(f"{k}:{i}", ids, params, prompt=prompt)   # per-row params: openai_batch
                if not eng.has_unfinished_requests():
                    if reader_done and not pending:
                        break
                    continue
                s = time.perf_counter()
                outs = eng.step()
                self.engine_s += time.perf_counter() - s
                self.crash("step")
                for out in outs:
                    k, _, i = out.request_id.partition(":")
                    st = states[int(k)]
                    st.outputs[int(i)] = out
                    st.remaining -= 1
                    if st.remaining == 0:
                        del states[int(k)]
                        self._put(write_q, st, force=True)
                finished_since_bar += len(outs)
                now = time.perf_counter()
                if now - last_bar >= 0.5 and finished_since_bar:
                    self._count_finished(finished_since_bar, bar, now - t0)
                    finished_since_bar, last_bar = 0, now
                if now - last_progress >= PROGRESS_INTERVAL_S:
                    self.loop_s = now - t0
                    self._progress("running")
                    last_progress = now
        finally:
            self.loop_s = time.perf_counter() - t0
            self._count_finished(finished_since_bar, bar, self.loop_s)
            if bar is not None:
                bar.close()

    def _count_finished(self, n: int, bar, elapsed: float) -> None:
        with self._lock:
            self._finished_rows += n
        if bar is not None and n:
            bar.update(n)
            bar.set_postfix_str(f"{self.engine.stats['output_tokens'] / max(elapsed, 1e-9):.0f} tok/s",
                                refresh=False)

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
                marker = self.ledger.commit_unit(
                    unit.index, table, {**meta, "batchrun.unit": str(unit.index)},
                    {"rows": table.num_rows, **stats, "committed_at": time.time(),
                     "input": {"path": unit.path, "row_start": unit.row_start, "num_rows": unit.num_rows}},
                    partition_by=spec.output.partition_by, before_publish=lambda: self.crash("mid_write"),
                    after_publish=lambda: self.crash("after_part"))
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
        """The output rows of one unit, in input order (DESIGN.md's schema)."""
        spec, prep, outs = self.spec, st.prep, st.outputs
        r = prep.rendered
        n = prep.unit.num_rows
        tok = self.plan.tokenizer
        todo = [o for o in outs if o is not None and o.text is None and o.finish_reason != "error"]
        if todo:
            texts = tok.decode_batch([o.token_ids for o in todo], skip_special_tokens=self.params.skip_special_tokens)
            for o, t in zip(todo, texts):
                o.text = t
        output, reason, error, ptok, otok = [], [], [], [], []
        for i in range(n):
            o = outs[i]
            if o is None:
                output.append(None); reason.append("error"); error.append(r.errors[i])
                ptok.append(0); otok.append(0)
            elif o.finish_reason == "error":
                output.append(None); reason.append("error"); error.append(o.error or "error")
                ptok.append(len(o.prompt_token_ids)); otok.append(0)
            else:
                output.append(o.text); reason.append(o.finish_reason); error.append(None)
                ptok.append(len(o.prompt_token_ids)); otok.append(len(o.token_ids))
        if spec.input.id_column:
            ids = prep.table.column(spec.input.id_column)
        else:
            ids = pa.array(range(prep.unit.first_row, prep.unit.first_row + n), pa.int64())
        cols = {"id": ids, "output": pa.array(output, pa.string()), "finish_reason": pa.array(reason, pa.string()),
                "error": pa.array(error, pa.string()), "prompt_tokens": pa.array(ptok, pa.int32()),
                "output_tokens": pa.array(otok, pa.int32())}
        for c in spec.input.passthrough:
            cols[c] = prep.table.column(c)
        if spec.output.include_prompt:
            cols["prompt"] = pa.array(r.prompts, pa.string())
        stats = {"errors": reason.count("error"), "prompt_tokens": sum(ptok), "output_tokens": sum(otok)}
        return pa.table(cols), stats

    # -- reporting -----------------------------------------------------------------------------
    def _bar(self):
        if not self.progress_bar:
            return None
        from tqdm import tqdm
        return tqdm(total=self.rows_todo, desc=self.spec.name, unit="row", file=sys.stderr, dynamic_ncols=True,
                    mininterval=0.5)

    def _progress(self, state: str) -> None:
        """Rewrite _batchrun/progress.json (read by `batchrun status` from any process)."""
        with self._lock:
            units, rows, otok, fin = (self._committed_units, self._committed_rows, self._committed_out_tokens,
                                      self._finished_rows)
        elapsed = max(time.time() - self.t_start, 1e-9)
        rate = fin / self.loop_s if self.loop_s > 0 else 0.0
        remaining = self.rows_todo - rows
        try:
            self.ledger.write_progress({
                "state": state, "job": self.spec.name, "pid": os.getpid(), "host": socket.gethostname(),
                "started_at": self.t_start, "updated_at": time.time(), "elapsed_s": elapsed,
                "units_total": len(self.plan.units), "units_done": self.units_done_before + units,
                "rows_total": self.plan.num_rows, "rows_done": self.rows_done_before + rows,
                "rows_finished_this_run": fin, "output_tokens_this_run": otok,
                "rows_per_s": rate, "output_tokens_per_s": otok / elapsed,
                "eta_s": remaining / rate if rate > 0 and state == "running" else None,
                "engine_busy_fraction": self.engine_s / self.loop_s if self.loop_s > 0 else None,
                "interval_s": PROGRESS_INTERVAL_S})
        except Exception as e:   # noqa: BLE001 - progress is advisory; never fail the job for it
            self.log(f"batchrun: could not write progress: {e}")

    def _summary(self) -> dict:
        markers = self.ledger.done_markers()
        wall = time.time() - self.t_start
        rows_run = self._committed_rows
        st = self.stats
        return {
            "ok": True, "job": self.spec.name, "state": "finished", "output": self.sink.url,
            "units": len(self.plan.units), "units_committed": self._committed_units,
            "units_skipped": self.units_done_before,
            "rows": sum(int(m.get("rows", 0)) for m in markers.values()),
            "error_rows": sum(int(m.get("errors", 0)) for m in markers.values()),
            "prompt_tokens": sum(int(m.get("prompt_tokens", 0)) for m in markers.values()),
            "output_tokens": sum(int(m.get("output_tokens", 0)) for m in markers.values()),
            "rows_this_run": rows_run, "wall_s": round(wall, 3),
            "rows_per_s": round(rows_run / wall, 2) if wall > 0 else None,
            "output_tokens_per_s": round(self._committed_out_tokens / wall, 2) if wall > 0 else None,
            "engine_loop_s": round(self.loop_s, 3), "engine_step_s": round(self.engine_s, 3),
            "engine_busy_fraction": round(self.engine_s / self.loop_s, 4) if self.loop_s > 0 else None,
            "engine": {k: st[k] for k in SUMMARY_ENGINE_STATS if k in st},
            "memory_ledger": self.memory_ledger, "peak_rss_bytes": _peak_rss(),
            "fingerprint": fingerprint_hash(self.plan.fingerprint),
        }


def run_job(spec: JobSpec, restart: bool = False, progress_bar: bool = True) -> dict:
    """Plan (no weights), then run. The Python counterpart of `batchrun submit`."""
    from batchrun.job.plan import make_plan
    return JobRunner(make_plan(spec), restart=restart, progress_bar=progress_bar).run()
