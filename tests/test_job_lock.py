"""The run lock (`_batchrun/lock.json`): one live run per output, stale locks of killed runs recovered.

Real processes and real signals throughout: holders are subprocesses that are SIGSTOPped (alive but
silent) or SIGKILLed (gone); racers are separate processes (local disk) or threads against a real S3
API server on loopback (moto). The invariants: a live holder is never displaced, exactly one contender
wins any race, and a job whose first run was refused or killed still ends with every id exactly once
and the outputs of an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from batchrun.connectors import ParquetSink
from batchrun.job.lock import LOCK, TAKEOVER_PREFIX, JobLock, LockHeld, process_space
from batchrun.job.run import EXIT_LOCKED, EXIT_OK
from test_job_common import job_for as common_job_for, wait_for
from test_job_common import (REPO, cli, counts, popen_cli, reference_output, results,  # noqa: F401
                             tiny_model)

N = 240
UNITS = 12


# -- helpers ---------------------------------------------------------------------------------------
def lock_path(out: str) -> str:
    return os.path.join(out, LOCK)


def read_lock(out: str):
    try:
        with open(lock_path(out)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_lock(out: str, rec: dict) -> None:
    os.makedirs(os.path.dirname(lock_path(out)), exist_ok=True)
    with open(lock_path(out), "w") as f:
        json.dump(rec, f)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def dead_holder() -> dict:
    """The record a run on this machine leaves when it is killed."""
    return {"token": uuid.uuid4().hex, "job": "x", "pid": dead_pid(), "host": "this",
            "process_space": process_space(), "heartbeat_at": time.time(), "started_at": time.time()}


def remote_holder(age_s: float) -> dict:
    """A run on another host whose last heartbeat was age_s ago."""
    t = time.time() - age_s
    return {"token": uuid.uuid4().hex, "job": "x", "pid": 1, "host": "elsewhere",
            "process_space": "elsewhere|boot|pid:[1]", "heartbeat_at": t, "started_at": t}


HOLDER = r"""
import os, sys, time
from batchrun.connectors import ParquetSink
from batchrun.job.lock import JobLock
lock = JobLock(ParquetSink(sys.argv[1]), "holder")
rec = lock.acquire()
print(rec["token"], flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), 9)
time.sleep(600)
"""


def holder(out: str, mode: str) -> tuple[subprocess.Popen, str]:
    """A real process that takes the lock of `out`; mode "die": then SIGKILLs itself, "hold": sleeps."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, out, mode], stdout=subprocess.PIPE, text=True, cwd=REPO)
    token = p.stdout.readline().strip()
    assert token, "the holder process did not take the lock"
    if mode == "die":
        assert p.wait(timeout=60) == -signal.SIGKILL
    return p, token


# -- the lock itself -------------------------------------------------------------------------------
def test_a_live_holder_refuses_others_and_release_frees_it(tmp_path):
    sink = ParquetSink(str(tmp_path / "out"))
    a = JobLock(sink, "job-a")
    rec = a.acquire()
    assert read_lock(str(tmp_path / "out"))["token"] == rec["token"]
    with pytest.raises(LockHeld) as e:
        JobLock(sink, "job-a").acquire()
    assert f"pid {os.getpid()}" in str(e.value) and "lock.json" in str(e.value)
    assert e.value.holder["token"] == rec["token"]
    a.release()
    assert read_lock(str(tmp_path / "out")) is None
    b = JobLock(sink, "job-a")
    assert b.acquire()["token"] != rec["token"]
    b.release()


def test_release_never_removes_a_lock_that_is_no_longer_ours(tmp_path):
    out = str(tmp_path / "out")
    a = JobLock(ParquetSink(out), "j")
    a.acquire()
    other = remote_holder(0)
    write_lock(out, other)              # as if another run had taken it over after our silence
    assert a.heartbeat() is False       # the holder learns it lost the lock ...
    a.release()                         # ... and its release leaves the new holder's lock alone
    assert read_lock(out)["token"] == other["token"]


def test_a_killed_holder_on_this_machine_is_taken_over_at_once(tmp_path):
    out = str(tmp_path / "out")
    _, dead_token = holder(out, "die")
    assert read_lock(out)["token"] == dead_token          # SIGKILL left it behind
    msgs = []
    lock = JobLock(ParquetSink(out), "j", log=msgs.append)
    assert lock.stale_reason(read_lock(out)) is not None
    rec = lock.acquire()
    assert read_lock(out)["token"] == rec["token"] != dead_token
    assert any("taking over the stale lock" in m and "not running" in m for m in msgs), msgs
    lock.release()
    assert not [n for n in os.listdir(os.path.join(out, "_batchrun")) if n.startswith("lock")]


