"""Test hooks of the job runner: kill or freeze this process at a named point of the pipeline.

BATCHRUN_TEST_CRASH_AT=point:n SIGKILLs the process the n-th time `point` is reached;
BATCHRUN_TEST_STOP_AT=point:n SIGSTOPs it there once (a process frozen mid-commit, resumed by SIGCONT).
The signal goes to the calling thread, so nothing after the point runs first.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Optional

CRASH_ENV = "BATCHRUN_TEST_CRASH_AT"
STOP_ENV = "BATCHRUN_TEST_STOP_AT"


class CrashHook:
    """Test hook: BATCHRUN_TEST_CRASH_AT=point:n SIGKILLs this process the n-th time `point` is reached
    (BATCHRUN_TEST_STOP_AT=point:n SIGSTOPs it instead, once: a process frozen mid-commit).
    Points: step (after an engine step), mid_write (part bytes written, not yet published), after_part
    (published, no done marker yet), after_done (marker written), before_success (summary written),
    fanout (a deduplicated output computed, not yet given to its identical rows)."""

    def __init__(self, value: Optional[str], sig: int = signal.SIGKILL):
        self.point, self.n, self.count, self.sig = None, 1, 0, sig
        if value:
            point, _, n = value.partition(":")
            self.point, self.n = point, int(n or 1)
        self.lock = threading.Lock()
        self.stop_hook = CrashHook(os.environ.get(STOP_ENV), signal.SIGSTOP) if sig == signal.SIGKILL else None

    def __call__(self, point: str) -> None:
        if self.stop_hook is not None:
            self.stop_hook(point)
        if point != self.point:
            return
        with self.lock:
            self.count += 1
            if self.count == self.n or (self.count > self.n and self.sig == signal.SIGKILL):
                # to this thread: it stops (or dies) before the next line, not a moment later
                signal.pthread_kill(threading.get_ident(), self.sig)
