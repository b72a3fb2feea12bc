"""Live progress of a running job: counters the engine loop feeds, rates, an ETA, and a publisher thread.

The engine loop calls ProgressTracker.sample() at most twice a second with numbers it already has
(rows finished, engine token counters); nothing here touches the engine or the commit protocol. A
Publisher thread rewrites `_batchrun/progress.json` every `interval_s` (BATCHRUN_PROGRESS_INTERVAL_S,
default 2 s) from the tracker's snapshot, so `batchrun status` moves while a window of units is still
being generated (before its first unit commits), while weights load, and while a long step runs; the
engine never waits on that PUT. The tqdm bar shows the same snapshot.

ETA: the work is counted in row equivalents, p = rows finished + the tokens already generated for rows
in flight / their max_tokens (a lower bound of the true share, exact when rows run to max_tokens, so a
batch that finishes in waves still moves smoothly). The rate is the slope of p over a trailing window of
max(60 s, half the time since the engine started), which leaves out the start-up ramp (no row finishes
during its first tokens) and follows a machine that speeds up or slows down; ETA = rows left / rate.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

DEFAULT_INTERVAL_S = 2.0
INTERVAL_ENV = "BATCHRUN_PROGRESS_INTERVAL_S"
TOKEN_RATE_WINDOW_S = 60.0      # tok/s and rows/s shown: over the last minute
MIN_SAMPLE_SPACING_S = 0.5


def progress_interval() -> float:
    v = os.environ.get(INTERVAL_ENV)
    try:
        return max(0.05, float(v)) if v else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S


class RateWindow:
    """A growing counter sampled over time; its rate over the last `window_s` seconds."""

    def __init__(self, window_s: float = TOKEN_RATE_WINDOW_S):
        self.window_s = window_s
        self.samples: deque = deque()

    def add(self, t: float, value: float) -> None:
        self.samples.append((t, value))
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.window_s:
            self.samples.popleft()

    def rate(self) -> Optional[float]:
        if len(self.samples) < 2:
            return None
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else None


class EtaEstimator:
    """Seconds left for `total` units of work, from samples (t, done) of the work finished so far.

    The rate is the slope over the trailing window max(min_window_s, window_frac x time since the first
    sample); the window's start only moves forward, so older samples are dropped as it passes them."""

    def __init__(self, total: float, min_window_s: float = 60.0, window_frac: float = 0.5):
        self.total = float(total)
        self.min_window_s = min_window_s
        self.window_frac = window_frac
        self.samples: deque = deque()
        self.t0: Optional[float] = None

    def add(self, t: float, done: float) -> None:
        if self.t0 is None:
            self.t0 = t
        if len(self.samples) >= 2 and t - self.samples[-2][0] < MIN_SAMPLE_SPACING_S:
            self.samples[-1] = (t, done)          # keep the deque sparse: replace the newest
        else:
            self.samples.append((t, done))
        start = t - max(self.min_window_s, self.window_frac * (t - self.t0))
        while len(self.samples) > 2 and self.samples[1][0] <= start:
            self.samples.popleft()

    def rate(self) -> Optional[float]:
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        if t1 - t0 < 1e-6 or d1 <= d0:
            return None
        return (d1 - d0) / (t1 - t0)

    def eta(self) -> Optional[float]:
        if not self.samples:
            return None
        left = self.total - self.samples[-1][1]
        if left <= 0:
            return 0.0
        r = self.rate()
        return None if r is None else left / r