def test_a_reused_pid_does_not_keep_a_dead_runs_lock(tmp_path):
    out = str(tmp_path / "out")
    p, _ = holder(out, "hold")
    try:
        rec = read_lock(out)
        assert JobLock(ParquetSink(out)).stale_reason(rec) is None
        # the same pid, but a different process start time: the pid now belongs to another process
        write_lock(out, {**rec, "pid_start": str(int(rec["pid_start"]) + 1)})
        reason = JobLock(ParquetSink(out)).stale_reason(read_lock(out))
        assert reason is not None and "pid reused" in reason
    finally:
        p.kill()
        p.wait()


def test_a_live_process_on_this_machine_is_never_taken_over_even_when_silent(tmp_path):
    out = str(tmp_path / "out")
    p, token = holder(out, "hold")
    try:
        os.kill(p.pid, signal.SIGSTOP)               # alive but frozen: no heartbeat
        write_lock(out, {**read_lock(out), "heartbeat_at": time.time() - 3600})
        with pytest.raises(LockHeld):
            JobLock(ParquetSink(out), "j").acquire()
        assert read_lock(out)["token"] == token
    finally:
        p.kill()
        p.wait()
    lock = JobLock(ParquetSink(out), "j")            # once it is gone, the lock is recovered
    assert lock.acquire()["token"] != token
    lock.release()


def test_another_hosts_lock_is_judged_by_its_heartbeat(tmp_path):
    out = str(tmp_path / "out")
    fresh = remote_holder(5)
    write_lock(out, fresh)
    with pytest.raises(LockHeld) as e:
        JobLock(ParquetSink(out), "j", stale_after_s=60).acquire()
    assert "host elsewhere" in str(e.value)
    assert read_lock(out)["token"] == fresh["token"]
    write_lock(out, remote_holder(61))
    msgs = []
    lock = JobLock(ParquetSink(out), "j", stale_after_s=60, log=msgs.append)
    rec = lock.acquire()
    assert read_lock(out)["token"] == rec["token"]
    assert any("no heartbeat for" in m for m in msgs), msgs
    lock.release()


def test_an_unreadable_lock_is_judged_by_its_age(tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "_batchrun"))
    with open(lock_path(out), "w") as f:
        f.write("{not json")
    with pytest.raises(LockHeld) as e:
        JobLock(ParquetSink(out), "j", stale_after_s=60).acquire()
    assert "unreadable" in str(e.value)
    old = time.time() - 3600
    os.utime(lock_path(out), (old, old))
    lock = JobLock(ParquetSink(out), "j", stale_after_s=60)
    assert lock.acquire()["token"] == read_lock(out)["token"]
    lock.release()


def test_takeover_claims_a_live_one_blocks_an_abandoned_one_does_not(tmp_path):
    out = str(tmp_path / "out")
    stale = dead_holder()
    write_lock(out, stale)
    claim0 = os.path.join(out, f"{TAKEOVER_PREFIX}{stale['token']}.0")
    p, _ = holder(str(tmp_path / "elsewhere"), "hold")     # a live process to stand in as the claimer
    try:
        with open(claim0, "w") as f:
            json.dump({"pid": p.pid, "process_space": process_space(), "heartbeat_at": time.time()}, f)
        with pytest.raises(LockHeld) as e:                  # someone live is taking it over right now
            JobLock(ParquetSink(out), "j").acquire()
        assert "taking over" in str(e.value)
        assert read_lock(out)["token"] == stale["token"]
    finally:
        p.kill()
        p.wait()
    # the claimer died mid-takeover: its claim is stale, the next contender claims .1 and proceeds
    lock = JobLock(ParquetSink(out), "j")
    rec = lock.acquire()
    assert read_lock(out)["token"] == rec["token"]
    lock.release()


def test_heartbeat_refreshes_and_a_lost_lock_is_reported(tmp_path):
    out = str(tmp_path / "out")
    lock = JobLock(ParquetSink(out), "j")
    first = lock.acquire()["heartbeat_at"]
    lost = threading.Event()
    messages = []
    lock.start_heartbeat(0.05, lambda m: (messages.append(m), lost.set()))
    deadline = time.time() + 30
    while read_lock(out)["heartbeat_at"] <= first:
        assert time.time() < deadline, "the heartbeat never refreshed the lock"
        time.sleep(0.01)
    write_lock(out, remote_holder(0))                 # taken over behind our back
    assert lost.wait(30), "the heartbeat did not notice the lost lock"
    assert "no longer ours" in messages[0]
    lock.release()
    assert read_lock(out)["host"] == "elsewhere"


