"""Runs one job on Ray: many engine replicas (one per actor), the same units, the same exactly-once ledger.

The driver (RayJobRunner, a JobRunner) plans the units as a local run does (make_plan), takes the job
lock, opens the ledger (skips committed units, writes the manifest) and hands the rest to N replica
actors. Each replica builds its own plan and engine (weights load once per actor), reads its units'
input itself, and runs the unchanged single-process pipeline (JobRunner.run_units) fed from a queue
the driver tops up: a few units in flight per replica, longest first, so no replica sits on queued work
while another idles; when the driver's queue is empty a dry replica steals the units another replica
holds but has not started. Results go through the same sink and ledger (part file, then a create-only
done marker), so a unit is committed at most once whoever finishes it.

Faults: a replica that dies (killed, OOM, node lost) has its unfinished units re-queued to the others
(units it committed before dying are found by their markers) and is restarted by Ray up to
runtime.max_restarts times. A unit whose input fails the same way runtime.max_unit_attempts times, or
that was in flight on that many replica deaths, is committed as error rows instead of retried forever.
The driver dying kills its actors (Ray owner fate-sharing); the ledger is then exactly what a local
resume expects, so a re-submit with or without Ray continues.

This module is imported only for `--ray` / `runtime.backend: ray`: the local path never imports ray.
"""
from __future__ import annotations

import collections
import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pyarrow as pa

from batchrun.connectors import InputError, ParquetSink, Unit
from batchrun.job.commit import lock_fence, writer_identity
from batchrun.job.ledger import DONE_DIR, Ledger
from batchrun.job.lock import JobLock
from batchrun.job.plan import JobPlan, Rendered, fingerprint_hash, make_plan
from batchrun.job.run import PROGRESS_INTERVAL_S, JobRunner, _Prepared
from batchrun.job.spec import JobSpec

INSTALL_HINT = "pip install 'batchrun[ray]'"
POLL_S = 0.5
READY_TIMEOUT_S = 600.0      # a restarting replica must be back (weights loaded) within this
# engine counters that add up across replicas (rates are recomputed, peaks are per replica)
_ADDITIVE = ("steps", "preemptions", "swapped_out_blocks", "swapped_in_blocks", "recomputed_tokens",
             "prefix_cache_queries", "prefix_cache_hits", "spec_proposed", "spec_accepted", "output_tokens",
             "prompt_tokens")


class RayUnavailable(RuntimeError):
    """`--ray` / runtime.backend: ray without Ray installed, or no cluster at the given address."""


def require_ray():
    """Import ray or raise RayUnavailable naming the extra to install."""
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable(f"running on Ray needs the ray package, which is not installed ({e}); "
                             f"install it with: {INSTALL_HINT}") from None
    return ray


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    # Ray's errors open with a generic line; the cause (creation-task traceback, exit detail) follows
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    tail = next((ln for ln in reversed(lines) if "Error" in ln or "died" in ln), "")
    return (lines[0] if lines else type(e).__name__) + (f" ... {tail}" if tail and tail != lines[0] else "")


class _UnitFailed(Exception):
    """The driver gave up on this unit: commit its rows as errors with this message."""


class _DirectedSource:
    """The plan's source, except that units the driver gave up on fail with the driver's message (so
    they take the reader's error path and become error rows without touching possibly-poisonous input)."""

    def __init__(self, inner, give_up: dict[int, str]):
        self._inner, self._give_up = inner, give_up

    def read(self, unit: Unit, columns):
        msg = self._give_up.get(unit.index)
        if msg is not None:
            raise _UnitFailed(msg)
        return self._inner.read(unit, columns)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _ReplicaRunner(JobRunner):
    """A JobRunner inside an actor: the driver owns progress.json, so no progress writes here."""

    def _progress(self, state: str) -> None:
        pass


