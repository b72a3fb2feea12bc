"""Parquet sink: one zstd Parquet file per committed unit, published atomically.

Local filesystems: written (and fsynced) under `_batchrun/tmp/`, then linked (create-only) or renamed
to `part-<k>.parquet`; either is atomic. Object stores: the finished bytes go up in one PUT of the final
key (create-only for parts: batchrun/job/commit.py), which is atomic there. Either way
`read_parquet('OUT/*.parquet')` never sees a partial file: `_batchrun/` is not matched by that glob.

With partition columns (`output.partition_by: [lang]`) a unit becomes one file per partition value,
hive-style: `lang=en/part-<k>.parquet`, the partition columns left out of the file (readers take them
from the path: DuckDB `read_parquet('OUT/**/*.parquet', hive_partitioning=true)`). Every store call
is retried on transient failures (connectors/retry.py).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.connectors.base import InputError, OutputError, filesystem, full_path
from batchrun.connectors.retry import retry_io

ROW_GROUP_ROWS = 122_880     # DuckDB's own row-group size: one scan task per group
PART_GLOB = "part-*.parquet"
# a unit's file, relative to the output root: part-<k>.parquet, under key=value/ directories if partitioned
PART_RE = re.compile(r"^(?:[^/_.][^/]*=[^/]*/)*part-(\d+)\.parquet$")
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"     # what Hive, Spark and DuckDB read back as NULL


def part_name(index: int) -> str:
    """File name of unit `index`'s results."""
    return f"part-{index:06d}.parquet"


def unit_of(name: str) -> Optional[int]:
    """The unit index of a part file's relative name, or None if it is not one of ours."""
    m = PART_RE.match(name)
    return int(m.group(1)) if m else None


def partition_dir(columns: list[str], values: tuple) -> str:
    """`a=x/b=y`: values percent-encoded (DuckDB decodes them), None as Hive's default partition."""
    return "/".join(f"{c}={NULL_PARTITION if v is None else quote(_partition_text(v), safe='')}"
                    for c, v in zip(columns, values))


def _partition_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return v.isoformat() if hasattr(v, "isoformat") else str(v)


def check_partition_types(schema: pa.Schema, columns: list[str]) -> None:
    """Partition columns must be scalar (string, integer, boolean, date); raises InputError otherwise."""
    for c in columns:
        if c not in schema.names:
            raise InputError(f"output.partition_by: column {c!r} is not in the input "
                             f"(columns: {', '.join(schema.names)})")
        t = schema.field(c).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
                or pa.types.is_boolean(t) or pa.types.is_date(t) or pa.types.is_dictionary(t)):
            raise InputError(f"output.partition_by: column {c!r} is {t}; partition columns must be strings, "
                             "integers, booleans or dates")


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


def _write_all(f, data: bytes) -> None:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def write_synced(path: str, data: bytes) -> None:
    """Write and fsync `path`: its bytes are durable before it is renamed or linked into view."""
    with open(path, "wb") as f:
        _write_all(f, data)


@dataclass
class Committed:
    path: str
    bytes: int
    sha256: str
    name: str = ""          # relative to the output root: what the done marker records


