"""Committing one unit: its part file created create-only, then its done marker created create-only.

The part file's name is fixed (`part-<k>.parquet`), so `read_parquet('<output>/*.parquet')` can never
see two copies of a unit; creating it create-only (S3 `If-None-Match: *`, local link()) makes its
creator the only worker that may write the unit's marker. So a marker always describes the part file
next to it: a second worker on the same unit finds the part there and does not overwrite it (before,
its PUT could replace the first worker's file between its marker check and its PUT, leaving the
first worker's marker describing the second worker's bytes).

A part that exists without a marker was either published a moment ago by a live worker that is about
to write the marker, or left by a worker that died in between. It is replaced only when the job's lock
proves its writer gone (may_replace, below): every part carries its writer in its Parquet metadata
(`batchrun.writer`: the run's lock token, pid, host, process space), and

  * the lock must be ours (or our Ray driver's) now, read from the store, else we are the one that is
    gone: LockLost, nothing written;
  * a writer of another run (another lock token) lost the lock, which is only taken over from a dead
    or silent holder, and a holder that finds its lock gone writes nothing more (the same check runs
    before each part and each marker) -> replace;
  * our own process (an earlier attempt at the same unit) -> replace;
  * another process of this run on this machine (a Ray replica): replace once its pid is gone;
    while it lives, wait for its marker (up to the lock's staleness limit);
  * another process of this run elsewhere (a Ray replica on another node): the driver hands a unit to
    a second replica only after the first one died -> replace.

UnitCommitter does all of this for one run or replica; its crash points (mid_write: the claim's bytes
complete, not yet visible; after_part: published, no marker; after_done: the marker written) go to one
callable, the run's CrashHook (job/hooks.py), which tests replace to freeze or kill at those points.

Stores without conditional writes (fsspec's generic mode="create" is a check, then a write) narrow the
race to the moment between that check and the write, but do not close it.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Callable, Optional, Sequence

import pyarrow as pa

from batchrun.connectors.sink import encode_unit
from batchrun.connectors.store import Committed
from batchrun.job.lock import LOCK
from batchrun.job.process import pid_alive, pid_start, process_space

WRITER_KEY = "batchrun.writer"


class LockLost(Exception):
    """This worker's run no longer holds the job lock: it must not publish or commit anything."""


def writer_identity(token: Optional[str]) -> dict[str, Any]:
    me = os.getpid()
    return {"token": token, "pid": me, "host": socket.gethostname(), "process_space": process_space(),
            "pid_start": pid_start(me)}


def lock_fence(lock, token: Optional[str]) -> Callable[[], None]:
    """A check that raises LockLost unless `lock` (a JobLock) names `token` right now."""
    def fence() -> None:
        if token is None:
            return
        held = lock.read()
        if held is None:        # a contender may have it renamed aside for a moment (lock.py): look again
            time.sleep(0.2)
            held = lock.read()
        if held is None or held.get("token") != token:
            raise LockLost(f"{lock.url} is no longer held by this run (taken over after its heartbeat went "
                           "silent, or removed); committing nothing more")
    return fence


def _gone(w: dict[str, Any], me: dict[str, Any]) -> Optional[bool]:
    """True: the writer `w` of a marker-less part is provably not writing any more; None: it may be."""
    if not w or w.get("token") != me.get("token"):
        return True                  # another run's, or from before writers were recorded
    if w.get("process_space") == me["process_space"]:
        pid = w.get("pid")
        if pid == me["pid"] and w.get("pid_start") == me["pid_start"]:
            return True              # our own earlier attempt
        if not isinstance(pid, int) or not pid_alive(pid):
            return True
        start = pid_start(pid)
        return True if (w.get("pid_start") and start and start != w["pid_start"]) else None
    return True                      # a replica elsewhere: its unit is reassigned only after it died


def _no_crash(point: str) -> None:
    pass


