"""A full disk: a job's local output on a small tmpfs (mounted by the test; skipped, saying why, where
mounting is impossible) that fills up mid-job. The job stops with exit 74 naming the path; DuckDB's
`read_parquet('<out>/*.parquet')` sees only whole, committed parts; once space is freed a re-submit
completes with every id exactly once, equal to the clean run. (A part stored without its marker when
the disk filled is whole: a finished, fsynced temp file linked into view; the re-submit replaces it.)"""
from __future__ import annotations

import json
import os
import subprocess

import duckdb
import pytest

from batchrun.errors import EXIT_STORAGE
from hostile_util import invoke
from storejobs import UNITS, local_rows, reference  # noqa: F401 - fixture
from test_job_common import tiny_model, write_job  # noqa: F401 - fixture

DISK_KB = 1024
FREE_KB = 40         # what the ballast leaves: the manifest, the lock, a few units' parts and markers


@pytest.fixture
def small_disk(tmp_path):
    """A DISK_KB tmpfs mounted at tmp_path/disk, unmounted afterwards."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_KB}k", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield str(d)
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill(path: str, leave_kb: int) -> None:
    """Write a ballast file leaving about `leave_kb` KiB free on the filesystem of `path`."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(path, "ballast"), "wb") as f:
        f.write(b"\0" * max(0, free - leave_kb * 1024))


def test_disk_fills_mid_job_exit_74_then_resubmit_completes(small_disk, reference, tmp_path):
    src, job, ref = reference
    out = os.path.join(small_disk, "out")
    path = write_job(str(tmp_path / "job.yaml"), {**job, "output": {"uri": out}})
    fill(small_disk, FREE_KB)
    r = invoke("submit", path, "--no-progress", "--json")
    assert r.code == EXIT_STORAGE, r
    assert "Traceback" not in r.stdout + r.stderr, r
    err = json.loads(r.stdout.strip().splitlines()[-1])["error"]
    assert "No space left on device" in err and small_disk in err, err      # names the path
    marks = os.path.join(out, "_batchrun", "done")
    done = os.listdir(marks) if os.path.isdir(marks) else []
    assert len(done) < UNITS
    seen = duckdb.connect().execute(f"SELECT count(*), count(DISTINCT id) FROM read_parquet('{out}/*.parquet')"
                                    ).fetchone() if any(n.endswith(".parquet") for n in os.listdir(out)) else (0, 0)
    assert seen[0] == seen[1] <= len(ref)                 # whole parts only: every visible row readable, once
    os.remove(os.path.join(small_disk, "ballast"))
    r2 = invoke("submit", path, "--no-progress", "--json")
    assert r2.code == 0, r2
    summary = json.loads(r2.stdout.strip().splitlines()[-1])
    assert summary["units_skipped"] == len(done) and summary["units_committed"] == UNITS - len(done)
    assert local_rows(out) == ref