class ReplicaWorker:
    """One engine replica. Wrapped with ray.remote by the driver (threaded: max_concurrency > 1), so
    poll/assign/steal are answered while run() drives the engine.

    assign(items): [(unit, directive)]; directive None, "last" (if the input fails again, commit error
    rows) or ("fail", message) (commit error rows without reading the prompts)."""

    def __init__(self, spec: JobSpec, fingerprint: str, index: int, threads: int, lock_token: Optional[str] = None):
        self.index = index
        self.init_error: Optional[BaseException] = None
        self.lock_token = lock_token          # the driver's job lock: commits check it is still held
        try:
            self._setup(spec, fingerprint, threads)
        except Exception as e:   # noqa: BLE001 - raised by info(): a bad node fails the job, not restarts
            self.init_error = e

    def _setup(self, spec: JobSpec, fingerprint: str, threads: int) -> None:
        import torch
        torch.set_num_threads(max(1, threads))
        t0 = time.perf_counter()
        index = self.index
        plan = make_plan(spec, stage_input=False)     # input.sql: the driver staged it; only read it here
        got = fingerprint_hash(plan.fingerprint)
        if got != fingerprint:
            raise InputError(f"replica {index} on {socket.gethostname()} sees a different job than the "
                               f"driver (fingerprint {got} != {fingerprint}): every node must read the same "
                               f"model directory ({spec.model.path}) and input ({spec.input.uri})")
        self.plan = plan
        self.give_up: dict[int, str] = {}
        self.last_attempt: set[int] = set()
        self.inner_source = plan.source
        plan.source = _DirectedSource(plan.source, self.give_up)
        self.runner = _ReplicaRunner(plan, progress_bar=False, log=lambda m: print(m, file=sys.stderr))
        self.runner.on_commit = self._committed
        self.runner.on_unit_error = self._unit_error
        self.sink = ParquetSink(spec.output.uri, spec.output.storage_options)
        self.ledger = Ledger(self.sink)
        self.runner.writer = writer_identity(self.lock_token)
        self.runner.fence = lock_fence(JobLock(self.sink), self.lock_token)
        self.engine = self.runner._default_engine(plan.tokenizer)      # the weights, once per actor
        self.runner.engine_factory = lambda tokenizer: self.engine
        self.load_s = time.perf_counter() - t0
        self.cv = threading.Condition()
        self.local: collections.deque = collections.deque()
        self.finished = False
        self.events: list[tuple] = []

    # -- driver calls ------------------------------------------------------------------------------
    def info(self) -> dict:
        """Where this replica runs; answering means the weights are loaded."""
        import ray
        if self.init_error is not None:      # its own type, so the CLI maps it to the usual exit code
            raise self.init_error
        return {"replica": self.index, "pid": os.getpid(), "host": socket.gethostname(),
                "node_ip": ray.util.get_node_ip_address(), "load_s": round(self.load_s, 3),
                "memory_ledger": dict(self.engine.memory_ledger)}

    def run(self) -> dict:
        """Drive the engine over whatever the driver assigns until finish() or stop(); returns the final
        stats and any events not yet polled."""
        self.runner.run_units(self._feed(), self.sink, self.ledger)
        with self.cv:
            events, self.events = self.events, []
        return {"stats": self._stats(), "events": events}

    def assign(self, items: list[tuple[Unit, Any]]) -> None:
        with self.cv:
            for unit, directive in items:
                if isinstance(directive, tuple) and directive[0] == "fail":
                    self.give_up[unit.index] = directive[1]
                elif directive == "last":
                    self.last_attempt.add(unit.index)
                self.local.append(unit)
            self.cv.notify_all()

    def steal(self, n: int) -> list[Unit]:
        """Give back up to n assigned units the reader has not taken yet (the driver re-queues them)."""
        with self.cv:
            out = [self.local.pop() for _ in range(min(n, len(self.local)))]
            return out[::-1]

    def poll(self, timeout: float) -> dict:
        """Events since the last poll (commits, unit failures) and live stats; waits up to `timeout`
        for an event."""
        with self.cv:
            if not self.events:
                self.cv.wait(timeout)
            events, self.events = self.events, []
        return {"stats": self._stats(), "events": events}

    def finish(self) -> None:
        """No more units: run() returns once the assigned ones are committed."""
        with self.cv:
            self.finished = True
            self.cv.notify_all()

    def stop(self) -> None:
        """Stop now (the driver got SIGTERM/SIGINT): complete units are committed, the rest abandoned."""
        self.runner.stop_reason = "driver stop"
        self.runner.stop.set()
        self.finish()

    # -- inside the replica ------------------------------------------------------------------------
    def _feed(self):
        """Windows for the reader: up to plan.window_units of the units assigned so far; blocks while
        the driver has more to give."""
        w = self.plan.spec.plan.window_units
        r = self.runner
        while True:
            with self.cv:
                while not self.local and not self.finished and not r.stop.is_set() and not r._stop_reading:
                    self.cv.wait(0.2)
                if not self.local or r.stop.is_set():
                    return
                window = [self.local.popleft() for _ in range(min(w, len(self.local)))]
            yield window

    def _committed(self, unit: Unit, info: dict) -> None:
        with self.cv:
            self.events.append(("commit", unit.index, info))
            self.cv.notify_all()

    def _unit_error(self, unit: Unit, e: BaseException) -> Optional[_Prepared]:
        msg = str(e) if isinstance(e, _UnitFailed) else f"{type(e).__name__}: {e}"
        if isinstance(e, _UnitFailed) or unit.index in self.last_attempt:
            return self._error_prep(unit, msg)
        with self.cv:
            self.events.append(("error", unit.index, msg))
            self.cv.notify_all()
        return None

    def _error_prep(self, unit: Unit, msg: str) -> _Prepared:
        """Every row of `unit` as an error row; ids and passthrough columns read alone if they can be."""
        spec = self.plan.spec
        keep = list(dict.fromkeys(c for c in [spec.input.id_column, *spec.input.passthrough] if c))
        n = unit.num_rows
        table = None
        if keep:
            try:
                table = self.inner_source.read(unit, keep).select(keep)
                if table.num_rows != n:
                    table = None
            except Exception:   # noqa: BLE001 - the id column is unreadable too: nulls of its type
                table = None
            if table is None:
                schema = self.inner_source.schema
                table = pa.table({c: pa.nulls(n, schema.field(c).type) for c in keep})
        else:
            table = pa.table({"_": pa.nulls(n)}).select([])
        return _Prepared(unit, table, Rendered([None] * n, [None] * n, [msg] * n))

    def _stats(self) -> dict:
        r = self.runner
        with r._lock:
            s = {"units_committed": r._committed_units, "rows_committed": r._committed_rows,
                 "rows_finished": r._finished_rows}
        for _ in range(5):
            try:
                st = dict(self.engine.stats)      # the engine thread may be adding a key right now
                break
            except RuntimeError:
                st = {}
        s.update(engine_s=r.engine_s, loop_s=r.loop_s, idle_s=r.idle_s, queued=len(self.local),
                 output_tokens=int(st.get("output_tokens", 0)),
                 engine={k: st[k] for k in st if isinstance(st[k], (int, float))})
        return s


