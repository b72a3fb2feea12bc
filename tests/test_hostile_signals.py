"""Real processes, real signals: a run that fails while its reader thread is reading exits with its
error, every time (it used to hang or abort in pyarrow's thread-pool shutdown now and then); SIGTERM or
SIGINT at any moment of start-up is exit 75 and one line, with nothing committed lost and no lock left."""
from __future__ import annotations

import os
import signal
import subprocess
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.job.lock import LOCK
from hostile_util import DEADLINE_S, Outcome, catches, committed, fails, job, rows, run
from test_job_common import job_dict, popen_cli, tiny_model, wait_for  # noqa: F401 - fixture

RUNS = 5           # tries of the failing run: the hang was 2 in 60 before the fix; each run costs ~3 s


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """An input long enough that the reader is busy (80 units) when the engine fails to start."""
    d = tmp_path_factory.mktemp("signals")
    n = 8000
    words = "river stone cloud paper engine garden window music table light".split()
    texts = [" ".join(words[(i + k) % 10] for k in range(5 + i % 40)) for i in range(n)]
    (d / "in").mkdir()
    pq.write_table(pa.table({"id": list(range(n)), "text": texts}), str(d / "in" / "p.parquet"), row_group_size=100)
    return d


def finish(p: subprocess.Popen) -> Outcome:
    out, err = p.communicate(timeout=DEADLINE_S)      # a hang fails the test here
    return Outcome(p.returncode, out, err)


def test_engine_start_failure_with_the_reader_busy_exits_every_time(d, tiny_model):  # noqa: F811
    jf = job(d, tiny_model, "in", name="fail.yaml", out="fail", input={"passthrough": []},
             engine={"kv_cache_memory": 1000}, plan={"unit_rows": 100, "window_units": 8})
    for _ in range(RUNS):      # exit 3 exactly: not -6 (an abort at exit), not a timeout (a hang)
        fails(run("submit", jf, "--no-progress"), 3, "kv_cache_memory")
        assert not os.path.exists(d / "fail" / LOCK)


def test_the_reader_is_joined_before_a_failed_run_returns(d, tiny_model):  # noqa: F811
    """The shutdown path itself: when the engine fails to start, run() returns only once the reader
    thread, busy reading and tokenizing a 4000-row unit, has stopped (a reader left inside pyarrow can
    hang interpreter exit)."""
    from batchrun.job.plan import make_plan
    from batchrun.job.run import JobRunner
    from batchrun.job.spec import parse_job
    from batchrun.models.loader import ModelError
    spec = parse_job(job_dict(tiny_model, str(d / "in"), str(d / "joined"), input={"passthrough": []},
                              engine={"kv_cache_memory": 1000}, plan={"unit_rows": 4000, "window_units": 2}))
    with pytest.raises(ModelError, match="kv_cache_memory"):
        JobRunner(make_plan(spec), progress_bar=False).run()
    assert not [t for t in threading.enumerate() if t.name.startswith("batchrun-") and t.is_alive()]


def test_csv_input_error_exits_cleanly_every_time(d, tiny_model):  # noqa: F811
    """A CSV read for its schema, then a job stopped by a missing column: pyarrow's streaming reader,
    dropped unread, aborted the interpreter at exit one time in three (exit 134 instead of 3)."""
    with open(d / "p.csv", "w") as f:     # 5 MB: the read-ahead is still going when the process exits
        f.write("id,text\n" + "".join(f"{i},row {i} and some words to make the file long\n" for i in range(80_000)))
    jf = job(d, tiny_model, "p.csv", name="csv.yaml", out="csv", input={"passthrough": [], "prompt_column": "txt"})
    for _ in range(RUNS):
        fails(run("validate", jf), 3, "input.prompt_column", "'txt'")


@pytest.mark.parametrize("command, sig", [("validate", signal.SIGTERM), ("submit", signal.SIGINT)])
def test_signal_during_start_up(d, tiny_model, command, sig):  # noqa: F811
    """The CLI holds the signals before it imports torch; one arriving while it imports and plans ends
    the process with 75 and one line (it used to be a bare kill, or a KeyboardInterrupt traceback)."""
    jf = job(d, tiny_model, "in", name=f"{command}.yaml", out=command, input={"passthrough": []})
    p = popen_cli(command, jf, "--json")
    wait_for(lambda: catches(p.pid, signal.SIGTERM), p, "its signal handler", DEADLINE_S)
    p.send_signal(sig)
    r = finish(p)
    fails(r, 75, f"stopped by {sig.name}")
    assert '"state": "interrupted"' in r.stdout.splitlines()[-1]
    assert not os.path.exists(d / command / LOCK)


def test_sigterm_once_the_run_holds_its_lock_then_resume(d, tiny_model):  # noqa: F811
    """The run's own handlers are in place (lock taken, weights loading): 75, the lock released, and
    a re-submit computes every row exactly once."""
    pq.write_table(pa.table({"id": list(range(20)), "text": [f"row {i} of twenty" for i in range(20)]}),
                   str(d / "small.parquet"), row_group_size=10)
    jf = job(d, tiny_model, "small.parquet", name="load.yaml", out="load", input={"passthrough": []},
             plan={"unit_rows": 10, "window_units": 1})
    p = popen_cli("submit", jf, "--no-progress")
    wait_for(lambda: os.path.exists(d / "load" / LOCK), p, "the run lock", DEADLINE_S)
    p.send_signal(signal.SIGTERM)
    fails(finish(p), 75, "stopped by SIGTERM")
    assert not os.path.exists(d / "load" / LOCK)
    kept = rows(str(d / "load")) if committed(str(d / "load")) else []
    assert run("submit", jf, "--no-progress").code == 0
    got = rows(str(d / "load"))
    assert sorted(g[0] for g in got) == list(range(20)) and set(kept) <= set(got)
