"""Crash and signal tests with real subprocesses: SIGKILL at seven moments, SIGTERM and SIGINT; then
resubmit. Every time: count(*) = count(DISTINCT id) = N and the outputs equal an uninterrupted run.
While crashed, DuckDB sees only whole, correct parts and no duplicate."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from batchrun.job.run import EXIT_INTERRUPTED
from test_job_common import job_for as common_job_for
from test_job_common import cli, counts, popen_cli, reference_output, results, tiny_model, wait_for  # noqa: F401

N = 300
UNITS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):  # noqa: F811
    d = tmp_path_factory.mktemp("crash")
    job, ref = reference_output(d, tiny_model, N, unit_rows=25, seed=11)
    return d, job, ref


def job_for(setup, name):
    d, job, _ = setup
    return common_job_for(d, job, name)


def done_dir(out):
    return os.path.join(out, "_batchrun", "done")


def assert_consistent_while_down(out, ref):
    """What DuckDB sees after a crash: a subset of the final rows, each once, every part whole."""
    if not [n for n in os.listdir(out) if n.endswith(".parquet")]:
        return
    got = results(out)
    n, distinct = counts(out)
    assert n == distinct == len(got)
    assert set(got) <= set(ref)


def resume_and_check(path, out, ref):
    p = cli("submit", path, "--json", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert counts(out) == (N, N)
    assert results(out) == ref
    assert os.path.exists(os.path.join(out, "_SUCCESS"))
    tmp = os.path.join(out, "_batchrun", "tmp")
    assert not os.path.exists(tmp) or not os.listdir(tmp)
    assert len(os.listdir(done_dir(out))) == UNITS
    return p


@pytest.mark.parametrize("point", ["step:40", "mid_write:3", "after_part:3", "after_done:5", "before_success"])
def test_sigkill_at_a_hook_then_resume(setup, point):
    _, _, ref = setup
    path, out = job_for(setup, point.replace(":", "-"))
    p = cli("submit", path, "--no-progress", env={"BATCHRUN_TEST_CRASH_AT": point})
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    markers = len(os.listdir(done_dir(out))) if os.path.exists(done_dir(out)) else 0
    parts = sorted(n for n in os.listdir(out) if n.endswith(".parquet"))
    if point.startswith("mid_write"):
        assert markers == 2 and len(parts) == 2
        assert len(os.listdir(os.path.join(out, "_batchrun", "tmp"))) == 1     # the unpublished bytes
    elif point.startswith("after_part"):
        assert markers == 2 and len(parts) == 3                                 # one part without its marker
    elif point.startswith("after_done"):
        assert markers == 5 and len(parts) == 5
    elif point == "before_success":
        assert markers == UNITS and not os.path.exists(os.path.join(out, "_SUCCESS"))
        assert os.path.exists(os.path.join(out, "_batchrun", "summary.json"))
    else:   # mid-window: some units committed, the in-flight window not
        assert 0 < markers < UNITS
    assert_consistent_while_down(out, ref)
    resumed = resume_and_check(path, out, ref)
    if point == "after_part:3":
        assert "resuming" in resumed.stderr


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_a_random_moment_then_resume(setup, seed):
    """A random number of committed units, then a random few milliseconds: anywhere in read, step or
    write of the later units."""
    _, _, ref = setup
    rng = random.Random(seed)
    after_units, extra_s = rng.randint(1, UNITS - 3), rng.uniform(0.0, 0.05)
    path, out = job_for(setup, f"random-{seed}")
    proc = popen_cli("submit", path, "--no-progress")
    wait_for(lambda: os.path.exists(done_dir(out)) and len(os.listdir(done_dir(out))) >= after_units, proc,
             f"{after_units} committed units", timeout=120)
    time.sleep(extra_s)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not os.path.exists(os.path.join(out, "_SUCCESS"))
    assert_consistent_while_down(out, ref)
    resume_and_check(path, out, ref)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_with_exit_75_then_resume(setup, sig):
    _, _, ref = setup
    path, out = job_for(setup, f"sig-{sig.name}")
    proc = popen_cli("submit", path, "--no-progress", "--json")
    wait_for(lambda: os.path.exists(done_dir(out)) and os.listdir(done_dir(out)), proc, "a committed unit",
             timeout=120)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "re-submit to resume" in stderr
    assert '"state": "interrupted"' in stdout.strip().splitlines()[-1]
    # nothing half-written: every visible part has its marker, no temporary file is left
    parts = {n for n in os.listdir(out) if n.endswith(".parquet")}
    markers = {f"part-{int(n[:-5]):06d}.parquet" for n in os.listdir(done_dir(out))}
    assert parts == markers and 0 < len(parts) < UNITS
    tmp = os.path.join(out, "_batchrun", "tmp")
    assert not os.path.exists(tmp) or not os.listdir(tmp)
    st = cli("status", out, "--json").stdout
    assert '"state": "interrupted"' in st
    assert_consistent_while_down(out, ref)
    resume_and_check(path, out, ref)
