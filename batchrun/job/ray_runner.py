"""Runs one job on Ray: many engine replicas (one per actor), the same units, the same exactly-once ledger.

The driver (RayJobRunner: a JobRunner whose execute() runs the units on Ray) plans the units as a local
run does (make_plan), takes the job lock, opens the ledger (skips committed units, writes the manifest)
and hands the rest to N replica actors (job/ray_driver.py). Each replica (job/ray_replica.py) builds its
own plan and engine (weights load once per actor), reads its units' input itself, and runs the same
UnitPipeline as a local run (job/pipeline.py) fed from a queue the driver tops up: a few units in
flight per replica, longest first, so no replica sits on queued work while another idles; when the driver's queue is empty a dry replica steals the units another replica
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

import os
from typing import Any, Callable, Optional

from batchrun.connectors import Unit
from batchrun.job.plan import JobPlan, make_plan
from batchrun.job.ray_check import INSTALL_HINT, RayUnavailable, require_ray  # noqa: F401 (re-exported)
from batchrun.job.ray_driver import RayDriver
from batchrun.job.run import JobRunner
from batchrun.job.spec import JobSpec

__all__ = ["RayJobRunner", "RayUnavailable", "require_ray", "run_job_on_ray"]


class RayJobRunner(JobRunner):
    """A JobRunner whose units run on Ray replicas: run() (lock, ledger, signals, progress, summary) is
    JobRunner's; execute() hands the units to a RayDriver, whose counters the run reports.

    address: ray.init address (None: runtime.address, then $RAY_ADDRESS, else a new local Ray).
    """

    def __init__(self, plan: JobPlan, restart: bool = False, progress_bar: bool = True,
                 address: Optional[str] = None, log: Callable[[str], None] = None):
        super().__init__(plan, restart=restart, progress_bar=progress_bar, log=log)
        self.live_progress = False          # the driver's loop writes progress.json itself
        self.rt = plan.spec.runtime
        self.address = address if address is not None else self.rt.address
        self.driver = RayDriver(self)
        self.counters = self.driver

    @property
    def replicas(self):
        """The driver's view of each replica actor (state, assigned units, last stats)."""
        return self.driver.replicas

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

    def execute(self, todo: list[Unit]) -> None:
        """Run `todo` on Ray replicas (job/ray_driver.py), connecting first and leaving no actor behind."""
        ray = require_ray()
        started = self._connect(ray)
        self.install_signals()      # ray.init installed its own SIGTERM handlers (exit/abort): ours stop cleanly
        try:
            self.driver.drive(ray, todo)
        finally:
            for rep in self.driver.replicas:
                try:
                    ray.kill(rep.handle, no_restart=True)
                except Exception:   # noqa: BLE001 - already gone
                    pass
            if started:
                ray.shutdown()


def run_job_on_ray(spec: JobSpec, restart: bool = False, progress_bar: bool = True,
                   address: Optional[str] = None) -> dict:
    """Plan (no weights), then run on Ray. The Python counterpart of `batchrun submit --ray`."""
    return RayJobRunner(make_plan(spec), restart=restart, progress_bar=progress_bar, address=address).run()
