"""What a run reports, written in one place for both backends: `_batchrun/progress.json` while it runs
and the summary when it finishes (`submit --json`'s last line, `_batchrun/summary.json`).

Both read a run's counters from one object: a UnitPipeline (job/pipeline.py) in a local run, the Ray
driver's replica aggregate (job/ray_runner.py) on Ray. Such an object has counts() -> (units committed,
rows committed, output tokens committed, rows finished), engine_s, loop_s, stats, memory_ledger, deduper,
and may add backend-specific fields through progress_fields(state) and summary_fields().
"""
from __future__ import annotations

import os
import resource
import socket
import time
from typing import Any, Optional

from batchrun.job.dedupe import dedupe_summary
from batchrun.job.plan import fingerprint_hash
from batchrun.job.progress import progress_interval

# Engine counters copied into summary.json: batching, preemption (swap / recompute), prefix cache, speculation.
SUMMARY_ENGINE_STATS = ("steps", "tokens_per_step", "num_blocks", "peak_blocks_used", "preemptions",
                        "swapped_out_blocks", "swapped_in_blocks", "recomputed_tokens", "prefix_cache_queries",
                        "prefix_cache_hits", "prefix_cache_hit_rate", "spec_proposed", "spec_accepted",
                        "spec_acceptance_rate", "mean_tokens_per_decode_step", "host_overhead_ms_per_step",
                        "host_overhead_fraction")


class Idle:
    """The counters of a run whose units have not started (or that had none to run)."""
    engine_s = loop_s = idle_s = 0.0
    stats: dict = {}
    memory_ledger: dict = {}
    deduper = None

    def counts(self) -> tuple[int, int, int, int]:
        """Nothing committed or finished."""
        return 0, 0, 0, 0


def _busy(c) -> Optional[float]:
    return c.engine_s / c.loop_s if c.loop_s > 0 else None


def progress_record(run, counters, state: str) -> dict[str, Any]:
    """The content of progress.json: `run` (a JobRunner) gives the job and what was done before this
    attempt, its tracker the live rates and ETA (a local run), `counters` this attempt's numbers."""
    units, rows, otok, fin = counters.counts()
    now = time.time()
    extra = getattr(counters, "progress_fields", None)      # a backend's own rates replace the tracker's
    snap = run.tracker.snapshot() if run.tracker is not None and extra is None else {}
    rec = {**snap, "state": state, "job": run.spec.name, "pid": os.getpid(), "host": socket.gethostname(),
           "started_at": run.t_start, "updated_at": now, "elapsed_s": max(now - run.t_start, 1e-9),
           "units_total": len(run.plan.units), "units_done": run.units_done_before + units,
           "units_committed_this_run": units,
           "rows_total": run.plan.num_rows, "rows_done": run.rows_done_before + rows,
           "rows_finished": run.rows_done_before + max(fin, rows), "rows_finished_this_run": fin,
           "output_tokens_this_run": otok,
           "eta_s": snap.get("eta_s") if state == "running" else None,
           "engine_busy_fraction": _busy(counters),
           "dedupe": counters.deduper.stats() if counters.deduper is not None else None,
           "interval_s": progress_interval()}
    if extra is not None:
        rec.update(extra(state, rows_left=run.rows_todo - max(fin, rows)))
    return rec


def job_summary(run, counters) -> dict[str, Any]:
    """The summary of a finished run: totals over every committed unit (the done markers), this run's
    rates, the engine's counters, the dedupe saving, and the backend's own fields."""
    markers = run.ledger.done_markers()
    wall = time.time() - run.t_start
    units, rows_run, otok, _ = counters.counts()
    st = counters.stats
    total = lambda key: sum(int(m.get(key, 0)) for m in markers.values())  # noqa: E731
    busy = _busy(counters)
    out = {
        "ok": True, "job": run.spec.name, "state": "finished", "output": run.sink.url,
        "units": len(run.plan.units), "units_committed": units,
        "units_skipped": run.units_done_before,
        "rows": total("rows"), "error_rows": total("errors"), "prompt_tokens": total("prompt_tokens"),
        "output_tokens": total("output_tokens"),
        "rows_this_run": rows_run, "wall_s": round(wall, 3),
        "rows_per_s": round(rows_run / wall, 2) if wall > 0 else None,
        "output_tokens_per_s": round(otok / wall, 2) if wall > 0 else None,
        "engine_loop_s": round(counters.loop_s, 3), "engine_step_s": round(counters.engine_s, 3),
        "engine_busy_fraction": round(busy, 4) if busy is not None else None,
        "engine": {k: st[k] for k in SUMMARY_ENGINE_STATS if k in st},
        "memory_ledger": counters.memory_ledger,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "fingerprint": fingerprint_hash(run.plan.fingerprint),
        "dedupe": dedupe_summary(markers, run.spec.dedupe),
    }
    extra = getattr(counters, "summary_fields", None)
    if extra is not None:
        out.update(extra())
    return out
