"""The checkpoint protocol of DESIGN.md: exactly one commit per unit, resumable after any crash.

Layout under the output URL:
    part-<k>.parquet            results of unit k (published atomically by the sink); with
                                output.partition_by, c=v/part-<k>.parquet, one per partition value
    _batchrun/manifest.json     job fingerprint, units and rows in the plan (binding once a unit is done)
    _batchrun/done/<k>.json     written only after part-<k>.parquet is in place
    _batchrun/progress.json     rewritten atomically every few seconds by the running job
    _batchrun/summary.json      the final summary
    _SUCCESS                    every unit is done
A unit is done iff its marker exists and each file the marker lists has the recorded size. Part files
no marker lists are removed on resume and rewritten. Part files and markers are both written
create-only (local: link(); S3: If-None-Match: *), so concurrent workers can commit different units,
two workers can never both commit the same one (the loser learns it lost and does not count the unit),
and a marker always describes the part its own writer created. The ledger only records: parts are
written by job/commit.py's UnitCommitter, bytes move through the output store (connectors/store.py),
whose calls are retried on transient failures and whose listings bypass the fsspec listings cache.
"""
from __future__ import annotations

import json
import time
from typing import Any, Optional

from batchrun.connectors.sink import ParquetSink, part_name

MANIFEST = "_batchrun/manifest.json"
DONE_DIR = "_batchrun/done"
PROGRESS = "_batchrun/progress.json"
SUMMARY = "_batchrun/summary.json"
SUCCESS = "_SUCCESS"
MANIFEST_VERSION = 1


class FingerprintMismatch(Exception):
    """The output holds results of a different job (model, sampling, prompts or input changed)."""


def marker_files(unit: int, marker: dict) -> dict[str, Optional[int]]:
    """{file name relative to the output: bytes} a done marker vouches for (markers written before
    partitioning name one file, or none: then part-<unit>.parquet)."""
    if "files" in marker:
        return {f["name"]: int(f["bytes"]) for f in marker["files"]}
    return {marker.get("file") or part_name(unit): marker.get("bytes")}


def _input_changes(old: Any, new: Any, limit: int = 3) -> str:
    """`(s3://b/x.parquet: size 10 -> 12, version "a" -> "b"; ...) `: which input files differ."""
    if not isinstance(old, dict) or not isinstance(new, dict) or old.get("files") == new.get("files"):
        return ""
    a = {f[0]: f[1:] for f in old.get("files") or []}
    b = {f[0]: f[1:] for f in new.get("files") or []}
    notes = []
    for path in sorted(set(a) | set(b)):
        if path not in b:
            notes.append(f"{path}: removed")
        elif path not in a:
            notes.append(f"{path}: added")
        elif a[path] != b[path]:
            what = [f"{k} {x} -> {y}" for k, x, y in zip(("size", "version"), a[path], b[path]) if x != y]
            notes.append(f"{path}: {', '.join(what)}")
    more = f"; and {len(notes) - limit} more" if len(notes) > limit else ""
    return f"({'; '.join(notes[:limit])}{more}) " if notes else ""


