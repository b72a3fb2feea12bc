"""The job runner: streams units through the engine and commits each finished unit exactly once.

Threads: a reader (read, render, tokenize a window of units) and a writer (detokenize, build the Arrow
table, publish the part file, write the done marker) around the engine loop in the main thread, joined
by bounded queues. The engine is topped up with the next window before the current one drains.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import resource
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import pyarrow as pa

from batchrun.connectors import InputError, ParquetSink, Unit, open_source
from batchrun.job.faults import crash_point
from batchrun.job.ledger import FingerprintMismatch, Ledger, fingerprint
from batchrun.job.plan import UnitWork, order_window, render, tokenize
from batchrun.job.spec import JobSpec

log = logging.getLogger("batchrun")

EXIT_OK, EXIT_ERROR, EXIT_BAD_JOB, EXIT_INPUT, EXIT_FINGERPRINT, EXIT_MODEL = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 75      # EX_TEMPFAIL: retry, the next submit resumes


class Interrupted(RuntimeError):
    pass


@dataclass
class _UnitState:
    work: UnitWork
    outputs: list = field(default_factory=list)
    remaining: int = 0


def _model_identity(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json"), "rb") as f:
        cfg = hashlib.sha256(f.read()).hexdigest()
    files = sorted((n, os.path.getsize(os.path.join(path, n))) for n in os.listdir(path)
                   if n.endswith(".safetensors"))
    return {"config_sha256": cfg, "weights": files}


class JobRunner:
    """Plan, validate and run one job. Validation (input, columns, model config, fingerprint) happens in
    prepare(), before any weight loads; run() loads the engine and streams."""

    def __init__(self, spec: JobSpec, restart: bool = False, progress_bar: bool = True):
        self.spec = spec
        self.restart = restart
        self.progress_bar = progress_bar
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self.rows_done = self.tokens_out = self.tokens_in = self.error_rows = self.units_committed = 0

    # -- validation, no weights ------------------------------------------------------------------
    def prepare(self) -> None:
        """plan(), then open the output: manifest written or checked, committed units listed."""
        self.plan()
        self.open_output()

    def plan(self) -> None:
        """Everything that can fail before weights load, writing nothing: input listing, columns,
        model config, tokenizer, units."""
        from batchrun.models.loader import inspect_model
        from batchrun.tokenizer import Tokenizer
        spec, inp = self.spec, self.spec.input
        self.source = open_source(inp.uri, inp.format, inp.storage_options)
        names = self.source.schema.names
        for col in inp.columns():
            if col not in names:
                raise InputError(f"{inp.uri}: column {col!r} not found (columns: {', '.join(names)})")
        self.model_info = inspect_model(spec.model.path)
        self.tokenizer = Tokenizer.from_dir(spec.model.path)
        self.units = self.source.units(spec.plan.unit_rows)

    def open_output(self) -> None:
        spec, inp = self.spec, self.spec.input
        self.sink = ParquetSink(spec.output.uri, spec.output.storage_options)
        self.ledger = Ledger(self.sink)
        parts = {
            "model": _model_identity(spec.model.path),
            "sampling": spec.sampling.model_dump(),
            "rendering": inp.model_dump(exclude={"uri", "storage_options", "format"})
                         | {"include_prompt": spec.output.include_prompt},
            "input": self.source.listing.fingerprint(),
            "unit_rows": spec.plan.unit_rows,
        }
        manifest = {"job": spec.name, "fingerprint": fingerprint(parts), "parts": parts,
                    "num_units": len(self.units), "num_rows": self.source.num_rows,
                    "created": time.time()}
        self.resumed = self.ledger.check_manifest(manifest, self.restart)
        self.done = self.ledger.done_units()
        self.pending = [u for u in self.units if u.index not in self.done]

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from batchrun.engine.config import EngineConfig
        from batchrun.engine.engine import LLMEngine
        spec = self.spec
        t_start = time.perf_counter()
        self.engine = LLMEngine(EngineConfig(model=spec.model.path, dtype=spec.model.dtype,
                                             **spec.engine_kwargs()), self.tokenizer)
        self.params = spec.sampling_params()
        self.metadata = {"batchrun.job": spec.name, "batchrun.model": os.path.basename(spec.model.path.rstrip("/")),
                         "batchrun.architecture": self.model_info.architecture,
                         "batchrun.sampling": spec.sampling.model_dump()}
        in_q: queue.Queue = queue.Queue(maxsize=2)
        out_q: queue.Queue = queue.Queue(maxsize=4 * spec.plan.window_units)
        reader = threading.Thread(target=self._reader, args=(in_q,), name="batchrun-reader", daemon=True)
        writer = threading.Thread(target=self._writer, args=(out_q,), name="batchrun-writer", daemon=True)
        rows_total = sum(u.num_rows for u in self.pending)
        bar = None
        if self.progress_bar:
            from tqdm import tqdm
            bar = tqdm(total=rows_total, unit="row", desc=spec.name, dynamic_ncols=True)
        self._bar = bar
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        reader.start()
        writer.start()
        t_run = time.perf_counter()
        busy = 0.0
        try:
            busy = self._engine_loop(in_q, out_q)
        finally:
            out_q.put(None)
            writer.join()
            self.stop.set()
            for s, h in old.items():
                signal.signal(s, h)
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t_run
        if self._errors:
            raise self._errors[0]
        interrupted = self.rows_done < rows_total
        summary = self._summary(wall, busy, time.perf_counter() - t_start, interrupted)
        if interrupted:
            self._progress("interrupted", t_run)
            raise Interrupted(f"stopped by signal after {self.units_committed} units; resubmit to resume")
        crash_point("before_success")
        self.ledger.finish(summary)
        self._progress("finished", t_run)
        return summary

    def _on_signal(self, signum, frame) -> None:
        if self.stop.is_set():
            os._exit(EXIT_INTERRUPTED)       # a second signal: leave now, nothing half-written is published
        log.warning("signal %d: no new work admitted; finished units are committed, the rest resumes later", signum)
        self.stop.set()

    def _reader(self, in_q: queue.Queue) -> None:
        try:
            w = self.spec.plan.window_units
            for i in range(0, len(self.pending), w):
                if self.stop.is_set():
                    break
                works = [self._read_unit(u) for u in self.pending[i:i + w]]
                while not self.stop.is_set():
                    try:
                        in_q.put(works, timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:       # surfaced by the main thread
            self._errors.append(e)
            self.stop.set()
        finally:
            in_q.put(None)

    def _read_unit(self, unit: Unit) -> UnitWork:
        spec, inp = self.spec, self.spec.input
        table = self.source.read(unit, inp.columns() or None)
        prompts, errors = render(spec, table, self.tokenizer)
        token_ids = tokenize(spec, prompts, self.tokenizer)
        ids = (table.column(inp.id_column).to_pylist() if inp.id_column
               else list(range(unit.first_row, unit.first_row + unit.num_rows)))
        keep = list(dict.fromkeys(inp.passthrough))
        return UnitWork(unit, table.select(keep), ids, prompts, token_ids, errors)

    def _engine_loop(self, in_q: queue.Queue, out_q: queue.Queue) -> float:
        eng = self.engine
        topup = 2 * eng.config.max_num_seqs
        states: dict[int, _UnitState] = {}
        reader_done = False
        busy = 0.0
        last_progress = 0.0
        t0 = time.perf_counter()
        while not self.stop.is_set():
            while not reader_done and eng.num_unfinished_requests() < topup:
                try:   # block only when the engine has nothing to do
                    works = in_q.get(timeout=0.2) if not eng.has_unfinished_requests() else in_q.get_nowait()
                except queue.Empty:
                    break
                if works is None:
                    reader_done = True
                    break
                self._admit(works, states, out_q)
            if not eng.has_unfinished_requests():
                if reader_done and not states:
                    break
                continue
            t = time.perf_counter()
            finished = eng.step()
            busy += time.perf_counter() - t
            crash_point("step")
            for out in finished:
                u, r = map(int, out.request_id.split(":"))
                st = states[u]
                st.outputs[r] = out
                st.remaining -= 1
                if st.remaining == 0:
                    out_q.put(states.pop(u))
            now = time.perf_counter()
            if now - last_progress > 2.0:
                self._progress("running", t0)
                last_progress = now
        return busy

    def _admit(self, works: list[UnitWork], states: dict[int, _UnitState], out_q: queue.Queue) -> None:
        for w in works:
            st = _UnitState(w, [None] * len(w.ids), sum(1 for e in w.errors if e is None))
            if st.remaining == 0:
                out_q.put(st)
            else:
                states[w.unit.index] = st
        for wi, r in order_window(works, self.params.max_tokens, self.spec.plan.order):
            w = works[wi]
            self.engine.add_request(f"{w.unit.index}:{r}", w.token_ids[r], self.params)

    def _writer(self, out_q: queue.Queue) -> None:
        try:
            while True:
                st = out_q.get()
                if st is None:
                    return
                if self._errors:
                    continue
                self._commit(st)
        except BaseException as e:
            self._errors.append(e)
            self.stop.set()
            while out_q.get() is not None:     # keep the engine loop from blocking on a full queue
                pass

    def _commit(self, st: _UnitState) -> None:
        w, outs = st.work, st.outputs
        todo = [o for o in outs if o is not None and o.text is None and o.finish_reason != "error"]
        if todo:
            for o, t in zip(todo, self.tokenizer.decode_batch([o.token_ids for o in todo],
                                                              skip_special_tokens=self.params.skip_special_tokens)):
                o.text = t
        n = len(w.ids)
        text, reason, err, ptok, otok = [], [], [], [], []
        for i in range(n):
            o = outs[i]
            if o is None:                                   # failed before the engine (render)
                text.append(None); reason.append("error"); err.append(w.errors[i]); ptok.append(0); otok.append(0)
            else:
                text.append(o.text if o.finish_reason != "error" else None)
                reason.append(o.finish_reason); err.append(o.error)
                ptok.append(o.metrics.prompt_tokens); otok.append(o.metrics.output_tokens)
        cols = {"id": pa.array(w.ids), "output": pa.array(text, pa.string()),
                "finish_reason": pa.array(reason, pa.string()), "error": pa.array(err, pa.string()),
                "prompt_tokens": pa.array(ptok, pa.int32()), "output_tokens": pa.array(otok, pa.int32())}
        for c in w.table.column_names:
            if c not in cols:
                cols[c] = w.table.column(c)
        if self.spec.output.include_prompt:
            cols["prompt"] = pa.array(w.prompts, pa.string())
        table = pa.table(cols)
        info = self.sink.commit(w.unit.index, table, self.metadata, before_publish=lambda: crash_point("before_publish"))
        crash_point("after_part")
        errors = sum(1 for r in reason if r == "error")
        self.ledger.mark_done(w.unit.index, {
            "unit": w.unit.index, "path": w.unit.path, "row_start": w.unit.row_start, "rows": n,
            "error_rows": errors, "prompt_tokens": sum(ptok), "output_tokens": sum(otok),
            "bytes": info["bytes"], "sha256": info["sha256"], "committed": time.time()})
        with self._lock:
            self.rows_done += n
            self.error_rows += errors
            self.tokens_out += sum(otok)
            self.tokens_in += sum(ptok)
            self.units_committed += 1
        if self._bar is not None:
            self._bar.update(n)

    # -- reporting ----------------------------------------------------------------------------
    def _progress(self, state: str, t0: float) -> None:
        el = time.perf_counter() - t0
        done_before = sum(r.get("rows", 0) for r in self.done.values())
        self.ledger.write_progress({
            "state": state, "pid": os.getpid(), "updated": time.time(), "elapsed_s": round(el, 2),
            "units_total": len(self.units), "units_done": len(self.done) + self.units_committed,
            "rows_total": self.source.num_rows, "rows_done": done_before + self.rows_done,
            "rows_per_s": round(self.rows_done / el, 2) if el > 0 else 0.0,
            "output_tok_s": round(self.tokens_out / el, 2) if el > 0 else 0.0})

    def _summary(self, wall: float, busy: float, total: float, interrupted: bool) -> dict[str, Any]:
        st = self.engine.stats
        done_before = self.done.values()
        return {
            "job": self.spec.name, "output": self.sink.url, "state": "interrupted" if interrupted else "finished",
            "units": len(self.units), "units_skipped": len(self.done), "units_committed": self.units_committed,
            "rows": sum(r.get("rows", 0) for r in done_before) + self.rows_done,
            "rows_this_run": self.rows_done, "error_rows": self.error_rows,
            "prompt_tokens": self.tokens_in, "output_tokens": self.tokens_out,
            "seconds": round(wall, 3), "seconds_with_load": round(total, 3),
            "rows_per_s": round(self.rows_done / wall, 2) if wall > 0 else 0.0,
            "output_tok_s": round(self.tokens_out / wall, 2) if wall > 0 else 0.0,
            "engine_busy_fraction": round(busy / wall, 4) if wall > 0 else 0.0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "prompt_tokens_from_cache_fraction": round(st["prefix_cache_hit_rate"], 4),
            "engine": {k: st[k] for k in ("steps", "tokens_per_step", "preemptions", "swapped_out_blocks",
                                          "swapped_in_blocks", "recomputed_tokens", "prefix_cache_hits",
                                          "prefix_cache_queries", "spec_proposed", "spec_accepted",
                                          "spec_acceptance_rate", "mean_tokens_per_decode_step",
                                          "peak_blocks_used", "num_blocks")},
            "memory_ledger": self.engine.memory_ledger,
        }


def submit(spec: JobSpec, restart: bool = False, progress_bar: bool = True) -> dict[str, Any]:
    runner = JobRunner(spec, restart, progress_bar)
    runner.prepare()
    return runner.run()
