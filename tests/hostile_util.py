"""Helpers of the hostile-input suite (tests/test_hostile_*.py): run the CLI as a careless user would,
then check what that user sees. No tests here.

Every failing case must end in a documented exit code and its error as one stderr line, `batchrun: ...`,
naming what is at fault, with no traceback; a bad row must become an error row instead. In-process runs
(typer's CliRunner, the same code path as the `batchrun` command) keep the suite fast; real processes
are used where the process itself is the point (signals, hangs, permissions, the log of exit 1).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Optional

import duckdb
import pytest
from typer.testing import CliRunner

from test_job_common import cli, job_dict, write_job

DEADLINE_S = 60          # a generous bound: a failing run must be gone long before it
PR_CAPBSET_DROP = 24
DAC_CAPS = (1, 2, 3)     # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


class Outcome:
    """What the user saw: exit code, stdout, stderr."""

    def __init__(self, code: int, stdout: str, stderr: str, exception: Optional[BaseException] = None):
        self.code, self.stdout, self.stderr, self.exception = code, stdout, stderr, exception

    def __repr__(self) -> str:
        return f"exit {self.code}\nstdout: {self.stdout[-2000:]}\nstderr: {self.stderr[-3000:]}"


def invoke(*args: str) -> Outcome:
    """`batchrun ARGS` in this process (typer's CliRunner)."""
    from batchrun.cli import app
    r = CliRunner().invoke(app, list(args))
    return Outcome(r.exit_code, r.stdout, r.stderr, r.exception)


def run(*args: str, preexec=None, env: Optional[dict] = None, timeout: float = DEADLINE_S) -> Outcome:
    """`python -m batchrun.cli ARGS` as a real process that must exit within `timeout` s."""
    p = cli(*args, env=env, timeout=timeout, preexec=preexec)
    return Outcome(p.returncode, p.stdout, p.stderr)


def fails(r: Outcome, code: int, *needles: str) -> str:
    """Assert exit `code`, no traceback, and the error as one stderr line (the last) holding every needle;
    returns that line. Lines before it may only be batchrun's own notes (`resuming ...`)."""
    assert r.code == code, r
    assert r.exception is None or isinstance(r.exception, SystemExit), (r, r.exception)
    assert "Traceback" not in r.stdout + r.stderr, r
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines and all(x.startswith("batchrun: ") for x in lines), r
    for n in needles:
        assert n in lines[-1], (n, lines[-1])
    return lines[-1]


def succeeds(r: Outcome) -> None:
    assert r.code == 0 and r.exception is None, (r, r.exception)


def job(d, model_path: str, input_uri: str, name: str = "job.yaml", out: str = "out", **sections) -> str:
    """A job file d/name over input_uri (relative to d, or absolute) writing d/out; `sections` as job_dict."""
    return write_job(str(d / name), job_dict(model_path, input_uri, out, **sections))


def rows(out: str) -> list[tuple]:
    """(id, finish_reason, error) of every committed row, through DuckDB, errors last."""
    return duckdb.connect().execute(f"SELECT id, finish_reason, error FROM read_parquet('{out}/*.parquet') "
                                    "ORDER BY error NULLS FIRST, id").fetchall()


def committed(out: str) -> int:
    """Done markers under the output: committed units."""
    d = os.path.join(out, "_batchrun", "done")
    return len(os.listdir(d)) if os.path.isdir(d) else 0


def _drop_dac() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in DAC_CAPS:
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def as_user():
    """preexec_fn that makes the child obey file permissions as a non-root user would. Root keeps its
    uid (the venv's interpreter lives under /root, which no other user may enter) but loses the
    capabilities that bypass permission bits, from the bounding set, so they are gone after exec.
    Skips the test where that is impossible (no CAP_SETPCAP in this container)."""
    if os.geteuid() != 0:
        return None
    probe = subprocess.run([sys.executable, "-c", "open('/proc/self/status').read()"], preexec_fn=_drop_dac,
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here (no CAP_SETPCAP): permission bits do not bind root")
    return _drop_dac


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has installed a handler for `signum` (SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(x.split()[1], 16) for x in f if x.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signum - 1) & 1)