class UnitCommitter:
    """Commits units through a ledger: part file(s) create-only, then the create-only done marker.

    writer: this process's identity (writer_identity), recorded in every part file; fence: raises
    LockLost unless the job lock is still this run's (lock_fence); crash: called with each crash point's
    name; wait_s: how long a live writer's marker-less part is waited for."""

    def __init__(self, ledger, writer: Optional[dict] = None, fence: Callable[[], None] = lambda: None,
                 crash: Callable[[str], None] = _no_crash, log: Callable[[str], None] = lambda m: None,
                 wait_s: float = 60.0):
        self.ledger, self.sink = ledger, ledger.sink
        self.writer = writer or writer_identity(None)
        self.fence, self.crash, self.log, self.wait_s = fence, crash, log, wait_s

    def commit(self, unit: int, table: pa.Table, metadata: dict[str, Any], marker: dict,
               partition_by: Sequence[str] = ()) -> Optional[dict]:
        """Publish unit `unit`'s part file(s), then its done marker (`marker` plus the files written).
        Returns the marker, or None when another worker committed the unit (nothing here may count it).
        Raises LockLost (see the module docstring). The first file (in row order) is the claim: created
        create-only; the unit's other partition files are written only by the claim's owner."""
        ledger, sink, fence = self.ledger, self.sink, self.fence
        if ledger.is_done(unit):
            return None
        meta = {**metadata, WRITER_KEY: json.dumps(self.writer, sort_keys=True)}
        files = encode_unit(unit, table, meta, list(partition_by))
        fence()
        claim, data = files[0]
        if not _fenced(fence, lambda: sink.put_new(claim, data, lambda: self.crash("mid_write"))):
            if not _take_over(ledger, unit, claim, self.writer, fence, self.wait_s, self.log):
                return None
            fence()
            sink.publish(claim, data)
        done = [Committed(sink.path(claim), len(data), _sha(data), claim)]
        done += [sink.publish(name, data) for name, data in files[1:]]
        self.crash("after_part")
        m = {**marker, "unit": unit, "bytes": sum(c.bytes for c in done),
             "files": [{"name": c.name, "bytes": c.bytes, "sha256": c.sha256} for c in done]}
        if not partition_by:
            m.update(file=done[0].name, sha256=done[0].sha256)
        fence()
        if not _fenced(fence, lambda: ledger.mark_done(unit, m)):
            return None
        self.crash("after_done")
        return m


def _fenced(fence, create):
    """create(); a temp file of ours removed under it means another run opened the ledger (it empties
    `_batchrun/tmp/`), so the lock is checked before the error is passed on."""
    try:
        return create()
    except FileNotFoundError:
        fence()
        raise


def _take_over(ledger, unit: int, name: str, me: dict, fence, wait_s: float, log) -> bool:
    """The claim `name` exists: False if the unit is (or becomes) committed by its writer; True once the
    marker-less part is proven abandoned (the caller replaces it)."""
    deadline = time.time() + wait_s
    while True:
        if ledger.is_done(unit):
            return False
        fence()
        w = _writer_of(ledger.sink, name)
        if _gone(w, me):
            log(f"batchrun: unit {unit}: replacing {name}, published without a done marker by a writer that "
                f"is gone (pid {w.get('pid')} on {w.get('host')})")
            return True
        if time.time() > deadline:
            raise RuntimeError(f"{ledger.sink.url}/{name}: published by live process {w.get('pid')} on "
                               f"{w.get('host')}, whose done marker has not appeared for {wait_s:.0f}s")
        time.sleep(0.2)


def _writer_of(sink, name: str) -> dict:
    raw = sink.part_metadata(name).get(WRITER_KEY)
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def _sha(data: bytes) -> str:
    import hashlib
    return hashlib.sha256(data).hexdigest()


__all__ = ["UnitCommitter", "LockLost", "lock_fence", "writer_identity", "WRITER_KEY", "LOCK"]
