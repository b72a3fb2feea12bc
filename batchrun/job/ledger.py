"""The checkpoint protocol of DESIGN.md: exactly one commit per unit, resumable after any crash.

Layout under the output URL:
    part-<k>.parquet            results of unit k (published atomically by the sink)
    _batchrun/manifest.json     job fingerprint, units and rows in the plan
    _batchrun/done/<k>.json     written only after part-<k>.parquet is in place
    _batchrun/progress.json     rewritten atomically every few seconds by the running job
    _batchrun/summary.json      the final summary
    _SUCCESS                    every unit is done
A unit is done iff its marker exists and its part file has the size the marker records. Part files
without a marker are removed on resume and rewritten. One marker object per unit: no
read-modify-write, so concurrent workers can commit different units.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, Optional

from batchrun.connectors.sink import ParquetSink, fsync_dir, part_name

MANIFEST = "_batchrun/manifest.json"
DONE_DIR = "_batchrun/done"
PROGRESS = "_batchrun/progress.json"
SUMMARY = "_batchrun/summary.json"
SUCCESS = "_SUCCESS"
MANIFEST_VERSION = 1


class FingerprintMismatch(Exception):
    """The output holds results of a different job (model, sampling, prompts or input changed)."""


class Ledger:
    """Reads and writes the `_batchrun/` checkpoint state next to a sink's part files."""

    def __init__(self, sink: ParquetSink):
        self.sink = sink
        self.fs = sink.fs

    # -- small files ---------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return self.sink.path(name)

    def write_json(self, name: str, obj: Any) -> None:
        """Atomic replace: a reader sees the old or the new content, never a torn file."""
        data = (json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n").encode()
        path = self._path(name)
        if self.sink.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
        else:
            self.fs.pipe_file(path, data)

    def read_json(self, name: str) -> Optional[dict]:
        try:
            with self.fs.open(self._path(name), "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.sink.url}/{name}: corrupt ({e})") from e

    def exists(self, name: str) -> bool:
        return self.fs.exists(self._path(name))

    def remove(self, name: str) -> None:
        try:
            self.fs.rm(self._path(name))
        except FileNotFoundError:
            pass

    # -- manifest ----------------------------------------------------------------------------
    def read_manifest(self) -> Optional[dict]:
        return self.read_json(MANIFEST)

    def open(self, fingerprint: dict, plan_info: dict, restart: bool = False) -> dict[int, dict]:
        """Start or resume: check the fingerprint, clean what a crash left, return the done markers.

        fingerprint: {component: value}; any difference from the stored one raises FingerprintMismatch
        unless `restart`, which discards every committed unit first.
        """
        old = self.read_manifest()
        if old is not None and old.get("fingerprint") != fingerprint:
            if not restart:
                changed = sorted(k for k in set(old.get("fingerprint", {})) | set(fingerprint)
                                 if old.get("fingerprint", {}).get(k) != fingerprint.get(k))
                n = len(self.done_markers())
                raise FingerprintMismatch(
                    f"{self.sink.url} holds results of a different job: {', '.join(changed)} changed "
                    f"since its manifest ({self.sink.url}/{MANIFEST}) was written; {n} unit(s) are "
                    "committed there. Re-submit with --restart to discard them and start over, or use "
                    "another output.uri.")
        if restart:
            self.reset()
        created = old.get("created_at") if old is not None and not restart else None
        self.write_json(MANIFEST, {"version": MANIFEST_VERSION, "fingerprint": fingerprint, **plan_info,
                                   "created_at": created or time.time()})
        self.sink.clean_tmp()
        done = self.done_markers(verify=True)
        visible = self.sink.list_parts()
        orphans = [n for n in visible if int(n[5:-8]) not in done]
        self.sink.remove(orphans)   # a part renamed just before a crash, without its marker
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
        """{unit: marker} of committed units. verify: also require the part file, of the recorded size
        (a marker whose part vanished or changed is dropped so the unit is redone)."""
        d = self._path(DONE_DIR)
        try:
            self.fs.invalidate_cache(d)
        except Exception:   # noqa: BLE001
            pass
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(d, detail=False)]
        except FileNotFoundError:
            return {}
        out: dict[int, dict] = {}
        for n in names:
            if not n.endswith(".json") or not n[:-5].isdigit():
                continue
            m = self.read_json(f"{DONE_DIR}/{n}")
            if m is not None:
                out[int(n[:-5])] = m
        if verify:
            parts = self.sink.list_parts()
            for k in [k for k, m in out.items() if parts.get(part_name(k)) != m.get("bytes")]:
                self.remove(f"{DONE_DIR}/{k}.json")
                del out[k]
        return out

    def mark_done(self, unit: int, marker: dict) -> None:
        """Record unit `unit` as committed. Call only after its part file is published."""
        self.write_json(f"{DONE_DIR}/{unit}.json", marker)

    def committed_files(self) -> list[str]:
        """URLs of the part files of committed units, in unit order (what `query` reads)."""
        return [self._path(part_name(k)) for k in sorted(self.done_markers())]

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
