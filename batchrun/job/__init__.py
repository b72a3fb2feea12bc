"""The job runner: job files, plans, the checkpoint ledger, and the run loop (no engine internals).

Names are imported lazily so `batchrun status` and `batchrun query` do not pay for torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "JobSpec": "spec", "JobError": "spec", "load_job": "spec", "parse_job": "spec",
    "JobPlan": "plan", "make_plan": "plan",
    "JobRunner": "run", "run_job": "run", "Interrupted": "run", "EXIT_OK": "run", "EXIT_UNEXPECTED": "run",
    "EXIT_BAD_JOB": "run", "EXIT_INPUT": "run", "EXIT_FINGERPRINT": "run", "EXIT_INTERRUPTED": "run",
    "EXIT_LOCKED": "run", "JobLock": "lock", "LockHeld": "lock",
    "FingerprintMismatch": "ledger", "Ledger": "ledger",
    "job_status": "status", "format_status": "status",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"batchrun.job.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'batchrun.job' has no attribute {name!r}")
