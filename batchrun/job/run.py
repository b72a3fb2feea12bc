"""Runs one job: the output's lock, the ledger, signals, progress and the summary around the units.

JobRunner.run(): install the signal handlers, take the job lock (job/lock.py), open the ledger (skip
committed units, write the manifest), run the rest (execute(): a UnitPipeline of job/pipeline.py here,
replicas in job/ray_runner.py), then write the summary and `_SUCCESS`. SIGTERM / SIGINT stop admission;
units already complete are committed, the rest are abandoned uncommitted (a resume redoes them), and the
runner raises Interrupted (exit code 75). A second signal leaves at once, the lock released.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

from batchrun.connectors import ParquetSink, Unit
from batchrun.connectors.secrets import redact
from batchrun.connectors.sink import check_partition_types
# Exit codes (README: "Exit codes"), defined where the CLI can load them before torch; re-exported here.
from batchrun.errors import (EXIT_BAD_JOB, EXIT_FINGERPRINT, EXIT_INPUT, EXIT_INTERRUPTED,  # noqa: F401
                             EXIT_LOCKED, EXIT_OK, EXIT_STORAGE, EXIT_UNEXPECTED, StartupInterrupted)
from batchrun.job.commit import UnitCommitter, lock_fence, writer_identity
from batchrun.job.hooks import CRASH_ENV, CrashHook
from batchrun.job.ledger import SUCCESS, SUMMARY, FingerprintMismatch, Ledger
from batchrun.job.lock import JobLock, LockHeld
from batchrun.job.pipeline import UnitPipeline, default_engine
from batchrun.job.plan import JobPlan, windows
from batchrun.job.progress import ProgressTracker, Publisher, bar_postfix
from batchrun.job.report import Idle, job_summary, progress_record
from batchrun.job.spec import JobSpec

PROGRESS_INTERVAL_S = 2.0
__all__ = ["JobRunner", "Interrupted", "FingerprintMismatch", "run_job", "EXIT_OK", "EXIT_UNEXPECTED",
           "EXIT_BAD_JOB", "EXIT_INPUT", "EXIT_FINGERPRINT", "EXIT_INTERRUPTED", "EXIT_LOCKED", "LockHeld"]


class Interrupted(Exception):
    """The job stopped on a signal; committed units stay, a re-submit resumes."""


class JobRunner:
    """Runs one job to completion (or to a signal) over a plan from batchrun.job.plan.make_plan.

    engine_factory(tokenizer) -> LLMEngine: injectable for embedding; default builds LLMEngine from
    the job's model and engine sections. A backend that runs units elsewhere overrides execute() and
    sets `counters` to an object job/report.py reads (job/ray_runner.py).
    """

    def __init__(self, plan: JobPlan, restart: bool = False, progress_bar: bool = True,
                 engine_factory: Optional[Callable[[Any], Any]] = None, log: Callable[[str], None] = None):
        self.plan = plan
        self.spec: JobSpec = plan.spec
        self.restart = restart
        self.progress_bar = progress_bar
        self.engine_factory = engine_factory or self._default_engine
        self.log = log or (lambda msg: print(redact(msg), file=sys.stderr, flush=True))
        self.crash = CrashHook(os.environ.get(CRASH_ENV))    # every crash point of the run goes here
        self.stop = threading.Event()
        self.stop_reason: Optional[str] = None
        self.counters: Any = Idle()     # this attempt's numbers: the pipeline's once units run
        self.pipeline: Optional[UnitPipeline] = None
        self.t_start = time.time()
        self.rows_todo = 0
        self.tracker: Optional[ProgressTracker] = None
        # who writes part files and how it proves the job lock is still its run's (batchrun/job/commit.py)
        self.writer: dict = writer_identity(None)
        self.fence: Callable[[], None] = lambda: None
        self.units_done_before = self.rows_done_before = 0
        self._bar = None
        self._bar_n = 0                 # rows shown on the tqdm bar so far
        self.live_progress = True       # a Publisher thread rewrites progress.json (the Ray driver: its loop)

    def _default_engine(self, tokenizer):
        return default_engine(self.spec, tokenizer, self.plan)

    # -- entry ---------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run the job under the output's lock; returns the summary. Raises LockHeld (another live run),
        FingerprintMismatch, Interrupted, InputError. The lock is taken before the ledger opens, so
        --restart can never reset the output under a live run."""
        # torch before the run's handlers, as when planning imported it: a signal never lands inside its
        # import (planning, and so `validate` and a submit refused there, no longer needs it)
        import torch  # noqa: F401
        self.sink = ParquetSink(self.spec.output.uri, self.spec.output.storage_options)
        self.job_lock = JobLock(self.sink, self.spec.name, log=self.log)
        # handlers first: a signal while the lock is taken or the ledger opens stops the run cleanly
        # (the lock released), instead of killing the process with the lock left behind
        old_handlers = self.install_signals()
        try:
            self.job_lock.acquire()
            self.writer = writer_identity(self.job_lock.token)      # recorded in every part file
            self.fence = lock_fence(self.job_lock, self.job_lock.token)
            self.job_lock.start_heartbeat(PROGRESS_INTERVAL_S, self.request_stop)
            try:
                return self._run_locked()
            finally:
                self.job_lock.release()
        finally:
            self._restore_signals(old_handlers)

    def request_stop(self, reason: str) -> None:
        """Stop admitting work (a signal, a lost lock, a writer error); run() then raises Interrupted."""
        self.stop_reason = reason
        self.stop.set()

    def _run_locked(self) -> dict:
        spec, plan = self.spec, self.plan
        self.t_start = time.time()
        check_partition_types(plan.source.schema, spec.output.partition_by)
        self.check_stop()
        self.ledger = Ledger(self.sink)
        done = self.ledger.open(plan.fingerprint, plan.info(), restart=self.restart)
        todo = [u for u in plan.units if u.index not in done]
        self.units_done_before = len(done)
        self.rows_done_before = sum(int(m.get("rows", 0)) for m in done.values())
        self.rows_todo = sum(u.num_rows for u in todo)
        self.check_stop()
        if done:
            self.log(f"batchrun: resuming {spec.name}: {len(done)} of {len(plan.units)} units already "
                     f"committed, {len(todo)} to go")
        if not todo and self.ledger.exists(SUCCESS):
            stored = self.ledger.read_json(SUMMARY) or {}   # a finished job: report it, rewrite nothing
            return {**stored, "units_committed": 0, "units_skipped": len(done), "rows_this_run": 0}
        self.ledger.remove(SUCCESS)
        self.tracker = ProgressTracker(self.rows_todo)
        self.publish_progress("running")        # at once: `status` names this attempt, not a killed one
        publisher = Publisher(lambda: self.publish_progress("running"), log=self.log).start() \
            if self.live_progress else None
        try:
            if todo:
                self.execute(todo)
            if publisher is not None:
                publisher.stop()
            if self.stop.is_set():
                self.publish_progress("interrupted")
                self.check_stop()
            summary = job_summary(self, self.counters)
            if spec.output.openai_jsonl:     # from the committed parts, so exactly once like them
                summary["openai_output"] = self._write_openai_output(summary["fingerprint"])
            self.ledger.finish(summary, before_success=lambda: self.crash("before_success"))
            self.publish_progress("finished")
            return summary
        except (Interrupted, FingerprintMismatch):
            raise
        except BaseException:
            if publisher is not None:
                publisher.stop()
            self.publish_progress("failed")
            raise
        finally:
            if publisher is not None:
                publisher.stop()

    def check_stop(self) -> None:
        """Raise Interrupted if a signal (or a lost lock) asked this run to stop."""
        if self.stop.is_set():
            raise Interrupted(f"stopped by {self.stop_reason}: {self.counters.counts()[0]} unit(s) committed "
                              f"this run; re-submit to resume")

    def execute(self, todo: list[Unit]) -> None:
        """Run the units `todo` through a UnitPipeline on this process's engine, committing each."""
        committer = UnitCommitter(self.ledger, self.writer, self.fence, self.crash, self.log)
        self.pipeline = UnitPipeline(self.plan, self.engine_factory, committer, self.stop, self.request_stop,
                                     crash=self.crash, log=self.log, on_sample=self._sample)
        self.counters = self.pipeline
        self._bar = self.make_bar()
        try:
            self.pipeline.run(windows(todo, self.spec.plan.window_units))
        except StartupInterrupted:       # the weight load was stopped by a signal
            self.check_stop()
            raise
        finally:
            if self._bar is not None:
                self._bar.close()

    def _write_openai_output(self, fingerprint: str) -> str:
        from batchrun.connectors.openai_output import write_openai_output
        from batchrun.job.ledger import marker_files
        parts = [(self.sink.path(n), float(m.get("committed_at") or 0))
                 for k, m in sorted(self.ledger.done_markers().items()) for n in marker_files(k, m)]
        model = os.path.basename(self.spec.model.path.rstrip("/")) or self.spec.model.path
        return write_openai_output(self.sink, parts, model, fingerprint)

    # -- signals ---------------------------------------------------------------------------------
    def install_signals(self):
        """SIGTERM/SIGINT stop the run (a second one leaves at once); returns the handlers replaced
        (None off the main thread). Also called after ray.init, which installs its own."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            if self.stop.is_set():      # a second signal: leave now, nothing half-visible stays
                if getattr(self, "job_lock", None) is not None:
                    self.job_lock.release(wait_s=2.0)
                os._exit(EXIT_INTERRUPTED)
            self.request_stop(signal.Signals(signum).name)
            if self.pipeline is not None and self.pipeline.starting:   # a weight load: stop it, not just what follows
                raise StartupInterrupted(self.stop_reason)
        return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    @staticmethod
    def _restore_signals(old) -> None:
        for s, h in (old or {}).items():
            signal.signal(s, h)

    # -- reporting -----------------------------------------------------------------------------
    def make_bar(self):
        """The tqdm bar on stderr over the rows to do (None with progress_bar=False)."""
        if not self.progress_bar:
            return None
        from tqdm import tqdm
        return tqdm(total=self.rows_todo, desc=self.spec.name, unit="row", file=sys.stderr, dynamic_ncols=True,
                    mininterval=0.5)

    def _sample(self) -> None:
        """Feed the progress tracker (and the bar) from the pipeline's counters: no store I/O here."""
        p = self.pipeline
        tokens, credit = p.generated()
        units, _, _, fin = p.counts()
        if self.tracker is None:
            self.tracker = ProgressTracker(self.rows_todo)
        self.tracker.sample(fin, tokens, credit)
        bar = self._bar
        if bar is not None:
            if fin > self._bar_n:
                bar.update(fin - self._bar_n)
                self._bar_n = fin
            bar.set_postfix_str(bar_postfix(self.tracker.snapshot(), self.units_done_before + units,
                                            len(self.plan.units)), refresh=False)

    def publish_progress(self, state: str) -> None:
        """Rewrite _batchrun/progress.json (read by `batchrun status` from any process): see job/report.py.
        Called by the Publisher thread every few seconds, and once per state change; never raises."""
        try:
            self.ledger.write_progress(progress_record(self, self.counters, state))
        except Exception as e:   # noqa: BLE001 - progress is advisory; never fail the job for it
            self.log(f"batchrun: could not write progress: {e}")


def run_job(spec: JobSpec, restart: bool = False, progress_bar: bool = True) -> dict:
    """Plan (no weights), then run. The Python counterpart of `batchrun submit`."""
    from batchrun.job.plan import make_plan
    return JobRunner(make_plan(spec), restart=restart, progress_bar=progress_bar).run()
