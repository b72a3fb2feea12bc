"""Line-based sources (JSONL here, CSV in connectors/csv_source.py): units are row ranges of each file,
found by one streaming pass at planning.

That pass also records where each unit's bytes start and end (JSONL: line starts; CSV: record starts,
quoted newlines included, found with Python's csv reader), so reading a unit is one ranged read of
exactly its bytes (`cat_file(path, start, end)`: a ranged GET on object stores, never the whole file),
retried on transient failures like every other store call (connectors/retry.py). The planning pass
is retried as a whole.

A bad line never stops a job: invalid JSON, a JSON value that is not an object, a value whose type
contradicts the column's, an integer beyond 64 bits, bytes that are not UTF-8, or a CSV row with the
wrong number of fields still counts as one row. Its columns are null and the ROW_ERROR column carries
"<file>: line <n>: <what is wrong>"; the runner turns it into an error row (finish_reason 'error').
ROW_ERROR is present only in tables that have such a row.
"""
from __future__ import annotations

import io
import json
from typing import Any, Iterator, Optional

import pyarrow as pa

from batchrun.connectors.base import InputError, Listing, Source, Unit, full_path, list_files
from batchrun.connectors.retry import StorageError, retry_io

_SCHEMA_SAMPLE_ROWS = 64
_SCHEMA_MAX_LINES = 10_000      # lines scanned for the first JSON objects before giving up on a file
ROW_ERROR = "_batchrun_row_error"   # per-row error text column added by sources (null = row is fine)


def with_row_errors(t: pa.Table, errors: list[Optional[str]]) -> pa.Table:
    """`t` plus the ROW_ERROR column, when any row has an error."""
    if not any(e is not None for e in errors):
        return t
    return t.append_column(ROW_ERROR, pa.array(errors, pa.string()))


def scatter(t: pa.Table, positions: list[Optional[int]]) -> pa.Table:
    """Rows of `t` at `positions` (None: an all-null row), so bad rows keep their place in the unit."""
    if positions == list(range(t.num_rows)):
        return t
    return t.take(pa.array(positions, pa.int64()))


class _LineSource(Source):
    suffixes: tuple[str, ...] = ()

    def __init__(self, uri: str, storage_options: Optional[dict] = None):
        self.uri = uri
        self.fs, files = list_files(uri, storage_options, self.suffixes)
        self.listing = Listing(files)
        self._scans: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        self.schema = self._schema_of(files[0].path)
        for f in files[1:]:
            other = self._schema_of(f.path)
            if set(other.names) != set(self.schema.names):
                raise InputError(f"{full_path(self.fs, f.path)}: columns {other.names} differ from "
                                 f"{full_path(self.fs, files[0].path)}'s {self.schema.names}")

    def name(self, path: str) -> str:
        return full_path(self.fs, path)

    @property
    def num_rows(self) -> int:
        return sum(u.num_rows for u in self.units(1 << 30))

    def units(self, unit_rows: int) -> list[Unit]:
        units: list[Unit] = []
        first = 0
        for f in self.listing.files:
            total = 0
            for row_start, num_rows, offset, end in self._split_cached(f.path, unit_rows):
                units.append(Unit(len(units), f.path, row_start, num_rows, first + row_start, (), offset, end))
                total = row_start + num_rows
            first += total
        return units

    def _split_cached(self, path: str, unit_rows: int) -> list[tuple[int, int, int, int]]:
        key = (path, unit_rows)
        if key not in self._scans:
            self._scans[key] = self._retried(lambda: self._split(path, unit_rows), path, "scan")
        return self._scans[key]

    def _split(self, path: str, unit_rows: int) -> list[tuple[int, int, int, int]]:
        """[(row_start, num_rows, byte offset, byte end)] of the units of one file."""
        raise NotImplementedError

    def _size(self, path: str) -> int:
        return next(f.size for f in self.listing.files if f.path == path)

    def _retried(self, fn, path: str, op: str):
        """fn() retried on transient store failures; a file gone since planning is an InputError."""
        try:
            return retry_io(fn, self.name(path), op)
        except FileNotFoundError as e:
            raise InputError(f"{self.name(path)}: no longer there ({e})") from e

    def _range(self, unit: Unit) -> bytes:
        """The bytes of `unit` alone: one ranged read (retried), not a stream from the file's start."""
        end = unit.byte_end if unit.byte_end >= 0 else self._size(unit.path)
        if end <= unit.byte_offset:
            return b""
        return self._retried(lambda: self.fs.cat_file(unit.path, start=unit.byte_offset, end=end), unit.path,
                             f"read bytes {unit.byte_offset}-{end}")

    def _schema_of(self, path: str) -> pa.Schema:
        raise NotImplementedError


