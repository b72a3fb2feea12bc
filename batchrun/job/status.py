"""Progress of a job from its output alone: works from any process while the job runs.

Done markers are the truth for what is committed; the manifest gives the totals; the progress file
(rewritten atomically by the runner every few seconds) gives rates, the ETA and whether it is alive.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Optional

from batchrun.connectors import ParquetSink
from batchrun.job.dedupe import dedupe_summary
from batchrun.job.ledger import SUCCESS, Ledger
from batchrun.job.lock import JobLock

STALE_AFTER_S = 15.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_status(output_uri: str, storage_options: Optional[dict] = None) -> dict[str, Any]:
    """State of the job writing to `output_uri`.

    state: "not started" (no manifest), "running", "finished", "interrupted" (stopped on a signal),
    or "failed" (an error, or the process died without a word: killed, OOM, power loss).
    A live, non-stale holder of the run lock means "running" with its pid, even before it has written
    progress (a re-submit that just took over a killed attempt's lock).
    """
    sink = ParquetSink(output_uri, storage_options, create=False)
    ledger = Ledger(sink)
    manifest = ledger.read_manifest()
    out: dict[str, Any] = {"output": sink.url}
    lock = JobLock(sink)
    held = lock.read()
    live_lock = None
    if held is not None:     # who holds _batchrun/lock.json, and whether a re-submit would take it over
        stale = lock.stale_reason(held)
        out["lock"] = {**{k: held.get(k) for k in ("pid", "host", "job", "started_at", "heartbeat_at")},
                       "holder": lock.describe(held), "stale": stale}
        live_lock = held if stale is None and not held.get("unreadable") else None
    if manifest is None:
        out.update(state="not started", detail=f"no {sink.url}/_batchrun/manifest.json")
        if live_lock is not None:
            out.update(state="running", pid=live_lock.get("pid"), phase="starting", detail="planning")
        return out
    markers = ledger.done_markers()
    prog = ledger.read_progress() or {}
    if live_lock is not None and prog.get("pid") != live_lock.get("pid"):
        # the lock's holder has not written progress yet: what is there belongs to an earlier attempt
        prog = {"state": "running", "pid": live_lock.get("pid"), "host": live_lock.get("host"),
                "phase": "starting", "updated_at": live_lock.get("heartbeat_at")}
    units_total, rows_total = manifest.get("units_total"), manifest.get("rows_total")
    rows_done = sum(int(m.get("rows", 0)) for m in markers.values())
    age = max(0.0, time.time() - float(prog.get("updated_at") or 0))
    out.update(job=manifest.get("job"), units_done=len(markers), units_total=units_total,
               rows_done=rows_done, rows_finished=max(rows_done, int(prog.get("rows_finished") or 0)),
               rows_total=rows_total,
               errors=sum(int(m.get("errors", 0)) for m in markers.values()),
               output_tokens=sum(int(m.get("output_tokens", 0)) for m in markers.values()),
               rows_per_s=prog.get("rows_per_s"), output_tokens_per_s=prog.get("output_tokens_per_s"),
               output_tokens_generated=prog.get("output_tokens_generated"),
               eta_s=None, pid=prog.get("pid"), phase=prog.get("phase"), updated_at=prog.get("updated_at"),
               dedupe=dedupe_summary(markers, True) | {"this_run": prog.get("dedupe")})
    out["dedupe"].pop("enabled")
    if prog.get("replicas") is not None:      # a Ray run: the driver's per-replica rows (see ray_runner)
        out.update(backend=prog.get("backend", "ray"), replicas=prog["replicas"])
    if ledger.exists(SUCCESS):
        out["state"] = "finished"
        out["rows_finished"] = rows_done
        return out
    state = prog.get("state")
    if state == "running" and live_lock is None:
        same_host = prog.get("host") == socket.gethostname()
        alive = _pid_alive(int(prog["pid"])) if same_host and prog.get("pid") else None
        if alive is False or (alive is None and age > STALE_AFTER_S + 3 * float(prog.get("interval_s", 2))):
            state = "failed"
            out["detail"] = (f"process {prog.get('pid')} is gone without finishing (killed?); "
                             "re-submit the job to resume")
    if state == "running":
        eta = prog.get("eta_s")
        if eta is None and prog.get("rows_per_s") and rows_total is not None:    # a Ray driver's progress
            eta = max(rows_total - out["rows_finished"], 0) / prog["rows_per_s"]
        out["eta_s"] = None if eta is None else max(0.0, float(eta) - age)
    elif state is None:
        state = "failed" if markers or prog else "not started"
    out["state"] = state
    return out


def _dur(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_status(st: dict[str, Any]) -> str:
    """Human-readable lines for `batchrun status`."""
    if st["state"] == "not started":
        return f"{st['output']}: not started ({st.get('detail', '')})" + _lock_line(st)
    if st.get("units_total") is None:      # a run holds the lock but has not written its manifest yet
        return f"{st['output']}: {st['state']} (pid {st.get('pid')}, {st.get('detail', 'starting')})" + _lock_line(st)
    total = st.get("rows_total")
    pct = lambda n: 100.0 * n / total if total else 100.0  # noqa: E731
    fin = st.get("rows_finished", st["rows_done"])
    lines = [f"job {st.get('job')} -> {st['output']}: {st['state']}" + (f" (pid {st['pid']})" if st.get("pid")
                                                                          and st["state"] == "running" else ""),
             f"  units {st['units_done']}/{st['units_total']} committed  rows {fin}/{total} finished "
             f"({pct(fin):.1f}%), {st['rows_done']} committed  errors {st['errors']}  output tokens "
             f"{st['output_tokens']}"]
    if st["state"] == "running":
        if st.get("phase") == "starting":
            lines.append("  starting (planning, loading weights)")
        else:
            lines.append(f"  {st.get('rows_per_s') or 0:.1f} rows/s  {st.get('output_tokens_per_s') or 0:.1f} "
                         f"output tok/s (last minute)  ETA {_dur(st.get('eta_s'))}")
    dd = st.get("dedupe") or {}
    if dd.get("rows_shared"):
        lines.append(f"  dedupe: {dd['rows_shared']} rows shared an identical row's output, saving "
                     f"{dd['output_tokens_saved']} output and {dd['prompt_tokens_saved']} prompt tokens")
    for r in st.get("replicas") or []:
        idle = r.get("idle_fraction")
        lines.append(f"  replica {r['replica']} ({r.get('state')}, pid {r.get('pid')} on {r.get('host')}): "
                     f"units {r.get('units_committed', 0)}  rows {r.get('rows_finished', 0)}  "
                     f"{r.get('rows_per_s') or 0:.1f} rows/s  {r.get('output_tokens_per_s') or 0:.1f} tok/s  "
                     f"idle {'-' if idle is None else f'{100 * idle:.0f}%'}  restarts {r.get('restarts', 0)}")
    if st.get("detail"):
        lines.append(f"  {st['detail']}")
    return "\n".join(lines) + _lock_line(st)


def _lock_line(st: dict[str, Any]) -> str:
    lk = st.get("lock")
    if not lk:
        return ""
    return f"\n  lock: {lk['holder']}" + (f" (stale: {lk['stale']}; a re-submit takes it over)"
                                         if lk.get("stale") else "")
