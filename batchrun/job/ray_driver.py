"""The Ray driver's loop: hands units to replica actors and follows them until every unit is committed.

Units go out longest first, up to `units_in_flight` per replica, emptiest replica first; when the queue
is empty a dry replica steals half of the not-yet-started units of the fullest one. A replica that
dies has its units re-queued (those it committed are found by their markers) and is restarted by Ray
up to runtime.max_restarts times; a unit that keeps failing, or that was in flight on
runtime.max_unit_attempts deaths, is handed out with a directive to commit its rows as errors.
"""
from __future__ import annotations

import collections
import math
import time
from typing import Any

from batchrun.connectors import Unit
from batchrun.job.ledger import DONE_DIR
from batchrun.job.plan import fingerprint_hash
from batchrun.job.ray_check import RayUnavailable
from batchrun.job.ray_replica import ReplicaWorker
from batchrun.job.ray_stats import PROGRESS_INTERVAL_S, RayCounters, Replica

POLL_S = 0.5
READY_TIMEOUT_S = 600.0      # a restarting replica must be back (weights loaded) within this


def first_line(e: BaseException) -> str:
    """A Ray error in one line: its first line and, if there is one, the line naming the cause."""
    text = str(e).strip()
    # Ray's errors open with a generic line; the cause (creation-task traceback, exit detail) follows
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    tail = next((ln for ln in reversed(lines) if "Error" in ln or "died" in ln), "")
    return (lines[0] if lines else type(e).__name__) + (f" ... {tail}" if tail and tail != lines[0] else "")


class RayDriver(RayCounters):
    """Drives the replicas of one run. run: the RayJobRunner (spec, plan, rt, log, stop, job lock,
    ledger, bar and progress.json); the counters it keeps are what the run reports."""

    def __init__(self, run):
        super().__init__(run)
        self.spec, self.plan, self.rt, self.log, self.stop = run.spec, run.plan, run.rt, run.log, run.stop

    def _resources(self, ray) -> tuple[int, float, float]:
        res = ray.cluster_resources()
        gpus = self.rt.gpus_per_replica
        tp = self.spec.engine.tensor_parallel_size         # a replica owns one GPU (or core) per rank
        if gpus is None:
            gpus = float(tp) if res.get("GPU", 0) >= 1 else 0.0
        cpus = max(self.rt.cpus_per_replica, tp if gpus == 0 else 0)
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

    # -- the driver loop ---------------------------------------------------------------------------
    def drive(self, ray, todo: list[Unit]) -> None:
        """Start the replicas and run `todo` on them; returns when every unit is committed or on a stop,
        raises when every replica is gone or none became ready."""
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
        pending: dict[Any, tuple[Replica, int, str]] = {}

        def call(rep: Replica, kind: str, ref) -> None:
            pending[ref] = (rep, rep.incarnation, kind)

        for i in range(n):
            rep = Replica(i, actor_cls.remote(spec, fp, i, int(math.ceil(cpus)), self.run.job_lock.token),
                          ready_since=time.time())
            self.replicas.append(rep)
            call(rep, "ready", rep.handle.info.remote())
        bar = self.run.make_bar()
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
                        self._lost(rep, queue, call, first_line(e))
                        continue
                    except RayTaskError as e:    # the replica raised (its input, model, disk): the job fails
                        self.log(f"batchrun: replica {rep.index} failed: {e}")
                        raise (e.cause if isinstance(e.cause, Exception) else e) from None
                    self._handle(rep, kind, value, queue, call)
                self.update_bar(bar)
                now = time.time()
                if now - last_progress >= PROGRESS_INTERVAL_S:
                    self.aggregate()
                    self.run.publish_progress("running")
                    last_progress = now
        finally:
            self.aggregate()
            if bar is not None:
                self.update_bar(bar)
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

    def _handle(self, rep: Replica, kind: str, value, queue, call) -> None:
        if kind == "ready":
            rep.info, rep.state, rep.ready_since = value, "running", time.time()
            if not self.memory_ledger:
                self.memory_ledger = dict(value.get("memory_ledger") or {})
            if self._loop_t0 is None:
                self._loop_t0 = time.time()
            call(rep, "run", rep.handle.run.remote())
            call(rep, "poll", rep.handle.poll.remote(POLL_S))
            self.run.publish_progress("running")        # `batchrun status` shows the replica (and its pid) at once
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

    def _events(self, rep: Replica, value: dict, queue) -> None:
        rep.cur = value["stats"]
        for kind, k, info in value["events"]:
            u = rep.assigned.pop(k, None)
            if kind == "commit":
                self.count_commit(k, info)
            elif u is not None:        # the input of unit k failed: try again, on whichever replica
                self.unit_failures[k].append(info)
                self.log(f"batchrun: unit {k} failed on replica {rep.index} (attempt "
                         f"{len(self.unit_failures[k])}): {info}")
                queue.appendleft(u)

    def _lost(self, rep: Replica, queue, call, why: str) -> None:
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
            marker = self.run.ledger.read_json(f"{DONE_DIR}/{k}.json")    # committed just before it died?
            if marker is not None:
                self.units_recovered += 1
                self.count_commit(k, marker)
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
