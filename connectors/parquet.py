"""Parquet source: units are row ranges aligned to row groups, enumerated from file footers alone.

On object stores a unit reads only its own row groups and columns: the footers read at planning are
reused, the file is opened without read-ahead, and pyarrow fetches (coalesced) byte ranges of the
column chunks it needs, so no input file is downloaded whole. A failure of the store is retried (and
is exit 74 once retries are spent); a file whose bytes do not decode (a corrupt footer or page) is an
InputError naming the file and row groups (exit 3): reading it again cannot help.
"""
from __future__ import annotations

import threading
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.connectors.base import InputError, Listing, Source, Unit, full_path, list_files
from batchrun.connectors.retry import StorageError, retry_io
from batchrun.connectors.store import is_local


class ParquetSource(Source):
    """Parquet files under a path, directory or glob (any fsspec URL). Files must share one schema."""

    def __init__(self, uri: str, storage_options: Optional[dict] = None):
        self.uri = uri
        self.fs, files = list_files(uri, storage_options, (".parquet", ".parq", ".pq"))
        self.listing = Listing(files)
        self._meta: list[pq.FileMetaData] = []
        self.schema: Optional[pa.Schema] = None
        for f in files:
            name = full_path(self.fs, f.path)
            try:
                meta, schema = retry_io(lambda: self._footer(f.path, f.size), name, "read footer")
            except (StorageError, InputError):
                raise
            except Exception as e:  # noqa: BLE001 - the store's own error that retry_io let through
                raise InputError(f"{name}: not a readable Parquet file ({e})") from e
            if self.schema is None:
                self.schema = schema
            elif not schema.equals(self.schema):
                raise InputError(f"{name}: schema differs from the first file's "
                                 f"({full_path(self.fs, files[0].path)}): {_schema_diff(self.schema, schema)}")
            self._meta.append(meta)
        self._index = {f.path: i for i, f in enumerate(files)}
        self._cache: Optional[tuple] = None
        self._lock = threading.Lock()

    def _open(self, path: str, size: int):
        """A file handle for pyarrow: native for local files; elsewhere with no read-ahead cache, so each
        read pyarrow issues is one ranged GET of just those bytes."""
        if is_local(self.fs):
            return self.fs.open(path, "rb")
        return self.fs.open(path, "rb", cache_type="none", size=size)

    def _decode(self, path: str, size: int, what: str, fn):
        """fn(file) on a handle that remembers the store's own exceptions: those are re-raised for
        retry_io to classify (transient or not); any other failure is in the file's bytes, a corrupt
        input (InputError, exit 3) that no retry fixes."""
        with self._open(path, size) as fh:
            tracked = _Tracked(fh)
            try:
                return fn(tracked)
            except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowInvalid, ... for bad bytes
                if e is tracked.error:
                    raise
                if tracked.error is not None:
                    raise tracked.error from e
                raise InputError(f"{full_path(self.fs, path)}: {what} ({' '.join(str(e).split())})") from e

    def _footer(self, path: str, size: int):
        def read(fh):
            pf = pq.ParquetFile(fh)
            return pf.metadata, pf.schema_arrow
        return self._decode(path, size, "not a readable Parquet file", read)

    def _read_groups(self, unit: Unit, columns: Optional[list[str]]) -> pa.Table:
        i = self._index[unit.path]
        groups = list(unit.row_groups)

        def read(fh):
            pf = pq.ParquetFile(fh, metadata=self._meta[i], pre_buffer=True)
            return pf.read_row_groups(groups, columns=columns)
        return self._decode(unit.path, self.listing.files[i].size,
                            f"row group(s) {', '.join(map(str, groups))}: corrupt data, not readable", read)

    @property
    def num_rows(self) -> int:
        return sum(m.num_rows for m in self._meta)

    def units(self, unit_rows: int) -> list[Unit]:
        """Consecutive whole row groups of one file form a unit of at most unit_rows rows; a row group
        larger than unit_rows is split into row ranges. Numbering follows the sorted listing, so the same
        input always gives the same units. Only footers (already read) are used."""
        units: list[Unit] = []
        first = 0
        for f, meta in zip(self.listing.files, self._meta):
            start, groups, rows = 0, [], 0

            def flush():
                nonlocal start, groups, rows
                if groups:
                    units.append(Unit(len(units), f.path, start, rows, first + start, tuple(groups)))
                    start, groups, rows = start + rows, [], 0

            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if n == 0:
                    continue
                if n > unit_rows:
                    flush()
                    for off in range(0, n, unit_rows):
                        k = min(unit_rows, n - off)
                        units.append(Unit(len(units), f.path, start + off, k, first + start + off, (g,)))
                    start += n
                    continue
                if rows + n > unit_rows:
                    flush()
                groups.append(g)
                rows += n
            flush()
            first += meta.num_rows
        return units

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        """Rows of `unit`: only its row groups (and `columns`) are read. The last row groups read are kept,
        so the ranges of one large row group cost one decode."""
        key = (unit.path, unit.row_groups, tuple(columns) if columns is not None else None)
        with self._lock:
            if self._cache is not None and self._cache[0] == key:
                table = self._cache[1]
            else:
                self._cache = None
                name = full_path(self.fs, unit.path)
                try:
                    table = retry_io(lambda: self._read_groups(unit, columns), name, "read")
                except (StorageError, InputError):
                    raise
                except Exception as e:  # noqa: BLE001 - the store's own error that retry_io let through
                    raise InputError(f"{name}: read failed ({e})") from e
                self._cache = (key, table)
        i = self._index[unit.path]
        meta = self._meta[i]
        group_start = sum(meta.row_group(g).num_rows for g in range(unit.row_groups[0]))
        return table.slice(unit.row_start - group_start, unit.num_rows)


class _Tracked:
    """A file object for pyarrow that remembers the exception of any call into it, so an error pyarrow
    raises afterwards can be told apart: the store's (this one) or the bytes' own (none recorded)."""

    def __init__(self, fh):
        self._fh = fh
        self.error: Optional[BaseException] = None

    IO = ("read", "readinto", "read1", "seek", "tell", "size")     # what pyarrow calls to fetch bytes

    def __getattr__(self, name: str):
        attr = getattr(self._fh, name)
        if name not in self.IO:
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except Exception as e:
                self.error = e
                raise
        return call


def _schema_diff(a: pa.Schema, b: pa.Schema) -> str:
    """What differs between two schemas, column by column, for an error message."""
    parts = [f"column {n!r} missing" for n in a.names if n not in b.names]
    parts += [f"extra column {n!r}" for n in b.names if n not in a.names]
    parts += [f"column {f.name!r} is {b.field(f.name).type} here but {f.type} there" for f in a
              if f.name in b.names and b.field(f.name).type != f.type]
    parts += [f"column {f.name!r} nullability differs" for f in a
              if f.name in b.names and b.field(f.name).type == f.type and b.field(f.name).nullable != f.nullable]
    return "; ".join(parts) or "column order differs"