class JsonlSource(_LineSource):
    """JSON Lines: one object per non-blank line. Column types come from the first objects of the first
    file and are imposed on every read; a line that cannot follow them is an error row."""

    suffixes = (".jsonl", ".ndjson", ".json")

    def __init__(self, uri: str, storage_options: Optional[dict] = None):
        self._line_at: dict[tuple[str, int], int] = {}    # (path, byte offset) -> its 1-based line number
        super().__init__(uri, storage_options)

    def _lines(self, path: str, offset: int = 0, lineno: int = 1) -> Iterator[tuple[int, int, bytes]]:
        """(byte offset, 1-based line number, line) of each non-blank line from `offset` (line `lineno`) on."""
        with self.fs.open(path, "rb") as fh:
            fh.seek(offset)
            pos = offset
            for line in fh:
                if line.strip():
                    yield pos, lineno, line
                pos += len(line)
                lineno += 1

    def _line_number(self, path: str, offset: int) -> int:
        """Line number at byte `offset`: known from planning, else counted (once per offset)."""
        key = (path, offset)
        if key not in self._line_at:
            n, left = 1, offset
            with self.fs.open(path, "rb") as fh:
                while left > 0:
                    chunk = fh.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    n += chunk.count(b"\n")
                    left -= len(chunk)
            self._line_at[key] = n
        return self._line_at[key]

    def _split(self, path: str, unit_rows: int) -> list[tuple[int, int, int, int]]:
        out: list[tuple[int, int]] = []
        n = 0
        for pos, lineno, _ in self._lines(path):
            if n % unit_rows == 0:
                out.append((n, pos))
                self._line_at[(path, pos)] = lineno
            n += 1
        ends = [off for _, off in out[1:]] + [self._size(path)]
        return [(s, min(unit_rows, n - s), off, end) for (s, off), end in zip(out, ends)]

    def _decode(self, path: str, lineno: int, line: bytes) -> tuple[Any, Optional[str]]:
        """(object, None) or (None, error text naming the file and line)."""
        where = f"{self.name(path)}: line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            return None, f"{where}: not valid JSON ({e.msg} at column {e.colno})"
        except UnicodeDecodeError as e:
            return None, f"{where}: not valid JSON (not UTF-8: {e})"
        if not isinstance(obj, dict):
            return None, f"{where}: a JSON object per line is required, found {type(obj).__name__}"
        huge = _huge_int(obj)
        if huge is not None:      # Arrow has no wider integer: pyarrow would raise OverflowError for the lot
            key, value = huge
            text = str(value) if len(str(value)) <= 40 else f"{str(value)[:40]}..."
            return None, f"{where}: {key!r}: integer {text} does not fit in 64 bits (quote it to keep it as text)"
        return obj, None

    def _sample(self, path: str) -> tuple[list[dict], Optional[str]]:
        objs, first_error, scanned = [], None, 0
        for _, lineno, line in self._lines(path):
            scanned += 1
            obj, err = self._decode(path, lineno, line)
            if obj is not None:
                objs.append(obj)
            first_error = first_error or err
            if len(objs) >= _SCHEMA_SAMPLE_ROWS or scanned >= _SCHEMA_MAX_LINES:
                break
        return objs, first_error

    def _schema_of(self, path: str) -> pa.Schema:
        try:
            objs, first_error = self._retried(lambda: self._sample(path), path, "read")
        except StorageError:
            raise
        except OSError as e:
            raise InputError(f"{self.name(path)}: unreadable ({e})") from e
        if not objs:
            raise InputError(first_error or f"{self.name(path)}: no JSON lines")
        try:
            return self._objects_table(objs).schema
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass
        kept: list[dict] = []     # an object contradicting the earlier ones is left out (an error row later)
        for obj in objs:
            try:
                self._objects_table(kept + [obj])
                kept.append(obj)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                continue
        return self._objects_table(kept).schema

    def _objects_table(self, objs: list[dict]) -> pa.Table:
        """The Arrow table of parsed objects (a subclass maps its own record shape here)."""
        return pa.Table.from_pylist(objs)

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        lines = []
        lineno = self._retried(lambda: self._line_number(unit.path, unit.byte_offset), unit.path, "scan")
        pos = unit.byte_offset
        for line in io.BytesIO(self._range(unit)):
            if len(lines) == unit.num_rows:
                break
            if line.strip():
                lines.append((pos, lineno, line))
            pos += len(line)
            lineno += 1
        if len(lines) != unit.num_rows:
            raise InputError(f"{self.name(unit.path)}: changed since planning (unit {unit.index} expects "
                             f"{unit.num_rows} rows from byte {unit.byte_offset}, found {len(lines)})")
        errors: list[Optional[str]] = []
        objs, where = [], []
        for _, n, line in lines:
            obj, err = self._decode(unit.path, n, line)
            errors.append(err)
            if obj is not None:
                objs.append(obj)
                where.append(len(errors) - 1)
        good = self._conform_objects(unit.path, objs, [lines[i][1] for i in where], columns, errors, where)
        positions: list[Optional[int]] = [None] * len(lines)
        for j, i in enumerate(where):
            positions[i] = j
        return with_row_errors(scatter(good, positions), errors)

    def _conform_objects(self, path: str, objs: list[dict], linenos: list[int], columns: Optional[list[str]],
                         errors: list[Optional[str]], where: list[int]) -> pa.Table:
        """The parsed objects as one table of the source's schema. Fast path: all at once; when that
        fails, object by object, and an object that does not fit becomes an error row (its entry in
        `where` is removed, `errors` gets the reason)."""
        name = self.name(path)
        try:
            return _conform(self._objects_table(objs), self.schema, columns, name)
        except (pa.ArrowInvalid, pa.ArrowTypeError, InputError):
            pass
        tables, keep = [], []
        for k, (obj, n) in enumerate(zip(objs, linenos)):
            try:
                tables.append(_conform(self._objects_table([obj]), self.schema, columns, name))
                keep.append(where[k])
            except (pa.ArrowInvalid, pa.ArrowTypeError, InputError) as e:
                errors[where[k]] = f"{name}: line {n}: {str(e).removeprefix(name + ': ')}"
        where[:] = keep
        if not tables:
            return _conform(pa.table({}), self.schema, columns, name, num_rows=0)
        return pa.concat_tables(tables)