@dataclass
class _Replica:
    """The driver's view of one replica actor."""
    index: int
    handle: Any
    state: str = "starting"            # starting -> running -> done; dead once out of restarts
    incarnation: int = 0
    deaths: int = 0
    ready_since: float = 0.0
    info: dict = field(default_factory=dict)
    assigned: dict = field(default_factory=dict)       # unit index -> Unit, not yet committed or returned
    cur: dict = field(default_factory=dict)            # stats of this incarnation (last poll)
    prev: dict = field(default_factory=dict)           # summed stats of earlier incarnations
    steal_pending: bool = False
    last_error: str = ""

    def total(self, key: str) -> float:
        return float(self.prev.get(key, 0)) + float(self.cur.get(key, 0))


class RayJobRunner(JobRunner):
    """JobRunner whose pipeline runs on Ray replicas; run() (lock, ledger, summary, signals) is inherited.

    address: ray.init address (None: runtime.address, then $RAY_ADDRESS, else a new local Ray).
    """

    def __init__(self, plan: JobPlan, restart: bool = False, progress_bar: bool = True,
                 address: Optional[str] = None, log: Callable[[str], None] = None):
        super().__init__(plan, restart=restart, progress_bar=progress_bar, log=log)
        self.live_progress = False          # the driver's loop writes progress.json itself
        self.rt = plan.spec.runtime
        self.address = address if address is not None else self.rt.address
        self.replicas: list[_Replica] = []
        self.units_requeued = 0
        self.units_recovered = 0
        self.units_given_up = 0
        self.units_stolen = 0
        self.unit_failures: dict[int, list[str]] = collections.defaultdict(list)
        self.unit_deaths: dict[int, int] = collections.defaultdict(int)
        self._done: set[int] = set()
        self._loop_t0: Optional[float] = None

    # -- Ray session -------------------------------------------------------------------------------
    def _connect(self, ray) -> bool:
        """Join the cluster (or start a local Ray); True if this call started the connection."""
        if ray.is_initialized():
            return False
        joining = self.address or os.environ.get("RAY_ADDRESS")
        kw: dict[str, Any] = {} if joining else {"include_dashboard": False}
        try:
            ray.init(address=self.address or None, log_to_driver=True, **kw)
        except ConnectionError as e:
            raise RayUnavailable(f"runtime.address {self.address!r}: no Ray cluster there ({e}); start one with "
                                 "`ray start --head`, or drop the address to run on a local Ray") from None
        return True

    def _resources(self, ray) -> tuple[int, float, float]:
        res = ray.cluster_resources()
        gpus = self.rt.gpus_per_replica
        if gpus is None:
            gpus = 1.0 if res.get("GPU", 0) >= 1 else 0.0
        cpus = self.rt.cpus_per_replica
        n = self.rt.replicas
        fit = min(res.get("CPU", 0) // cpus, res.get("GPU", 0) // gpus if gpus > 0 else math.inf)
        if fit < 1:      # Ray would keep the actors pending forever: say so now
            raise RayUnavailable(f"the Ray cluster has {res.get('CPU', 0):g} CPU(s) and {res.get('GPU', 0):g} "
                                 f"GPU(s): not enough for one replica of {cpus:g} CPU / {gpus:g} GPU "
                                 "(runtime.cpus_per_replica, runtime.gpus_per_replica)")
        if n is None:
            n = int(fit)
        elif n > fit:
            self.log(f"batchrun: ray: only {int(fit)} of runtime.replicas={n} fit in the cluster now; the "
                     "others start when resources free up (or nodes join)")
        return max(1, n), cpus, gpus

    def _run_units(self, todo: list[Unit]) -> None:
        ray = require_ray()
        started = self._connect(ray)
        self._install_signals()      # ray.init installed its own SIGTERM handlers (exit/abort): ours stop cleanly
        try:
            self._drive(ray, todo)
        finally:
            for rep in self.replicas:
                try:
                    ray.kill(rep.handle, no_restart=True)
                except Exception:   # noqa: BLE001 - already gone
                    pass
            if started:
                ray.shutdown()

    # -- the driver loop ---------------------------------------------------------------------------
    def _drive(self, ray, todo: list[Unit]) -> None:
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
        n, cpus, gpus = self._resources(ray)
        spec = self.spec
        cap = self.rt.units_in_flight or 2 * spec.plan.window_units
        fp = fingerprint_hash(self.plan.fingerprint)
        actor_cls = ray.remote(ReplicaWorker).options(
            num_cpus=cpus, num_gpus=gpus, max_restarts=self.rt.max_restarts, max_task_retries=0,
            max_concurrency=8)
        self.log(f"batchrun: ray: {n} replica(s), {cpus:g} CPU / {gpus:g} GPU each, {len(todo)} unit(s) to go, "
                 f"{cap} in flight per replica")
        queue: collections.deque = collections.deque(sorted(todo, key=lambda u: (-u.num_rows, u.index)))
        pending: dict[Any, tuple[_Replica, int, str]] = {}

        def call(rep: _Replica, kind: str, ref) -> None:
            pending[ref] = (rep, rep.incarnation, kind)

        for i in range(n):
            rep = _Replica(i, actor_cls.remote(spec, fp, i, int(math.ceil(cpus)), self.job_lock.token),
                           ready_since=time.time())
            self.replicas.append(rep)
            call(rep, "ready", rep.handle.info.remote())
        bar = self._bar()
        self._bar_rows = 0
        last_progress = 0.0
        try:
            while True:
                if self.stop.is_set():
                    self._stop_all(ray, pending)
                    return
                live = [r for r in self.replicas if r.state != "dead"]
                if not live:
                    last = self.replicas[-1].last_error if self.replicas else ""
                    raise RuntimeError(f"every replica died (more than runtime.max_restarts="
                                       f"{self.rt.max_restarts} restarts each; last: {last}); committed units "
                                       "stay, re-submit to resume")
                if not queue and not any(r.assigned for r in self.replicas):
                    self._finish_all(ray, pending)
                    return
                if not any(r.state == "running" for r in live) and \
                        time.time() - min(r.ready_since for r in live) > READY_TIMEOUT_S:
                    raise RuntimeError(f"no replica became ready within {READY_TIMEOUT_S:.0f}s (cluster resources "
                                       "taken, or the weights too slow to load); re-submit to resume")
                self._dispatch(queue, cap, call)
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    rep, inc, kind = pending.pop(ref)
                    if inc != rep.incarnation or rep.state == "dead":
                        continue        # an answer from before a restart
                    try:
                        value = ray.get(ref)
                    except ActorUnavailableError:
                        if kind == "ready" and time.time() - rep.ready_since < READY_TIMEOUT_S:
                            time.sleep(0.2)        # restarting: ask again
                            call(rep, "ready", rep.handle.info.remote())
                        else:
                            self._lost(rep, queue, call, "unavailable")
                        continue
                    except RayActorError as e:
                        self._lost(rep, queue, call, _first_line(e))
                        continue
                    except RayTaskError as e:    # the replica raised (its input, model, disk): the job fails
                        self.log(f"batchrun: replica {rep.index} failed: {e}")
                        raise (e.cause if isinstance(e.cause, Exception) else e) from None
                    self._handle(rep, kind, value, queue, call)
                self._update_bar(bar)
                now = time.time()
                if now - last_progress >= PROGRESS_INTERVAL_S:
                    self._aggregate()
                    self._progress("running")
                    last_progress = now
        finally:
            self._aggregate()
            if bar is not None:
                self._update_bar(bar)
                bar.close()

    def _dispatch(self, queue: collections.deque, cap: int, call) -> None:
        """Top every running replica up to `cap` units, emptiest first; with the queue empty, let a dry
        replica steal half of the not-yet-started units of the fullest one."""
        running = sorted((r for r in self.replicas if r.state == "running"), key=lambda r: len(r.assigned))
        for rep in running:
            items = []
            while queue and len(rep.assigned) < cap:
                u = queue.popleft()
                if u.index in self._done:
                    continue
                rep.assigned[u.index] = u
                items.append((u, self._directive(u.index)))
            if items:
                rep.handle.assign.remote(items)
        if queue:
            return
        dry = [r for r in running if not r.assigned]
        victims = [r for r in running if r.cur.get("queued", 0) > 0 and not r.steal_pending]
        if dry and victims:
            v = max(victims, key=lambda r: r.cur["queued"])
            v.steal_pending = True
            call(v, "steal", v.handle.steal.remote(max(1, v.cur["queued"] // 2)))

    def _directive(self, k: int):
        limit = self.rt.max_unit_attempts
        if self.unit_deaths[k] >= limit:
            return ("fail", f"a replica died {self.unit_deaths[k]} times with this unit in flight "
                            f"(runtime.max_unit_attempts={limit}); its rows are not retried")
        fails = self.unit_failures[k]
        if fails and (max(collections.Counter(fails).values()) >= limit - 1 or len(fails) >= 2 * limit - 1):
            return "last"
        return None

    def _handle(self, rep: _Replica, kind: str, value, queue, call) -> None:
        if kind == "ready":
            rep.info, rep.state, rep.ready_since = value, "running", time.time()
            if not self.memory_ledger:
                self.memory_ledger = dict(value.get("memory_ledger") or {})
            if self._loop_t0 is None:
                self._loop_t0 = time.time()
            call(rep, "run", rep.handle.run.remote())
            call(rep, "poll", rep.handle.poll.remote(POLL_S))
            self._progress("running")        # `batchrun status` shows the replica (and its pid) at once
        elif kind == "poll":
            self._events(rep, value, queue)
            if rep.state == "running":
                call(rep, "poll", rep.handle.poll.remote(POLL_S))
        elif kind == "steal":
            rep.steal_pending = False
            for u in sorted(value, key=lambda u: (u.num_rows, -u.index)):   # re-queued longest first
                if rep.assigned.pop(u.index, None) is not None:
                    queue.appendleft(u)
                    self.units_stolen += 1
        elif kind == "run":
            self._events(rep, value, queue)
            rep.state = "done"

    def _events(self, rep: _Replica, value: dict, queue) -> None:
        rep.cur = value["stats"]
        for kind, k, info in value["events"]:
            u = rep.assigned.pop(k, None)
            if kind == "commit":
                self._count_commit(k, info)
            elif u is not None:        # the input of unit k failed: try again, on whichever replica
                self.unit_failures[k].append(info)
                self.log(f"batchrun: unit {k} failed on replica {rep.index} (attempt "
                         f"{len(self.unit_failures[k])}): {info}")
                queue.appendleft(u)

    def _count_commit(self, k: int, marker: dict) -> None:
        if k in self._done:
            return
        self._done.add(k)
        if marker.get("committed_elsewhere"):     # another worker's create-only marker won: not ours to count
            return
        with self._lock:
            self._committed_units += 1
            self._committed_rows += int(marker.get("rows", 0))
            self._committed_out_tokens += int(marker.get("output_tokens", 0))
        if self.unit_deaths.get(k, 0) >= self.rt.max_unit_attempts or \
                (self.unit_failures.get(k) and int(marker.get("errors", 0)) == int(marker.get("rows", -1))):
            self.units_given_up += 1

    def _lost(self, rep: _Replica, queue, call, why: str) -> None:
        """A replica died: count what it committed (markers), re-queue the rest, let Ray restart it."""
        rep.deaths += 1
        rep.incarnation += 1
        rep.last_error = why
        for key in ("units_committed", "rows_committed", "rows_finished", "output_tokens", "engine_s",
                    "loop_s", "idle_s"):
            rep.prev[key] = rep.prev.get(key, 0) + rep.cur.get(key, 0)
        rep.cur, rep.steal_pending = {}, False
        lost = dict(rep.assigned)
        rep.assigned.clear()
        back = []
        for k, u in lost.items():
            marker = self.ledger.read_json(f"{DONE_DIR}/{k}.json")    # committed just before it died?
            if marker is not None:
                self.units_recovered += 1
                self._count_commit(k, marker)
            else:
                self.unit_deaths[k] += 1
                back.append(u)
        self.units_requeued += len(back)
        for u in sorted(back, key=lambda u: (u.num_rows, -u.index)):
            queue.appendleft(u)
        gone = rep.deaths > self.rt.max_restarts
        self.log(f"batchrun: replica {rep.index} (pid {rep.info.get('pid')}) died ({why}); {len(back)} unit(s) "
                 f"re-queued, {len(lost) - len(back)} found committed; "
                 + ("no restarts left (runtime.max_restarts)" if gone else f"restart {rep.deaths} of "
                                                                            f"{self.rt.max_restarts}"))
        if gone:
            rep.state = "dead"
            return
        rep.state, rep.ready_since = "starting", time.time()
        call(rep, "ready", rep.handle.info.remote())

    def _collect(self, ray, pending, wait_s: float) -> None:
        """Wait for the replicas' run() results (final stats, last events)."""
        runs = {ref: v for ref, v in pending.items() if v[2] == "run" and v[0].incarnation == v[1]}
        deadline = time.time() + wait_s
        while runs and time.time() < deadline:
            ready, _ = ray.wait(list(runs), num_returns=1, timeout=max(0.1, deadline - time.time()))
            for ref in ready:
                rep, _, _ = runs.pop(ref)
                try:
                    self._handle(rep, "run", ray.get(ref), collections.deque(), lambda *a: None)
                except Exception as e:   # noqa: BLE001 - a replica lost at the very end: markers tell
                    self.log(f"batchrun: replica {rep.index} ended with {type(e).__name__}: {e}")

    def _finish_all(self, ray, pending) -> None:
        for rep in self.replicas:
            if rep.state == "running":
                rep.handle.finish.remote()
        self._collect(ray, pending, 120.0)

    def _stop_all(self, ray, pending) -> None:
        for rep in self.replicas:
            if rep.state == "running":
                rep.handle.stop.remote()
        self._collect(ray, pending, 60.0)

    # -- reporting ---------------------------------------------------------------------------------
    def _aggregate(self) -> None:
        """Fold the replicas' counters into the fields JobRunner's summary reads."""
        self.engine_s = sum(r.total("engine_s") for r in self.replicas)
        self.loop_s = sum(r.total("loop_s") for r in self.replicas)
        self.idle_s = sum(r.total("idle_s") for r in self.replicas)
        stats: dict[str, float] = {}
        for r in self.replicas:
            for k, v in (r.cur.get("engine") or {}).items():
                if k in _ADDITIVE:
                    stats[k] = stats.get(k, 0) + v
        if stats.get("prefix_cache_queries"):
            stats["prefix_cache_hit_rate"] = round(stats.get("prefix_cache_hits", 0) / stats["prefix_cache_queries"], 4)
        self.stats = stats
        with self._lock:
            self._finished_rows = int(sum(r.total("rows_finished") for r in self.replicas))

    def replica_stats(self) -> list[dict]:
        """Per-replica progress: rows, tokens/s, busy and idle fractions, restarts."""
        out = []
        for r in self.replicas:
            loop = r.total("loop_s")
            out.append({
                "replica": r.index, "state": r.state, "pid": r.info.get("pid"), "host": r.info.get("host"),
                "node_ip": r.info.get("node_ip"), "restarts": r.deaths, "units_in_flight": len(r.assigned),
                "units_committed": int(r.total("units_committed")), "rows_committed": int(r.total("rows_committed")),
                "rows_finished": int(r.total("rows_finished")), "output_tokens": int(r.total("output_tokens")),
                "rows_per_s": round(r.total("rows_finished") / loop, 2) if loop > 0 else None,
                "output_tokens_per_s": round(r.total("output_tokens") / loop, 2) if loop > 0 else None,
                "engine_busy_fraction": round(r.total("engine_s") / loop, 4) if loop > 0 else None,
                "idle_fraction": round(r.total("idle_s") / loop, 4) if loop > 0 else None,
                "loop_s": round(loop, 3), "load_s": r.info.get("load_s")})
        return out

    def _update_bar(self, bar) -> None:
        if bar is None:
            return
        rows = int(sum(r.total("rows_finished") for r in self.replicas))
        if rows != self._bar_rows:
            bar.update(rows - self._bar_rows)        # negative after a replica's unfinished work is lost
            self._bar_rows = rows
            t = time.time() - (self._loop_t0 or self.t_start)
            tok = sum(r.total("output_tokens") for r in self.replicas)
            live = sum(1 for r in self.replicas if r.state == "running")
            bar.set_postfix_str(f"{tok / max(t, 1e-9):.0f} tok/s, {live} replica(s)", refresh=False)

    def _progress(self, state: str) -> None:
        """progress.json as a local run writes it, rates summed over replicas, plus a row per replica."""
        with self._lock:
            units, rows, otok = self._committed_units, self._committed_rows, self._committed_out_tokens
        reps = self.replica_stats()
        fin = sum(r["rows_finished"] for r in reps)
        elapsed = max(time.time() - self.t_start, 1e-9)
        rate = sum(r["rows_per_s"] or 0 for r in reps)
        remaining = self.rows_todo - max(fin, rows)
        try:
            self.ledger.write_progress({
                "state": state, "job": self.spec.name, "pid": os.getpid(), "host": socket.gethostname(),
                "rows_finished": self.rows_done_before + max(fin, rows), "backend": "ray", "started_at": self.t_start, "updated_at": time.time(), "elapsed_s": elapsed,
                "units_total": len(self.plan.units), "units_done": self.units_done_before + units,
                "rows_total": self.plan.num_rows, "rows_done": self.rows_done_before + rows,
                "rows_finished_this_run": fin, "output_tokens_this_run": otok,
                "rows_per_s": rate, "output_tokens_per_s": sum(r["output_tokens_per_s"] or 0 for r in reps),
                "eta_s": remaining / rate if rate > 0 and state == "running" else None,
                "engine_busy_fraction": self.engine_s / self.loop_s if self.loop_s > 0 else None,
                "interval_s": PROGRESS_INTERVAL_S, "replicas": reps})
        except Exception as e:   # noqa: BLE001 - progress is advisory
            self.log(f"batchrun: could not write progress: {e}")

    def _summary(self) -> dict:
        s = super()._summary()
        s.update(backend="ray", ray_address=self.address, replicas=self.replica_stats(),
                 replica_restarts=sum(r.deaths for r in self.replicas), units_requeued=self.units_requeued,
                 units_recovered=self.units_recovered, units_given_up=self.units_given_up,
                 units_stolen=self.units_stolen)
        return s


def run_job_on_ray(spec: JobSpec, restart: bool = False, progress_bar: bool = True,
                   address: Optional[str] = None) -> dict:
    """Plan (no weights), then run on Ray. The Python counterpart of `batchrun submit --ray`."""
    return RayJobRunner(make_plan(spec), restart=restart, progress_bar=progress_bar, address=address).run()