class Ledger:
    """Reads and writes the `_batchrun/` checkpoint state next to a sink's part files."""

    def __init__(self, sink: ParquetSink):
        self.sink = sink
        self.fs = sink.fs

    # -- small files ---------------------------------------------------------------------------
    def write_json(self, name: str, obj: Any) -> None:
        """Atomic replace: a reader sees the old or the new content, never a torn file."""
        data = (json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n").encode()
        self.sink.publish(name, data)

    def read_json(self, name: str) -> Optional[dict]:
        """The JSON object stored as `name`, None if absent; ValueError naming it if corrupt."""
        try:
            data = self.sink.read(name)
        except FileNotFoundError:
            return None
        return self._parse(name, data)

    def _parse(self, name: str, data: bytes) -> dict:
        try:
            return json.loads(data)
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.sink.url}/{name}: corrupt ({e})") from e

    def exists(self, name: str) -> bool:
        """Whether `name` exists now (written by any process)."""
        return self.sink.exists(name)

    def remove(self, name: str) -> None:
        """Delete `name`; absent is fine."""
        self.sink.remove([name])

    # -- manifest ----------------------------------------------------------------------------
    def read_manifest(self) -> Optional[dict]:
        return self.read_json(MANIFEST)

    def open(self, fingerprint: dict, plan_info: dict, restart: bool = False) -> dict[int, dict]:
        """Start or resume: check the fingerprint, clean what a crash left, return the done markers.

        fingerprint: {component: value}; any difference from the stored one raises FingerprintMismatch
        unless `restart`, which discards every committed unit first. A manifest binds only once a unit is
        committed under it: with no done marker there, a different job's manifest is simply replaced (a
        job that failed before committing anything, say on a typo, does not lock its output).
        """
        old = self.read_manifest()
        if old is not None and old.get("fingerprint") != fingerprint:
            n = len(self.done_markers())
            if n == 0:      # binding only once a unit is committed: a job that failed before that holds nothing
                restart = True
            if not restart:
                changed = sorted(k for k in set(old.get("fingerprint", {})) | set(fingerprint)
                                 if old.get("fingerprint", {}).get(k) != fingerprint.get(k))
                detail = _input_changes(old.get("fingerprint", {}).get("input"), fingerprint.get("input"))
                raise FingerprintMismatch(
                    f"{self.sink.url} holds results of a different job: {', '.join(changed)} changed "
                    f"{detail}since its manifest ({self.sink.url}/{MANIFEST}) was written; {n} unit(s) are "
                    "committed there. Re-submit with --restart to discard them and start over, or use "
                    "another output.uri.")
        if restart:
            self.reset()
        created = old.get("created_at") if old is not None and not restart else None
        self.write_json(MANIFEST, {"version": MANIFEST_VERSION, "fingerprint": fingerprint, **plan_info,
                                   "created_at": created or time.time()})
        self.sink.clean_tmp()
        done = self.done_markers(verify=True)
        owned = {n for k, m in done.items() for n in marker_files(k, m)}
        orphans = [n for n in self.sink.list_parts() if n not in owned]
        self.sink.remove(orphans)   # parts published just before a crash, without their marker
        return done

    def reset(self) -> None:
        """Forget every committed unit (--restart)."""
        for k in list(self.done_markers()):
            self.remove(f"{DONE_DIR}/{k}.json")
        self.sink.remove(list(self.sink.list_parts()))
        for name in (SUCCESS, SUMMARY, PROGRESS):
            self.remove(name)

    # -- markers ------------------------------------------------------------------------------
    def done_markers(self, verify: bool = False) -> dict[int, dict]:
        """{unit: marker} of committed units. verify: also require every file the marker lists, of the
        recorded size (a marker whose part vanished or changed is dropped so the unit is redone)."""
        try:
            names = self.sink.list(DONE_DIR)
        except FileNotFoundError:
            return {}
        names = [n for n in names if n.endswith(".json") and n[:-5].isdigit()]
        blobs = self.sink.read_many([f"{DONE_DIR}/{n}" for n in names], DONE_DIR)
        out: dict[int, dict] = {}
        for n in names:
            data = blobs.get(f"{DONE_DIR}/{n}")
            if data is not None:
                out[int(n[:-5])] = self._parse(f"{DONE_DIR}/{n}", data)
        if verify:
            parts = self.sink.list_parts()
            for k in [k for k, m in out.items()
                      if any(parts.get(n) != b for n, b in marker_files(k, m).items())]:
                self.remove(f"{DONE_DIR}/{k}.json")
                del out[k]
        return out

    def mark_done(self, unit: int, marker: dict) -> bool:
        """Record unit `unit` as committed, create-only. Call only after its part files are published.
        False: another worker's marker for this unit was there first; the unit is its commit, not ours."""
        data = (json.dumps(marker, indent=1, sort_keys=True, default=str) + "\n").encode()
        return self.sink.put_new(f"{DONE_DIR}/{unit}.json", data)

    def is_done(self, unit: int) -> bool:
        """Whether unit `unit`'s done marker exists now (written by any worker)."""
        return self.exists(f"{DONE_DIR}/{unit}.json")

    def committed_files(self) -> list[str]:
        """Paths of the part files of committed units, in unit order (what `query` reads)."""
        return [self.sink.path(n) for k, m in sorted(self.done_markers().items()) for n in marker_files(k, m)]

    # -- progress / end -----------------------------------------------------------------------
    def write_progress(self, progress: dict) -> None:
        self.write_json(PROGRESS, progress)

    def read_progress(self) -> Optional[dict]:
        return self.read_json(PROGRESS)

    def finish(self, summary: dict, before_success=None) -> None:
        self.write_json(SUMMARY, summary)
        if before_success:
            before_success()
        self.write_json(SUCCESS, {"finished_at": time.time(), "rows": summary.get("rows")})