class EngineAccount:
    """Rows the engine was given and gave back, for the tokens generated so far (rows in flight included)
    and the in-flight credit of the ETA, from the engine's own `decode_tokens` counter (engine thread)."""

    def __init__(self):
        self.n_admitted = self.admitted_max = self.n_finished = self.finished_max = 0
        self.tokens = self.rows_with_tokens = 0

    def admitted(self, max_tokens: int) -> None:
        self.n_admitted += 1
        self.admitted_max += max_tokens

    def finished(self, out, max_tokens: int) -> None:
        self.n_finished += 1
        self.finished_max += max_tokens
        if out.finish_reason != "error":      # each sample's first token came with its prefill
            lengths = [len(c.token_ids) for c in (out.outputs or [out]) if c.token_ids]
            self.tokens += sum(lengths)
            self.rows_with_tokens += len(lengths)

    def generated(self, decode_tokens: int) -> tuple[int, float]:
        """(output tokens generated, row equivalents done on rows in flight). A finished row of n tokens
        took n - 1 decode steps (its first token comes with the prefill); the rest is in flight."""
        inflight_tokens = max(0, decode_tokens - (self.tokens - self.rows_with_tokens))
        inflight = self.n_admitted - self.n_finished
        mean_max = (self.admitted_max - self.finished_max) / inflight if inflight > 0 else 0
        credit = min(inflight, inflight_tokens / mean_max) if mean_max > 0 else 0.0
        return self.tokens + inflight_tokens, credit


class ProgressTracker:
    """What a running job reports: fed by the engine loop (one thread), read by the publisher and the bar."""

    def __init__(self, rows_todo: int):
        self.rows_todo = rows_todo
        self.eta = EtaEstimator(rows_todo)
        self.tokens = RateWindow()
        self.rows = RateWindow()
        self.phase = "starting"          # starting (planning, loading weights) -> generating
        self.rows_finished = 0
        self.tokens_generated = 0
        self.t_engine: Optional[float] = None
        self._lock = threading.Lock()

    def sample(self, rows_finished: int, tokens_generated: int, inflight_credit: float,
               now: Optional[float] = None) -> None:
        """rows_finished: rows with a result (engine or shared); tokens_generated: output tokens the
        engine produced, rows in flight included; inflight_credit: row equivalents of work done on rows
        still in flight (0 <= credit <= rows in flight)."""
        now = time.time() if now is None else now
        with self._lock:
            if self.t_engine is None:
                self.t_engine = now
            self.phase = "generating"
            self.rows_finished, self.tokens_generated = rows_finished, tokens_generated
            self.eta.add(now, min(self.rows_todo, rows_finished + max(0.0, inflight_credit)))
            self.tokens.add(now, tokens_generated)
            self.rows.add(now, rows_finished)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"phase": self.phase, "rows_finished_this_run": self.rows_finished,
                    "output_tokens_generated": self.tokens_generated,
                    "output_tokens_per_s": _round(self.tokens.rate()), "rows_per_s": _round(self.rows.rate()),
                    "eta_s": _round(self.eta.eta()), "rate_window_s": TOKEN_RATE_WINDOW_S}


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)


def fmt_duration(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def bar_postfix(snap: dict[str, Any], units_done: int, units_total: int) -> str:
    """The tqdm postfix: the numbers `batchrun status` shows."""
    tok = snap.get("output_tokens_per_s")
    return (f"{0 if tok is None else tok:.0f} tok/s, units {units_done}/{units_total}, "
            f"ETA {fmt_duration(snap.get('eta_s'))}")


class Publisher:
    """Calls `publish()` every interval_s from a daemon thread until stop(); errors are logged, never raised
    (progress is advisory). stop() waits for a write in flight, so a final state written after it wins."""

    def __init__(self, publish: Callable[[], None], interval_s: Optional[float] = None,
                 log: Callable[[str], None] = lambda m: None):
        self.publish = publish
        self.interval_s = progress_interval() if interval_s is None else interval_s
        self.log = log
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Publisher":
        def loop():
            while not self._stop.wait(self.interval_s):
                try:
                    self.publish()
                except Exception as e:   # noqa: BLE001 - advisory
                    self.log(f"batchrun: could not write progress: {e}")
        self._thread = threading.Thread(target=loop, name="batchrun-progress", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
