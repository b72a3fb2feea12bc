"""One live run per job output: `_batchrun/lock.json`, created create-only, kept fresh by a heartbeat.

Why: a scheduler may start a job while an earlier attempt still runs (an Airflow retry after a lost
worker, a cron tick while last night's run is still busy). Two live runs of one output would compute
every unit twice, and a `--restart` could erase the other run's results. `batchrun submit` takes this
lock before it touches the ledger and refuses (LockHeld, exit 73) while another live run holds it.

Record: token (random), job, pid, host, process_space, pid_start, started_at, heartbeat_at,
stale_after_s.

Acquire is create-only (OutputStore.put_new, as for done markers), so of any number of contenders
exactly one creates the file. Local filesystems: link() of a fully written temp file (EEXIST for the
losers; a reader never sees a torn lock). Object stores: a create-only PUT (S3: If-None-Match: *,
answered 412 for the losers). Every file operation goes through the store (connectors/store.py).

A lock is stale when its holder is provably gone:
  * same machine and PID namespace (hostname, boot id and pid namespace all equal): its pid is not
    running, or runs another process (different start time: the pid was reused). A live pid on the
    same machine is never taken over, even if it is stuck: kill it first.
  * anywhere else (another host or pod): its heartbeat is older than stale_after_s (default 60 s,
    env BATCHRUN_LOCK_STALE_S). Clocks are assumed synchronised to well within that.
The holder rewrites heartbeat_at every few seconds from a background thread, so a long weight load or a
long engine step never ages it.

Taking over a stale lock with token T is race-safe: a contender first creates, create-only,
`_batchrun/lock.takeover-T.<n>`; of all contenders that saw T exactly one succeeds (n > 0 only when an
earlier taker died mid-takeover: its claim goes stale after stale_after_s). The winner removes the
lock only if it still carries T (OutputStore.remove_if; local: read, and only a T lock renamed aside
and checked again, put back if it changed: a lock that is not T never goes missing, so a late contender that read T before the
winner replaced it, and claims T after the winner's claim is gone, removes nothing), then acquires
create-only like anyone else. Release removes the lock only if it still carries our token.
Remaining window, object stores only: between reading T and deleting it (milliseconds), and only if
T's holder was alive after all and released in exactly that moment.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from batchrun.job.process import pid_alive, pid_start, process_space

LOCK = "_batchrun/lock.json"
TAKEOVER_PREFIX = "_batchrun/lock.takeover-"
STALE_AFTER_S = 60.0
STALE_ENV = "BATCHRUN_LOCK_STALE_S"
MAX_CLAIMS = 32     # abandoned takeover claims tolerated for one stale token


class LockHeld(Exception):
    """Another live run holds the job's lock (exit code 73: retry later, do not start a second copy)."""

    def __init__(self, message: str, holder: Optional[dict] = None):
        super().__init__(message)
        self.holder = holder or {}


def _record(data: bytes) -> Optional[dict]:
    """A lock record's JSON object; None if the bytes are not one."""
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _stale_after() -> float:
    v = os.environ.get(STALE_ENV)
    return float(v) if v else STALE_AFTER_S


