"""The checkpoint protocol (exactly once per unit), over any fsspec filesystem.

    OUT/part-<k>.parquet            published first (atomic rename or a single PUT)
    OUT/_batchrun/done/<k>.json     then the unit's marker: rows, tokens, bytes, checksum
    OUT/_batchrun/manifest.json     the job fingerprint; a different one is refused unless restarting
    OUT/_batchrun/progress.json     rewritten every few seconds by the running job (for `status`)
    OUT/_batchrun/summary.json, OUT/_SUCCESS   at the end

A part file without its marker is simply rewritten on resume, so a unit is committed zero or one
times. One marker object per unit: no read-modify-write, so several workers can commit at once.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Optional

from batchrun.connectors.sink import ParquetSink


class FingerprintMismatch(RuntimeError):
    pass


def fingerprint(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class Ledger:
    def __init__(self, sink: ParquetSink):
        self.sink = sink
        self.fs = sink.fs
        self.dir = sink.path("_batchrun")
        self.fs.makedirs(f"{self.dir}/done", exist_ok=True)

    def _write_json(self, path: str, obj: Any) -> None:
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        if self.sink.local:        # atomic replace, so a reader never sees half a file
            tmp = f"{path}.tmp-{time.time_ns()}"
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def _read_json(self, path: str) -> Optional[Any]:
        try:
            with self.fs.open(path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    # -- manifest ---------------------------------------------------------------------------
    def check_manifest(self, manifest: dict[str, Any], restart: bool) -> bool:
        """Write or verify the manifest; returns True when resuming an earlier run."""
        old = self._read_json(f"{self.dir}/manifest.json")
        if old is not None and not restart:
            if old.get("fingerprint") != manifest["fingerprint"]:
                changed = [k for k in manifest.get("parts", {})
                           if fingerprint(old.get("parts", {}).get(k)) != fingerprint(manifest["parts"][k])]
                raise FingerprintMismatch(
                    f"{self.sink.url} holds results of a different job (changed: {', '.join(changed) or 'unknown'}); "
                    "resubmit with --restart to discard them, or choose another output.uri")
            return True
        if old is not None and restart:
            self.reset()
        self._write_json(f"{self.dir}/manifest.json", manifest)
        return False

    def manifest(self) -> Optional[dict[str, Any]]:
        return self._read_json(f"{self.dir}/manifest.json")

    def reset(self) -> None:
        """--restart: remove every result and marker of the earlier run."""
        self.sink.remove_parts()
        for p in self.fs.find(self.dir):
            self.fs.rm(p)
        for name in ("_SUCCESS",):
            if self.fs.exists(self.sink.path(name)):
                self.fs.rm(self.sink.path(name))
        self.fs.makedirs(f"{self.dir}/done", exist_ok=True)

    # -- units ------------------------------------------------------------------------------
    def done_units(self) -> dict[int, dict]:
        """Committed units, listed fresh (no listings cache: another worker may have just committed)."""
        self.fs.invalidate_cache(f"{self.dir}/done")
        out = {}
        for p in self.fs.find(f"{self.dir}/done"):
            name = p.rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit():
                rec = self._read_json(p)
                if rec is not None:
                    out[int(name[:-5])] = rec
        return out

    def mark_done(self, index: int, record: dict[str, Any]) -> None:
        self._write_json(f"{self.dir}/done/{index}.json", record)

    # -- progress and the end -----------------------------------------------------------------
    def write_progress(self, progress: dict[str, Any]) -> None:
        self._write_json(f"{self.dir}/progress.json", progress)

    def progress(self) -> Optional[dict[str, Any]]:
        return self._read_json(f"{self.dir}/progress.json")

    def finish(self, summary: dict[str, Any]) -> None:
        self._write_json(f"{self.dir}/summary.json", summary)
        self.fs.pipe_file(self.sink.path("_SUCCESS"), b"")

    def summary(self) -> Optional[dict[str, Any]]:
        return self._read_json(f"{self.dir}/summary.json")

    def succeeded(self) -> bool:
        return self.fs.exists(self.sink.path("_SUCCESS"))