RACER = r"""
import json, os, sys, time
from batchrun.connectors import ParquetSink
from batchrun.job.lock import JobLock, LockHeld
sync, wid, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = []                                   # winners keep their lock until the test ends
open(f"{sync}/ready-{wid}", "w").close()
for r in range(rounds):
    while not os.path.exists(f"{sync}/go-{r}"):
        if os.path.exists(f"{sync}/end"):       # the test ended early (a failed round)
            sys.exit(0)
        time.sleep(0.0005)
    lock = JobLock(ParquetSink(f"{sync}/out-{r}"), "race")
    try:
        res = {"won": lock.acquire()["token"]}
        held.append(lock)
    except LockHeld as e:
        res = {"held": str(e)}
    except Exception as e:
        res = {"error": repr(e)}
    with open(f"{sync}/res-{r}-{wid}.tmp", "w") as f:
        json.dump(res, f)
    os.rename(f"{sync}/res-{r}-{wid}.tmp", f"{sync}/res-{r}-{wid}")
while not os.path.exists(f"{sync}/end"):
    time.sleep(0.01)
"""


def test_racing_processes_exactly_one_wins_fresh_and_stale_locks(tmp_path):
    """6 processes race for the same lock, 8 times: free, left by a killed local run, left by a silent
    remote run. Every time exactly one wins, the others are refused, and the lock is the winner's."""
    sync = str(tmp_path)
    workers, setups = 6, ["free", "free", "free", "dead", "dead", "dead", "remote", "remote"]
    procs = [subprocess.Popen([sys.executable, "-c", RACER, sync, str(w), str(len(setups))], cwd=REPO)
             for w in range(workers)]
    try:
        deadline = time.time() + 120
        while not all(os.path.exists(f"{sync}/ready-{w}") for w in range(workers)):
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.01)
        for r, setup in enumerate(setups):
            out = f"{sync}/out-{r}"
            before = {"dead": dead_holder, "remote": lambda: remote_holder(3600)}.get(setup)
            if before:
                write_lock(out, before())
            open(f"{sync}/go-{r}", "w").close()
            res = []
            for w in range(workers):
                while not os.path.exists(f"{sync}/res-{r}-{w}"):
                    assert time.time() < deadline and procs[w].poll() is None
                    time.sleep(0.005)
                with open(f"{sync}/res-{r}-{w}") as f:
                    res.append(json.load(f))
            winners = [x["won"] for x in res if "won" in x]
            assert len(winners) == 1, (setup, res)
            assert sum("held" in x for x in res) == workers - 1, (setup, res)
            assert read_lock(out)["token"] == winners[0]
    finally:
        open(f"{sync}/end", "w").close()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


# -- the same against a real S3 API (moto's server on loopback) -------------------------------------
@pytest.fixture(scope="module")
def s3():
    import boto3
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url, aws_access_key_id="moto-fake-key-id", aws_secret_access_key="moto-fake-secret",
                 region_name="us-east-1").create_bucket(Bucket="locks")
    yield {"key": "moto-fake-key-id", "secret": "moto-fake-secret", "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"}}
    server.stop()