class ParquetSink:
    """Writes result tables under an output URL (any fsspec URL)."""

    def __init__(self, uri: str, storage_options: Optional[dict] = None, create: bool = True):
        """create=False: only read (status, query); the output directory is not made."""
        self.fs, root = filesystem(uri, storage_options)
        self.root = root.rstrip("/") or "/"
        self.local = is_local(self.fs)
        if create:
            try:
                retry_io(lambda: self.fs.makedirs(self.root, exist_ok=True), self.url, "makedirs")
            except (FileExistsError, NotADirectoryError) as e:    # a file where a directory must be
                raise OutputError(f"output.uri: {self.url} cannot be a directory: "
                                  f"{e.filename or self.url} is a file") from None

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
        return self.publish(part_name(index), self._encode(table, metadata), before_publish)

    def commit_partitioned(self, index: int, table: pa.Table, metadata: dict[str, Any],
                           partition_by: list[str], before_publish: Optional[Callable[[], None]] = None
                           ) -> list[Committed]:
        """Publish one file per distinct value of `partition_by` in `table`: `c=v/part-<index>.parquet`,
        rows in input order, the partition columns dropped from the file. Without partition columns this
        is commit(). before_publish runs once, before the first file becomes visible."""
        if not partition_by:
            return [self.commit(index, table, metadata, before_publish)]
        keys = list(zip(*(table.column(c).to_pylist() for c in partition_by)))
        groups: dict[tuple, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(k, []).append(i)
        rest = table.drop_columns(partition_by)
        out = []
        for n, (k, rows) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0])):
            data = self._encode(rest.take(pa.array(rows, pa.int64())), metadata)
            name = f"{partition_dir(partition_by, k)}/{part_name(index)}"
            out.append(self.publish(name, data, before_publish if n == 0 else None))
        return out

    @staticmethod
    def _encode(table: pa.Table, metadata: dict[str, Any]) -> bytes:
        meta = {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()}
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd", row_group_size=ROW_GROUP_ROWS)
        return buf.getvalue()

    def publish(self, name: str, data: bytes, before_publish: Optional[Callable[[], None]] = None) -> Committed:
        """Make `name` (relative) appear with exactly `data`: local, fsynced temp file + rename; object
        store, one PUT of the final key (retried on transient errors; a PUT is all-or-nothing)."""
        final = self.path(name)
        if self.local:
            tmp_dir = self.path("_batchrun/tmp")
            os.makedirs(tmp_dir, exist_ok=True)
            tmp = f"{tmp_dir}/{name.replace('/', '~')}.{uuid.uuid4().hex}"
            write_synced(tmp, data)
            if before_publish:
                before_publish()
            parent = os.path.dirname(final)
            if parent != self.root:
                os.makedirs(parent, exist_ok=True)
            os.replace(tmp, final)
            fsync_dir(parent)
        else:
            if before_publish:
                before_publish()
            retry_io(lambda: self.fs.pipe_file(final, data), full_path(self.fs, final), "put")
        return Committed(final, len(data), hashlib.sha256(data).hexdigest(), name)

    def put_new(self, name: str, data: bytes, before_publish: Optional[Callable[[], None]] = None) -> bool:
        """Create `name` (relative) with `data` only if it does not exist; False if it already did.

        Local: an fsynced temp file hard-linked to the final name (link() fails if the name exists, and
        the file appears whole). Object stores: a create-only write (S3 `If-None-Match: *`, s3fs
        mode="create"; a multipart upload's completion carries the same condition); a retry after a lost
        response that finds the object holding exactly `data` is our own earlier attempt, so it counts
        as created. Filesystems without conditional writes get fsspec's mode="create", a check then a
        write (not atomic). before_publish: called once the bytes are complete but not yet visible."""
        final = self.path(name)
        if self.local:
            tmp_dir = self.path("_batchrun/tmp")
            os.makedirs(tmp_dir, exist_ok=True)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = f"{tmp_dir}/{name.replace('/', '~')}.{uuid.uuid4().hex}"
            write_synced(tmp, data)
            if before_publish:
                before_publish()
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            except FileNotFoundError:       # our temp file was removed: a ledger open of another run
                raise
            except OSError:         # no hard links here (some network filesystems): exclusive create
                try:
                    fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    _write_all(f, data)
            finally:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            fsync_dir(os.path.dirname(final))
            return True
        url = full_path(self.fs, final)
        if before_publish:
            before_publish()
        try:
            retry_io(lambda: self.fs.pipe_file(final, data, mode="create"), url, "create-only put")
            return True
        except FileExistsError:
            try:
                return retry_io(lambda: self.fs.cat_file(final), url, "get") == data
            except FileNotFoundError:
                return False

    def encode(self, table: pa.Table, metadata: dict[str, Any]) -> bytes:
        """The Parquet bytes of a part file (zstd, `metadata` as key-value metadata)."""
        return self._encode(table, metadata)

    def part_metadata(self, name: str) -> dict[str, str]:
        """The key-value metadata of the part file `name` (its footer only is read); {} if unreadable."""
        path = self.path(name)
        try:
            def read():
                with self.fs.open(path, "rb", **({} if self.local else {"cache_type": "none"})) as f:
                    return pq.read_metadata(f).metadata or {}
            meta = retry_io(read, full_path(self.fs, path), "read footer")
        except FileNotFoundError:
            return {}
        except Exception:   # noqa: BLE001 - a torn or foreign file: no writer to vouch for it
            return {}
        return {k.decode(): v.decode("utf-8", "replace") for k, v in meta.items()}

    def list_parts(self) -> dict[str, int]:
        """{name relative to the root: size} of every unit part file now visible (partition
        directories included), bypassing any listings cache."""
        try:
            self.fs.invalidate_cache(self.root)
        except Exception:   # noqa: BLE001 - not every filesystem keeps a listings cache
            pass
        try:
            found = retry_io(lambda: self.fs.find(self.root, detail=True), self.url, "list")
        except FileNotFoundError:
            return {}
        out = {}
        prefix = self.root.rstrip("/") + "/"
        for p, info in found.items():
            name = p[len(prefix):] if p.startswith(prefix) else p.rsplit("/", 1)[-1]
            if unit_of(name) is not None:
                out[name] = int(info.get("size") or 0)
        return out

    def remove(self, names: list[str]) -> None:
        for n in names:
            try:
                retry_io(lambda: self.fs.rm(self.path(n)), full_path(self.fs, self.path(n)), "delete")
            except FileNotFoundError:
                pass

    def clean_tmp(self) -> None:
        """Drop temporary files a killed writer left (never visible to readers)."""
        tmp = self.path("_batchrun/tmp")
        if self.local and os.path.exists(tmp):
            self.fs.rm(tmp, recursive=True)