_INT64 = (-(1 << 63), (1 << 63) - 1)    # pyarrow types JSON integers as int64, never wider


def _huge_int(v: Any, key: str = "") -> Optional[tuple[str, int]]:
    """(key path, value) of the first integer in a parsed JSON value that no Arrow integer type holds."""
    if type(v) is int:
        return None if _INT64[0] <= v <= _INT64[1] else (key, v)
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        found = _huge_int(x, f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}" if key else str(k))
        if found is not None:
            return found
    return None


def _conform(t: pa.Table, schema: pa.Schema, columns: Optional[list[str]], name: str,
             num_rows: Optional[int] = None) -> pa.Table:
    """Select `columns` (all when None) and cast them to the source schema so every unit agrees."""
    cols = columns if columns is not None else schema.names
    n = t.num_rows if num_rows is None else num_rows
    arrays, fields = [], []
    for c in cols:
        target = schema.field(c).type if c in schema.names else pa.null()
        if c not in t.column_names:
            arrays.append(pa.nulls(n, target))
        else:
            col = t.column(c)
            if col.type != target and not pa.types.is_null(target):
                try:
                    col = col.cast(target)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise InputError(f"{name}: column {c!r} is {col.type} here but {target} in the first "
                                     f"rows of the input ({e})") from e
            arrays.append(col)
        fields.append(pa.field(c, arrays[-1].type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))