def test_s3_racing_threads_exactly_one_wins_and_stale_locks_are_recovered(s3):
    workers = 6
    for r, setup in enumerate(["free", "free", "dead", "remote", "remote"]):
        sink = ParquetSink(f"s3://locks/race-{r}", s3)
        if setup != "free":
            rec = dead_holder() if setup == "dead" else remote_holder(3600)
            sink.fs.pipe_file(sink.path(LOCK), json.dumps(rec).encode())
        barrier = threading.Barrier(workers)
        res: list = [None] * workers

        def race(w):
            lock = JobLock(ParquetSink(f"s3://locks/race-{r}", s3), "race")
            barrier.wait()
            try:
                res[w] = ("won", lock.acquire()["token"])
            except LockHeld as e:
                res[w] = ("held", str(e))
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                res[w] = ("error", repr(e))
        threads = [threading.Thread(target=race, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        winners = [x[1] for x in res if x and x[0] == "won"]
        assert len(winners) == 1 and sum(1 for x in res if x and x[0] == "held") == workers - 1, (setup, res)
        assert json.loads(sink.fs.cat_file(sink.path(LOCK)))["token"] == winners[0]
    # release on S3 removes only our own lock
    sink = ParquetSink("s3://locks/release", s3)
    lock = JobLock(sink, "j")
    lock.acquire()
    assert lock.heartbeat() is True
    lock.release()
    assert not sink.fs.exists(sink.path(LOCK))


# -- batchrun submit under the lock (real subprocesses, the tiny model) ------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):  # noqa: F811
    d = tmp_path_factory.mktemp("lock")
    job, ref = reference_output(d, tiny_model, N, unit_rows=20, seed=5)
    return d, job, ref


def job_for(setup, name):
    d, job, _ = setup
    return common_job_for(d, job, name)


def n_done(out):
    d = os.path.join(out, "_batchrun", "done")
    return len(os.listdir(d)) if os.path.exists(d) else 0


def assert_complete(out, ref):
    assert counts(out) == (N, N)            # every id exactly once
    assert results(out) == ref              # and the outputs of an uninterrupted run
    assert n_done(out) == UNITS
    assert read_lock(out) is None           # released at the end


def test_a_second_submit_is_refused_while_the_first_runs(setup):
    _, _, ref = setup
    path, out = job_for(setup, "second")
    first = popen_cli("submit", path, "--no-progress", "--json")
    try:
        wait_for(lambda: read_lock(out) is not None, first, "the first run's lock")
        os.kill(first.pid, signal.SIGSTOP)        # keep it alive and mid-run while the others try
        assert read_lock(out)["pid"] == first.pid
        done_before = n_done(out)
        for extra in ([], ["--restart"]):         # --restart must not bypass a live lock either
            r = cli("submit", path, "--no-progress", "--json", *extra)
            assert r.returncode == EXIT_LOCKED, r.stderr[-3000:]
            last = json.loads(r.stdout.strip().splitlines()[-1])
            assert last["exit_code"] == EXIT_LOCKED and f"pid {first.pid}" in last["error"]
            assert "another run of this job is live" in r.stderr
            assert n_done(out) == done_before     # nothing of the first run's was touched
        st = json.loads(cli("status", out, "--json").stdout)
        assert st["lock"]["pid"] == first.pid and st["lock"]["stale"] is None
    finally:
        os.kill(first.pid, signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == EXIT_OK, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["rows"] == N
    assert_complete(out, ref)


def test_sigkill_leaves_a_stale_lock_the_next_submit_recovers_and_sigterm_releases(setup):
    _, _, ref = setup
    path, out = job_for(setup, "killed")
    first = popen_cli("submit", path, "--no-progress")
    wait_for(lambda: n_done(out) >= 2, first, "two committed units")
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=60) == -signal.SIGKILL
    assert read_lock(out)["pid"] == first.pid           # left behind by the killed run
    st = json.loads(cli("status", out, "--json").stdout)
    assert "not running" in st["lock"]["stale"]

    second = popen_cli("submit", path, "--no-progress", "--json")
    killed_at = n_done(out)
    wait_for(lambda: n_done(out) > killed_at, second, "a unit committed by the resumed run")
    assert read_lock(out)["pid"] == second.pid          # it took the stale lock over
    second.send_signal(signal.SIGTERM)
    _, stderr = second.communicate(timeout=120)
    assert second.returncode == 75, stderr[-3000:]
    assert "taking over the stale lock" in stderr and f"process {first.pid}" in stderr
    assert read_lock(out) is None                       # released on SIGTERM

    third = cli("submit", path, "--no-progress", "--json")
    assert third.returncode == EXIT_OK, third.stderr[-3000:]
    assert "taking over" not in third.stderr
    assert_complete(out, ref)


def test_submit_takes_over_a_silent_remote_lock_but_not_a_live_one(setup):
    _, _, ref = setup
    path, out = job_for(setup, "remote")
    live = remote_holder(5)
    write_lock(out, live)
    r = cli("submit", path, "--no-progress", "--json")
    assert r.returncode == EXIT_LOCKED and "host elsewhere" in r.stderr, r.stderr[-3000:]
    assert read_lock(out)["token"] == live["token"]
    write_lock(out, remote_holder(3600))
    r = cli("submit", path, "--no-progress", "--json")
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    assert "taking over the stale lock" in r.stderr and "no heartbeat for" in r.stderr
    assert_complete(out, ref)
