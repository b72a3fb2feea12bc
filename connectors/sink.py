"""Parquet sink: one zstd Parquet file per committed unit, published atomically.

Local filesystems: written under `_batchrun/tmp/` and renamed to `part-<k>.parquet` (a rename is
atomic). Object stores: the finished bytes are sent in one PUT of the final key, which is atomic
there. Either way `read_parquet('OUT/*.parquet')` never sees a partial file.
"""
from __future__ import annotations

import hashlib
import io
import json
import uuid
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.connectors.base import filesystem, full_path

ROW_GROUP_ROWS = 122_880     # DuckDB's own row-group size: one scan task per group


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


class ParquetSink:
    """Writes result tables under an output URL (any fsspec URL)."""

    def __init__(self, uri: str, storage_options: Optional[dict] = None):
        self.fs, self.root = filesystem(uri, storage_options)
        self.root = self.root.rstrip("/")
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else [self.fs.protocol])
        self.fs.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    @property
    def url(self) -> str:
        return full_path(self.fs, self.root)

    def commit(self, index: int, table: pa.Table, metadata: dict[str, Any], before_publish=None) -> dict[str, Any]:
        """Publish `table` as part-<index>.parquet; returns its path, size and sha256.
        before_publish: called between writing and publishing (the crash tests' hook)."""
        schema = table.schema.with_metadata({k: v if isinstance(v, str) else json.dumps(v)
                                             for k, v in metadata.items()})
        buf = io.BytesIO()
        pq.write_table(table.replace_schema_metadata(schema.metadata), buf, compression="zstd",
                       row_group_size=ROW_GROUP_ROWS)
        data = buf.getvalue()
        final = self.path(part_name(index))
        if self.local:
            tmp_dir = self.path("_batchrun/tmp")
            self.fs.makedirs(tmp_dir, exist_ok=True)
            tmp = f"{tmp_dir}/{part_name(index)}.{uuid.uuid4().hex}"
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            if before_publish:
                before_publish()
            self.fs.mv(tmp, final)
        else:
            if before_publish:
                before_publish()
            self.fs.pipe_file(final, data)
        return {"path": final, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def remove_parts(self) -> None:
        for p in self.fs.glob(self.path("part-*.parquet")):
            self.fs.rm(p)
