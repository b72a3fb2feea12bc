"""Crash points for the crash tests: BATCHRUN_TEST_CRASH_AT="point:n" SIGKILLs this process the n-th
time execution passes `point` (step, before_publish, after_part, before_success). Unset, it costs a dict
lookup."""
from __future__ import annotations

import os
import signal

_spec = os.environ.get("BATCHRUN_TEST_CRASH_AT", "")
_point, _, _n = _spec.partition(":")
_count = {"n": 0}


def crash_point(name: str) -> None:
    if _point != name:
        return
    _count["n"] += 1
    if _count["n"] >= int(_n or 1):
        os.kill(os.getpid(), signal.SIGKILL)
