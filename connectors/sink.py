"""Parquet sink: one zstd Parquet file per committed unit, published atomically.

Local filesystems: written (and fsynced) under `_batchrun/tmp/`, then renamed to `part-<k>.parquet`;
a rename is atomic. Object stores: the finished bytes go up in one PUT of the final key, which is
atomic there. Either way `read_parquet('OUT/*.parquet')` never sees a partial file: `_batchrun/` is
not matched by that glob.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.connectors.base import filesystem, full_path

ROW_GROUP_ROWS = 122_880     # DuckDB's own row-group size: one scan task per group
PART_GLOB = "part-*.parquet"


def part_name(index: int) -> str:
    """File name of unit `index`'s results."""
    return f"part-{index:06d}.parquet"


def is_local(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def fsync_dir(path: str) -> None:
    """Make a rename in `path` durable (power loss, not just a killed process)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class Committed:
    path: str
    bytes: int
    sha256: str


class ParquetSink:
    """Writes result tables under an output URL (any fsspec URL)."""

    def __init__(self, uri: str, storage_options: Optional[dict] = None, create: bool = True):
        """create=False: only read (status, query); the output directory is not made."""
        self.fs, root = filesystem(uri, storage_options)
        self.root = root.rstrip("/") or "/"
        self.local = is_local(self.fs)
        if create:
            self.fs.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    @property
    def url(self) -> str:
        return full_path(self.fs, self.root)

    def commit(self, index: int, table: pa.Table, metadata: dict[str, Any],
               before_publish: Optional[Callable[[], None]] = None) -> Committed:
        """Publish `table` as part-<index>.parquet, replacing any earlier file of that unit.

        metadata: file key-value metadata (non-str values are JSON-encoded).
        before_publish: called once the bytes are complete but not yet visible (a crash-test hook).
        """
        meta = {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()}
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd", row_group_size=ROW_GROUP_ROWS)
        data = buf.getvalue()
        final = self.path(part_name(index))
        if self.local:
            tmp_dir = self.path("_batchrun/tmp")
            os.makedirs(tmp_dir, exist_ok=True)
            tmp = f"{tmp_dir}/{part_name(index)}.{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if before_publish:
                before_publish()
            os.replace(tmp, final)
            fsync_dir(self.root)
        else:
            if before_publish:
                before_publish()
            self.fs.pipe_file(final, data)
        return Committed(final, len(data), hashlib.sha256(data).hexdigest())

    def list_parts(self) -> dict[str, int]:
        """{file name: size} of every part file now visible."""
        try:
            self.fs.invalidate_cache(self.root)
        except Exception:   # noqa: BLE001 - not every filesystem keeps a listings cache
            pass
        out = {}
        for p in self.fs.glob(self.path(PART_GLOB), detail=True).values():
            out[p["name"].rsplit("/", 1)[-1]] = int(p.get("size") or 0)
        return out

    def remove(self, names: list[str]) -> None:
        for n in names:
            try:
                self.fs.rm(self.path(n))
            except FileNotFoundError:
                pass

    def clean_tmp(self) -> None:
        """Drop temporary files a killed writer left (never visible to readers)."""
        tmp = self.path("_batchrun/tmp")
        if self.fs.exists(tmp):
            self.fs.rm(tmp, recursive=True)
