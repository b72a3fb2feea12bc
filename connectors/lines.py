"""JSONL and CSV sources: units are row ranges of each file, found by one streaming pass at planning.

That pass also records where each unit's bytes start and end (JSONL: line starts; CSV: record starts,
quoted newlines included, found with Python's csv reader), so reading a unit is one ranged read of
exactly its bytes (`cat_file(path, start, end)`: a ranged GET on object stores, never the whole file),
retried on transient failures like every other store call (connectors/retry.py). The planning pass
is retried as a whole.

A bad line never stops a job: invalid JSON, a JSON value that is not an object, a value whose type
contradicts the column's, or a CSV row with the wrong number of fields still counts as one row. Its
columns are null and the ROW_ERROR column carries "<file>: line <n>: <what is wrong>"; the runner turns
it into an error row (finish_reason 'error'). ROW_ERROR is present only in tables that have such a row.
"""
from __future__ import annotations

import csv
import io
import json
from typing import Any, Callable, Iterator, Optional

import pyarrow as pa
import pyarrow.csv as pcsv

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


class CsvSource(_LineSource):
    """CSV with a header row (.tsv: tab-separated). Column types are inferred once, from the first file's
    first block, and imposed on every read so all units agree. Planning finds where each record starts
    (byte offset and physical line) with Python's csv reader, the same dialect as pyarrow's defaults
    ('"' quotes, doubled to escape, quoted newlines, blank lines skipped); a unit is then its byte range,
    parsed by pyarrow with the header's column names. A row with the wrong number of fields is an error
    row naming its physical line."""

    suffixes = (".csv", ".tsv")

    def __init__(self, uri: str, storage_options: Optional[dict] = None):
        self._types: Optional[dict[str, pa.DataType]] = None
        self._lines_at: dict[tuple[str, int], int] = {}      # (path, byte offset of a unit) -> its first line
        super().__init__(uri, storage_options)

    def _delimiter(self, path: str) -> str:
        return "\t" if path.endswith(".tsv") else ","

    def _reader(self, fh, path: str, on_invalid: Optional[Callable] = None, names: Optional[list[str]] = None):
        opts = pcsv.ParseOptions(delimiter=self._delimiter(path), newlines_in_values=True,
                                 invalid_row_handler=on_invalid)
        conv = pcsv.ConvertOptions(strings_can_be_null=True, column_types=self._types)
        try:
            # use_threads=False: only then does pyarrow report the record number of an invalid row
            return pcsv.open_csv(fh, read_options=pcsv.ReadOptions(use_threads=False, column_names=names),
                                 parse_options=opts, convert_options=conv)
        except pa.ArrowInvalid as e:
            raise InputError(f"{self.name(path)}: not readable as CSV ({e})") from e

    def _schema_of(self, path: str) -> pa.Schema:
        def read() -> pa.Schema:
            with self.fs.open(path, "rb") as fh:
                return self._reader(fh, path, lambda row: "skip").schema
        schema = self._retried(read, path, "read")
        if self._types is None:
            self._types = {f.name: f.type for f in schema}
        return schema

    def _split(self, path: str, unit_rows: int) -> list[tuple[int, int, int, int]]:
        out: list[tuple[int, int]] = []
        n = -1                                   # the header is record 0
        with self.fs.open(path, "rb") as fh:
            text = io.TextIOWrapper(fh, encoding="utf-8", errors="surrogateescape", newline="")
            for offset, line in _record_starts(text, self._delimiter(path)):
                if n >= 0 and n % unit_rows == 0:
                    out.append((n, offset))
                    self._lines_at[(path, offset)] = line
                n += 1
        n = max(n, 0)
        ends = [off for _, off in out[1:]] + [self._size(path)]
        return [(r, min(unit_rows, n - r), off, end) for (r, off), end in zip(out, ends)]

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        data = self._range(unit)
        bad: list[tuple] = []

        def on_invalid(row) -> str:
            bad.append((row.number, row.expected_columns, row.actual_columns, row.text))
            return "skip"
        reader = self._reader(io.BytesIO(data), unit.path, on_invalid, self.schema.names)
        try:
            t = reader.read_all()
        except pa.ArrowInvalid as e:
            raise InputError(f"{self.name(unit.path)}: not readable as CSV ({e})") from e
        rows = t.num_rows + len(bad)
        if rows != unit.num_rows:
            raise InputError(f"{self.name(unit.path)}: changed since planning (unit {unit.index} expects "
                             f"{unit.num_rows} rows from byte {unit.byte_offset}, found {rows})")
        if not bad:
            return _conform(t, self.schema, columns, self.name(unit.path))
        # bad rows keep their place: record numbers count from 1 in this unit's bytes
        first_line = self._lines_at.get((unit.path, unit.byte_offset), 0)
        lines = _record_lines(data, self._delimiter(unit.path), {b[0] for b in bad if b[0] is not None})
        where = {b[0]: b for b in bad}
        positions: list[Optional[int]] = []
        errors: list[Optional[str]] = []
        good = 0
        for rec in range(1, rows + 1):
            if rec in where:
                number, expected, actual, text = where[rec]
                line = lines.get(rec)
                at = f"line {first_line + line - 1}" if line and first_line else "a row"
                snippet = text if len(text) <= 200 else text[:200] + "..."
                positions.append(None)
                errors.append(f"{self.name(unit.path)}: {at}: expected {expected} fields, found {actual}: "
                              f"{snippet!r}")
            else:
                positions.append(good)
                errors.append(None)
                good += 1
        return with_row_errors(_conform(scatter(t, positions), self.schema, columns, self.name(unit.path)), errors)


def _record_starts(text_lines, delimiter: str) -> Iterator[tuple[int, int]]:
    """(byte offset, physical line) where each non-blank CSV record starts; `text_lines` are decoded with
    surrogateescape and newline="", so each re-encodes to its exact bytes."""
    rd_lines: list[tuple[int, int]] = []      # (offset, line number) of lines fed, not yet consumed
    pos, lineno = 0, 0

    def feed():
        nonlocal pos, lineno
        for line in text_lines:
            lineno += 1
            rd_lines.append((pos, lineno))
            pos += len(line.encode("utf-8", "surrogateescape"))
            yield line
    rd = csv.reader(feed(), delimiter=delimiter)
    consumed = 0
    for row in rd:
        first = rd_lines[0]
        used = rd.line_num - consumed
        consumed = rd.line_num
        del rd_lines[:used]
        if row:
            yield first


def _record_lines(data: bytes, delimiter: str, wanted: set) -> dict[int, int]:
    """{record number (1-based, blank lines skipped): its first line (1-based)} within `data`."""
    out: dict[int, int] = {}
    if not wanted:
        return out
    text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape", newline="")
    for rec, (_, line) in enumerate(_record_starts(text, delimiter), 1):
        if rec in wanted:
            out[rec] = line
            if len(out) == len(wanted):
                break
    return out


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