def _iso(t: Any) -> str:
    try:
        return datetime.fromtimestamp(float(t), timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    except (TypeError, ValueError):
        return "?"


class JobLock:
    """The run lock of one output (an OutputStore: its filesystem and root)."""

    def __init__(self, store, job: str = "", stale_after_s: Optional[float] = None,
                 log: Optional[Callable[[str], None]] = None):
        self.store = store
        self.url = f"{store.url.rstrip('/')}/{LOCK}"
        self.job = job
        self.stale_after_s = _stale_after() if stale_after_s is None else float(stale_after_s)
        self.log = log or (lambda msg: None)
        self.token: Optional[str] = None
        self.record: Optional[dict] = None
        self._claims: list[str] = []
        self._io = threading.Lock()          # heartbeat thread vs release
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- records in the store ----------------------------------------------------------------------
    def _create(self, name: str, obj: dict) -> bool:
        """Create `name` (relative to the output) holding `obj` unless it exists; True if we created it."""
        data = json.dumps(obj, sort_keys=True).encode()
        for _ in range(3):
            try:
                return self.store.put_new(name, data)
            except FileNotFoundError:    # the holder's ledger.open emptied _batchrun/tmp under our temp file
                continue
        return False

    def _read(self, name: str) -> Optional[dict]:
        """The record `name`, None if absent; an unreadable one reads as {} with its mtime as heartbeat."""
        try:
            data = self.store.read(name)
        except FileNotFoundError:
            return None
        obj = _record(data)
        return obj if obj is not None else {"unreadable": True, "heartbeat_at": self.store.modified(name)}

    def _remove_if(self, name: str, token: Optional[str]) -> bool:
        """Remove `name` if its record carries `token` (read, checked, removed: OutputStore.remove_if)."""
        return self.store.remove_if(name, lambda data: (_record(data) or {}).get("token") == token)

    # -- staleness -------------------------------------------------------------------------------
    def stale_reason(self, rec: dict, now: Optional[float] = None) -> Optional[str]:
        """Why the lock record `rec` belongs to a run that is gone; None if its holder may be alive."""
        now = time.time() if now is None else now
        pid = rec.get("pid")
        if rec.get("process_space") == process_space() and isinstance(pid, int):
            if not pid_alive(pid):
                return f"process {pid} on this machine is not running"
            start = pid_start(pid)
            if rec.get("pid_start") and start and start != rec["pid_start"]:
                return f"process {pid} on this machine is another process now (pid reused)"
            return None
        limit = max(self.stale_after_s, float(rec.get("stale_after_s") or 0))
        age = now - float(rec.get("heartbeat_at") or 0)
        if age > limit:
            return f"no heartbeat for {age:.0f}s (limit {limit:.0f}s)"
        return None

    def describe(self, rec: dict) -> str:
        if rec.get("unreadable"):
            return f"an unreadable lock file (written {_iso(rec.get('heartbeat_at'))})"
        age = time.time() - float(rec.get("heartbeat_at") or 0)
        return (f"pid {rec.get('pid')} on host {rec.get('host')}, job {rec.get('job')!r}, started "
                f"{_iso(rec.get('started_at'))}, last heartbeat {age:.0f}s ago")

    # -- acquire / heartbeat / release -------------------------------------------------------------
    def acquire(self) -> dict:
        """Take the lock or raise LockHeld. A stale lock is taken over (see the module docstring)."""
        try:
            return self._acquire()
        finally:
            for claim in self._claims:         # won or lost, our takeover claims have served their turn;
                self._rm(claim)                # a latecomer's removal still checks the token first
            self._claims = []

    def _acquire(self) -> dict:
        now = time.time()
        token = uuid.uuid4().hex
        me = os.getpid()
        rec = {"token": token, "job": self.job, "pid": me, "host": socket.gethostname(),
               "process_space": process_space(), "pid_start": pid_start(me), "started_at": now,
               "heartbeat_at": now, "stale_after_s": self.stale_after_s}
        for _ in range(8):           # each round either wins, refuses, or removed a stale lock
            if self._create(LOCK, rec):
                self.token, self.record = token, rec
                return rec
            held = self._read(LOCK)
            if held is None:
                continue                       # released in between: try again
            why = self.stale_reason(held)
            if why is None:
                raise LockHeld(f"{self.url}: another run of this job is live: {self.describe(held)}. Not "
                               "starting a second one; re-submit after it ends (a killed run's lock is "
                               "recovered at once on the same machine, after "
                               f"{self.stale_after_s:.0f}s of silence elsewhere).", held)
            claim = self._claim(held)
            if claim is None:
                raise LockHeld(f"{self.url}: another submit is taking over the stale lock of "
                               f"{self.describe(held)} right now; re-submit later.", held)
            self._claims.append(claim)
            self.log(f"batchrun: taking over the stale lock of {self.describe(held)}: {why}")
            self._remove_if(LOCK, held.get("token"))
        raise LockHeld(f"{self.url}: could not take the lock (it keeps changing hands); re-submit later.")

    def _claim(self, held: dict) -> Optional[str]:
        """Create-only the takeover claim for `held`; None if a live claim by someone else exists."""
        token = held.get("token") or f"unreadable-{int(float(held.get('heartbeat_at') or 0))}"
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "process_space": process_space(),
                "pid_start": pid_start(os.getpid()), "heartbeat_at": time.time(),
                "stale_after_s": self.stale_after_s}
        for n in range(MAX_CLAIMS):
            name = f"{TAKEOVER_PREFIX}{token}.{n}"
            if self._create(name, mine):
                return name
            other = self._read(name)
            if other is not None and self.stale_reason(other) is None:
                return None                  # a live contender is taking it over
        return None

    def _rm(self, name: str) -> None:
        try:
            self.store.remove([name])
        except Exception as e:   # noqa: BLE001 - a leftover claim is harmless: removals check the token
            self.log(f"batchrun: could not remove {self.store.url_of(name)}: {e}")

    def heartbeat(self) -> bool:
        """Refresh heartbeat_at; False if the lock is no longer ours (taken over as stale, or removed)."""
        with self._io:
            if self.token is None:
                return False
            held = self._read(LOCK)
            if held is None:             # a contender may have it renamed aside for a moment: look again
                time.sleep(0.2)
                held = self._read(LOCK)
            if held is None or held.get("token") != self.token:
                return False
            self.record = {**self.record, "heartbeat_at": time.time()}
            self.store.replace(LOCK, json.dumps(self.record, sort_keys=True).encode())
            return True

    def start_heartbeat(self, interval_s: float, on_lost: Callable[[str], None]) -> None:
        """Heartbeat every interval_s from a daemon thread; on_lost(message) once if the lock is lost."""
        def loop():
            while not self._stop.wait(interval_s):
                try:
                    ok = self.heartbeat()
                except Exception as e:   # noqa: BLE001 - a failed refresh is retried next time
                    self.log(f"batchrun: could not refresh {self.url}: {e}")
                    continue
                if not ok and not self._stop.is_set():
                    on_lost(f"{self.url} is no longer ours (taken over by another run after our heartbeat "
                            f"went silent, or removed); stopping")
                    return
        self._thread = threading.Thread(target=loop, name="batchrun-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self, wait_s: float = 30.0) -> None:
        """Stop the heartbeat and remove the lock if it is still ours. Never raises; safe to call twice
        and from a signal handler (waits at most wait_s for a heartbeat in flight)."""
        self._stop.set()
        if not self._io.acquire(timeout=wait_s):
            return                   # a lock left behind is recovered as stale by the next submit
        try:
            token, self.token = self.token, None
            if token is not None:
                self._remove_if(LOCK, token)
        except Exception as e:   # noqa: BLE001
            self.log(f"batchrun: could not remove {self.url}: {e}")
        finally:
            self._io.release()
        t = self._thread             # stopped: it exits at its next wake-up, which _stop makes immediate
        if t is not None and t is not threading.current_thread():
            t.join(timeout=wait_s)

    def read(self) -> Optional[dict]:
        """The current lock record, None when no run holds the lock (for `batchrun status`)."""
        return self._read(LOCK)
