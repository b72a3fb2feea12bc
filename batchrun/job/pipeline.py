"""UnitPipeline: reader -> engine loop -> writer over a feed of units, each unit committed when complete.

Three threads, bounded queues between them, so the engine never waits on I/O:
    reader  (background): read a window of units -> render prompts -> tokenize -> order the window
    engine  (caller's thread): add requests, topping up from the next window before this one drains;
                               step(); route finished outputs to their unit (engine_loop.py)
    writer  (background): once every row of a unit is finished: decode, build the Arrow table, then
                          UnitCommitter.commit (part files, then the done marker)
A stop (the shared event) stops admission; units already complete are committed, the rest are
abandoned uncommitted (a resume redoes them). The pipeline knows nothing of locks, signals, the ledger's
opening or the summary: a local run (job/run.py) and a Ray replica (job/ray_replica.py) both compose it.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterable, Optional

from batchrun.connectors import Unit
from batchrun.job.commit import LockLost, UnitCommitter
from batchrun.job.dedupe import request_key
from batchrun.job.engine_loop import END, Prepared, ReaderError, engine_loop
from batchrun.job.plan import JobPlan, fingerprint_hash, length_order, render
from batchrun.job.progress import EngineAccount
from batchrun.job.results import result_table

READER_JOIN_S = 60.0      # a failed run waits this long for a unit read in flight (retries bound it)
__all__ = ["UnitPipeline", "Prepared", "default_engine", "READER_JOIN_S"]


def default_engine(spec, tokenizer, plan=None):
    """The LLMEngine a job's model and engine sections describe (loads the weights). plan: where
    quantization_calibration's rows come from (the job's first prompts, job/calibration_rows.py)."""
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import LLMEngine
    from batchrun.job.calibration_rows import job_calibration_rows
    cfg = EngineConfig(model=spec.model.path, dtype=spec.model.dtype, **spec.engine_kwargs())
    rows = job_calibration_rows(plan) if plan is not None else None
    return LLMEngine(cfg, tokenizer=tokenizer, calibration_rows=rows)


class UnitPipeline:
    """Drives one engine over units and commits each unit through `committer`.

    engine_factory(tokenizer) -> engine: called once, while the reader already reads.
    stop: set by anyone to stop admission; request_stop(reason) is how the pipeline itself asks (a lost
    lock, a writer error). on_commit(unit, info): after a unit's done marker (info["committed_elsewhere"]
    when another worker's marker won). on_unit_error(unit, error) -> None (skip the unit) or a Prepared
    to commit instead (its rows all errors); without it a unit that cannot be read fails the run.
    on_sample(): at most twice a second from the engine thread, and once at the end (progress).
    Counters (committed_*, finished_rows, engine_s, loop_s, idle_s, stats, memory_ledger, deduper) are
    public and filled in as the run goes; read the committed/finished ones under `lock`.
    """

    def __init__(self, plan: JobPlan, engine_factory: Callable[[Any], Any], committer: UnitCommitter,
                 stop: threading.Event, request_stop: Callable[[str], None],
                 crash: Callable[[str], None] = lambda point: None, log: Callable[[str], None] = lambda m: None,
                 on_commit: Optional[Callable[[Unit, dict], None]] = None,
                 on_unit_error: Optional[Callable[[Unit, BaseException], Optional[Prepared]]] = None,
                 on_sample: Optional[Callable[[], None]] = None):
        self.plan, self.spec = plan, plan.spec
        self.engine_factory, self.committer = engine_factory, committer
        self.stop, self.request_stop, self.crash, self.log = stop, request_stop, crash, log
        self.on_commit, self.on_unit_error, self.on_sample = on_commit, on_unit_error, on_sample
        self.params = self.spec.sampling_params()
        self.lock = threading.Lock()
        self.committed_units = self.committed_rows = self.committed_out_tokens = self.finished_rows = 0
        self.engine_s = 0.0             # inside engine.step()
        self.loop_s = 0.0               # the engine loop's wall time
        self.idle_s = 0.0               # engine loop time spent with nothing to run, waiting for input
        self.stats: dict = {}
        self.memory_ledger: dict = {}
        self.deduper = None
        self.engine = None
        self.starting = False           # the engine is being built: a signal handler may interrupt it
        self.stop_reading = False       # the engine loop is over: the reader must not block on it
        self.writer_error: Optional[BaseException] = None
        self.account = EngineAccount()  # rows admitted to / finished by the engine (the ETA's credit)

    def counts(self) -> tuple[int, int, int, int]:
        """(units committed, rows committed, output tokens committed, rows finished), consistently."""
        with self.lock:
            return self.committed_units, self.committed_rows, self.committed_out_tokens, self.finished_rows

    def generated(self) -> tuple[int, float]:
        """(output tokens generated, rows in flight included; row equivalents done on rows in flight)."""
        decode = int(self.engine.stats.get("decode_tokens", 0)) if self.engine is not None else 0
        return self.account.generated(decode)

    # -- run ------------------------------------------------------------------------------------
    def run(self, feed: Iterable[list[Unit]]) -> None:
        """Run over `feed`, an iterable of windows (lists of units) that may block while more work is
        coming. Returns once the feed is exhausted and every unit committed, or on a stop; raises the
        reader's or writer's error. StartupInterrupted passes through (the caller words it)."""
        spec = self.spec
        read_q: queue.Queue = queue.Queue(maxsize=1)        # one window ready ahead of the engine
        write_q: queue.Queue = queue.Queue(maxsize=max(2, 2 * spec.plan.window_units))
        reader = threading.Thread(target=self._reader, args=(feed, read_q), name="batchrun-reader", daemon=True)
        writer = threading.Thread(target=self._writer, args=(write_q,), name="batchrun-writer", daemon=True)
        reader.start()               # reads and tokenizes while the weights load
        writer.start()
        try:
            self.starting = True         # a signal now stops the weight load itself (the handler raises)
            try:
                engine = self.engine_factory(self.plan.tokenizer)
            finally:
                self.starting = False
            self.engine = engine
            self.memory_ledger = dict(engine.memory_ledger)
            engine_loop(self, read_q, write_q)
        finally:
            self.stop_reading = True
            # joined on every path: a reader left inside pyarrow when the interpreter exits can hang it
            reader.join(READER_JOIN_S)
            self.put(write_q, END, force=True)
            writer.join()
            if self.engine is not None:
                self.stats = dict(self.engine.stats)
                self.sample()           # the last units' commits, on the bar too
                close = getattr(self.engine, "close", None)
                if close is not None:   # tensor-parallel workers stop with the engine
                    close()
        if self.writer_error is not None:
            raise self.writer_error

    def sample(self) -> None:
        """Hand the live counters to on_sample (progress, the bar): no store I/O here."""
        if self.on_sample is not None:
            self.on_sample()

    def put(self, q: queue.Queue, item, force: bool = False) -> bool:
        """Put with a timeout loop so a stop or a dead consumer never deadlocks us."""
        while True:
            if not force and (self.stop.is_set() or self.stop_reading):
                return False
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                if force and self.writer_error is not None:
                    return False

    # -- reader -------------------------------------------------------------------------------------
    def _reader(self, feed, read_q: queue.Queue) -> None:
        spec, plan = self.spec, self.plan
        cols = [c for c in spec.input.columns()]
        keep = list(dict.fromkeys(c for c in [spec.input.id_column, *spec.input.passthrough] if c))
        try:
            for window in feed:
                preps = []
                for unit in window:
                    if self.stop.is_set() or self.stop_reading:
                        return
                    try:
                        table = plan.source.read(unit, cols)
                        rendered = render(spec, table, plan.tokenizer)
                    except Exception as e:   # noqa: BLE001 - a replica reports it; a local run fails
                        if self.on_unit_error is None:
                            raise
                        replacement = self.on_unit_error(unit, e)   # None: skip; a Prepared: commit it
                        if replacement is not None:
                            preps.append(replacement)
                        continue
                    preps.append(Prepared(unit, table.select(keep), rendered))
                reqs = [(p.unit.index, i, ids, p.rendered.prompts[i],
                         (p.rendered.params[i] if p.rendered.params else None) or self.params) for p in preps
                        for i, ids in enumerate(p.rendered.token_ids) if p.rendered.errors[i] is None]
                if spec.dedupe:          # hashed here, off the engine thread
                    reqs = [(*r, request_key(r[2], r[4])) for r in reqs]
                if spec.plan.order == "length":
                    order = length_order([r[2] for r in reqs], [r[4].max_tokens for r in reqs],   # per-row limits
                                         spec.engine.block_size)
                    reqs = [reqs[i] for i in order]
                if not self.put(read_q, (preps, reqs)):
                    return
            self.put(read_q, END)
        except BaseException as e:   # noqa: BLE001 - handed to the engine thread, which re-raises
            self.put(read_q, ReaderError(e))

    # -- writer -------------------------------------------------------------------------------------
    def _writer(self, write_q: queue.Queue) -> None:
        spec = self.spec
        meta = {"batchrun.job": spec.name, "batchrun.model": spec.model.path,
                "batchrun.sampling": spec.sampling.model_dump(mode="json"),
                "batchrun.fingerprint": fingerprint_hash(self.plan.fingerprint)}
        while True:
            st = write_q.get()
            if st is END:
                return
            if self.writer_error is not None:
                continue
            try:
                self._commit(st, meta)
            except BaseException as e:   # noqa: BLE001 - surfaced by the engine thread
                self.writer_error = e
                self.request_stop("writer error")

    def _commit(self, st, meta: dict) -> None:
        """Decode one finished unit and commit it: parts, then a create-only done marker."""
        spec, unit = self.spec, st.prep.unit
        table, stats = result_table(spec, st.prep, st.outputs, st.shared, self.plan.tokenizer,
                                    self.params.skip_special_tokens)
        try:
            marker = self.committer.commit(
                unit.index, table, {**meta, "batchrun.unit": str(unit.index)},
                # rows: input rows (what plans and resumes count); output_rows: rows x their n samples
                {"rows": unit.num_rows, "output_rows": table.num_rows, **stats, "committed_at": time.time(),
                 "input": {"path": unit.path, "row_start": unit.row_start, "num_rows": unit.num_rows}},
                partition_by=spec.output.partition_by)
        except LockLost as e:       # another run took the lock over: commit nothing more
            self.request_stop(str(e))
            return
        if marker is None:          # another worker committed this unit first
            self.log(f"batchrun: unit {unit.index} was committed by another worker; not counted here")
            if self.on_commit is not None:
                self.on_commit(unit, {"rows": 0, "errors": 0, "prompt_tokens": 0, "output_tokens": 0,
                                      "committed_elsewhere": True})
            return
        with self.lock:
            self.committed_units += 1
            self.committed_rows += unit.num_rows
            self.committed_out_tokens += stats["output_tokens"]
        if self.on_commit is not None:
            self.on_commit(unit, {"rows": unit.num_rows, "output_rows": table.num_rows, **stats})
