"""The Ray driver's view of its replicas as one run's counters: what progress.json, the tqdm bar and the
summary show (job/report.py reads them as it reads a local UnitPipeline's), plus a row per replica."""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

PROGRESS_INTERVAL_S = 2.0
# engine counters that add up across replicas (rates are recomputed, peaks are per replica)
_ADDITIVE = ("steps", "preemptions", "swapped_out_blocks", "swapped_in_blocks", "recomputed_tokens",
             "prefix_cache_queries", "prefix_cache_hits", "spec_proposed", "spec_accepted", "output_tokens",
             "prompt_tokens")


@dataclass
class Replica:
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


class RayCounters:
    """Counters of a Ray run, summed over replicas (and over each replica's earlier incarnations).

    run: the RayJobRunner (its t_start, address, max_unit_attempts)."""

    def __init__(self, run):
        self.run = run
        self.replicas: list[Replica] = []
        self.units_requeued = self.units_recovered = self.units_given_up = self.units_stolen = 0
        self.unit_failures: dict[int, list[str]] = collections.defaultdict(list)
        self.unit_deaths: dict[int, int] = collections.defaultdict(int)
        self.engine_s = self.loop_s = self.idle_s = 0.0
        self.stats: dict = {}
        self.memory_ledger: dict = {}
        self.deduper = None             # replicas share identical rows within themselves only
        self._lock = threading.Lock()
        self._committed_units = self._committed_rows = self._committed_out_tokens = 0
        self._done: set[int] = set()
        self._loop_t0: Optional[float] = None
        self._bar_rows = 0

    def counts(self) -> tuple[int, int, int, int]:
        """(units, rows, output tokens committed: from the replicas' commit events; rows finished)."""
        fin = int(sum(r.total("rows_finished") for r in self.replicas))
        with self._lock:
            return self._committed_units, self._committed_rows, self._committed_out_tokens, fin

    def count_commit(self, k: int, marker: dict) -> None:
        """Count unit k's commit once (a replica's event, or its marker found after the replica died)."""
        if k in self._done:
            return
        self._done.add(k)
        if marker.get("committed_elsewhere"):     # another worker's create-only marker won: not ours to count
            return
        with self._lock:
            self._committed_units += 1
            self._committed_rows += int(marker.get("rows", 0))
            self._committed_out_tokens += int(marker.get("output_tokens", 0))
        if self.unit_deaths.get(k, 0) >= self.run.rt.max_unit_attempts or \
                (self.unit_failures.get(k) and int(marker.get("errors", 0)) == int(marker.get("output_rows", marker.get("rows", -1)))):
            self.units_given_up += 1

    def aggregate(self) -> None:
        """Fold the replicas' counters into the fields the summary reads (job/report.py)."""
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

    def update_bar(self, bar) -> None:
        if bar is None:
            return
        rows = int(sum(r.total("rows_finished") for r in self.replicas))
        if rows != self._bar_rows:
            bar.update(rows - self._bar_rows)        # negative after a replica's unfinished work is lost
            self._bar_rows = rows
            t = time.time() - (self._loop_t0 or self.run.t_start)
            tok = sum(r.total("output_tokens") for r in self.replicas)
            live = sum(1 for r in self.replicas if r.state == "running")
            bar.set_postfix_str(f"{tok / max(t, 1e-9):.0f} tok/s, {live} replica(s)", refresh=False)

    def progress_fields(self, state: str, rows_left: int) -> dict[str, Any]:
        """progress.json's rates summed over replicas, the ETA from them, and a row per replica."""
        reps = self.replica_stats()
        rate = sum(r["rows_per_s"] or 0 for r in reps)
        return {"backend": "ray", "rows_per_s": rate,
                "output_tokens_per_s": sum(r["output_tokens_per_s"] or 0 for r in reps),
                "eta_s": rows_left / rate if rate > 0 and state == "running" else None,
                "interval_s": PROGRESS_INTERVAL_S, "replicas": reps}

    def summary_fields(self) -> dict[str, Any]:
        """The local summary's fields plus these (README: "Scale out on Ray")."""
        return {"backend": "ray", "ray_address": self.run.address, "replicas": self.replica_stats(),
                "replica_restarts": sum(r.deaths for r in self.replicas), "units_requeued": self.units_requeued,
                "units_recovered": self.units_recovered, "units_given_up": self.units_given_up,
                "units_stolen": self.units_stolen}
