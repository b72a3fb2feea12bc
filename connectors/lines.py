"""JSONL and CSV sources: units are row ranges of each file, found by one streaming pass at planning.

JSONL units also carry the byte offset of their first line, so reading one is a seek, not a rescan.
CSV rows may span lines (quoted newlines), so CSV units are row ranges read by pyarrow's streaming
reader; sequential reads continue from where the previous unit stopped.

A bad line never stops a job: invalid JSON, a JSON value that is not an object, a value whose type
contradicts the column's, or a CSV row with the wrong number of fields still counts as one row. Its
columns are null and the ROW_ERROR column carries "<file>: line <n>: <what is wrong>"; the runner turns
it into an error row (finish_reason 'error'). ROW_ERROR is present only in tables that have such a row.
"""
from __future__ import annotations

import csv
import io
import json
import threading
from typing import Any, Callable, Iterator, Optional

import pyarrow as pa
import pyarrow.csv as pcsv

from batchrun.connectors.base import InputError, Listing, Source, Unit, full_path, list_files

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
            for row_start, num_rows, offset in self._split_cached(f.path, unit_rows):
                units.append(Unit(len(units), f.path, row_start, num_rows, first + row_start, (), offset))
                total = row_start + num_rows
            first += total
        return units

    def _split_cached(self, path: str, unit_rows: int) -> list[tuple[int, int, int]]:
        key = (path, unit_rows)
        if key not in self._scans:
            self._scans[key] = self._split(path, unit_rows)
        return self._scans[key]

    def _split(self, path: str, unit_rows: int) -> list[tuple[int, int, int]]:
        raise NotImplementedError

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

    def _split(self, path: str, unit_rows: int) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        n = 0
        for pos, lineno, _ in self._lines(path):
            if n % unit_rows == 0:
                out.append((n, 0, pos))
                self._line_at[(path, pos)] = lineno
            n += 1
        return [(s, min(unit_rows, n - s), off) for s, _, off in out]

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

    def _schema_of(self, path: str) -> pa.Schema:
        objs, first_error, scanned = [], None, 0
        try:
            for _, lineno, line in self._lines(path):
                scanned += 1
                obj, err = self._decode(path, lineno, line)
                if obj is not None:
                    objs.append(obj)
                first_error = first_error or err
                if len(objs) >= _SCHEMA_SAMPLE_ROWS or scanned >= _SCHEMA_MAX_LINES:
                    break
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
        lineno = self._line_number(unit.path, unit.byte_offset)
        for item in self._lines(unit.path, unit.byte_offset, lineno):
            if len(lines) == unit.num_rows:
                break
            lines.append(item)
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
    first block, and imposed on every read so all units agree. A row with the wrong number of fields is
    an error row: "line n" is the record number pyarrow counts (header = 1), mapped to the physical line
    by a Python csv pass over the file when such rows exist (quoted values may span lines)."""

    suffixes = (".csv", ".tsv")

    def __init__(self, uri: str, storage_options: Optional[dict] = None):
        self._types: Optional[dict[str, pa.DataType]] = None
        self._cursor: Optional[tuple[str, int, Any, Any]] = None   # (path, next row, reader, file)
        self._lock = threading.Lock()
        self._physical: dict[str, dict[int, int]] = {}     # path -> {record number: first line}
        super().__init__(uri, storage_options)

    def _delimiter(self, path: str) -> str:
        return "\t" if path.endswith(".tsv") else ","

    def _reader(self, path: str, on_invalid: Optional[Callable] = None):
        fh = self.fs.open(path, "rb")
        opts = pcsv.ParseOptions(delimiter=self._delimiter(path), newlines_in_values=True,
                                 invalid_row_handler=on_invalid)
        conv = pcsv.ConvertOptions(strings_can_be_null=True, column_types=self._types)
        try:
            # use_threads=False: only then does pyarrow report the record number of an invalid row
            return pcsv.open_csv(fh, read_options=pcsv.ReadOptions(use_threads=False), parse_options=opts,
                                 convert_options=conv), fh
        except pa.ArrowInvalid as e:
            fh.close()
            raise InputError(f"{self.name(path)}: not readable as CSV ({e})") from e

    def _batches(self, path: str) -> Iterator[tuple[pa.RecordBatch, list[Optional[tuple]]]]:
        """(batch, bad) in file order, where bad rows are spliced in as all-null rows: bad[i] is
        (record number, expected fields, actual fields, text) for such a row, None otherwise."""
        invalid: list[tuple] = []     # filled by pyarrow while parsing, always ahead of the batches

        def on_invalid(row) -> str:
            invalid.append((row.number, row.expected_columns, row.actual_columns, row.text))
            return "skip"
        reader, fh = self._reader(path, on_invalid)
        pos = 0        # data rows (good and bad) emitted so far
        taken = 0      # entries of `invalid` already spliced in

        def due() -> bool:   # the next bad row sits at `pos` (record numbers count the header as 1)
            return taken < len(invalid) and (invalid[taken][0] is None or invalid[taken][0] - 2 <= pos)
        try:
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except pa.ArrowInvalid as e:
                    raise InputError(f"{self.name(path)}: not readable as CSV ({e})") from e
                positions: list[Optional[int]] = []
                bad: list[Optional[tuple]] = []
                for j in range(batch.num_rows):
                    while due():
                        positions.append(None); bad.append(invalid[taken]); taken += 1; pos += 1
                    positions.append(j); bad.append(None); pos += 1
                while due():
                    positions.append(None); bad.append(invalid[taken]); taken += 1; pos += 1
                yield (batch if positions == list(range(batch.num_rows))
                       else batch.take(pa.array(positions, pa.int64()))), bad
            if taken < len(invalid):      # bad rows after the last good one
                rest = invalid[taken:]
                yield pa.RecordBatch.from_pylist([{}] * len(rest), schema=reader.schema), list(rest)
        finally:
            fh.close()

    def _schema_of(self, path: str) -> pa.Schema:
        reader, fh = self._reader(path, lambda row: "skip")
        with fh:
            schema = reader.schema
        if self._types is None:
            self._types = {f.name: f.type for f in schema}
        return schema

    def _split(self, path: str, unit_rows: int) -> list[tuple[int, int, int]]:
        n, records = 0, []
        for b, bad in self._batches(path):
            n += b.num_rows
            records += [x[0] for x in bad if x is not None and x[0] is not None]
        if records:
            self._physical[path] = self._physical_lines(path, records)
        return [(s, min(unit_rows, n - s), -1) for s in range(0, n, unit_rows)]

    def _physical_lines(self, path: str, records: list[int]) -> dict[int, int]:
        """{record number: line where it starts} for a few records, by one pass of Python's csv reader
        (same dialect as pyarrow's defaults: '"' quotes, doubled to escape; blank lines skipped)."""
        want, out = set(records), {}
        record, prev_end = 0, 0
        with self.fs.open(path, "rb") as fh:
            text = io.TextIOWrapper(fh, encoding="utf-8", errors="replace", newline="")
            rd = csv.reader(text, delimiter=self._delimiter(path))
            for row in rd:
                start = prev_end + 1
                prev_end = rd.line_num
                if not row:
                    continue
                record += 1
                if record in want:
                    out[record] = start
                    if len(out) == len(want):
                        break
        return out

    def _bad_text(self, path: str, bad: tuple) -> str:
        number, expected, actual, text = bad
        if number is None:
            where = "a row"
        else:
            where = f"line {self._physical.get(path, {}).get(number, number)}"
        snippet = text if len(text) <= 200 else text[:200] + "..."
        return f"{self.name(path)}: {where}: expected {expected} fields, found {actual}: {snippet!r}"

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        with self._lock:
            cur = self._cursor
            if cur is None or cur[0] != unit.path or cur[1] > unit.row_start:
                gen = self._batches(unit.path)
                cur = (unit.path, 0, gen, [])
            path, pos, gen, buffered = cur
            out, need_end = [], unit.row_start + unit.num_rows
            pending = list(buffered)
            while pos + sum(b.num_rows for b, _ in pending) < need_end:
                try:
                    pending.append(next(gen))
                except StopIteration:
                    break
            # pending holds (batch, bad) pairs starting at row `pos`
            keep = []
            for b, bad in pending:
                lo, hi = max(unit.row_start - pos, 0), min(need_end - pos, b.num_rows)
                if lo < hi:
                    out.append((b.slice(lo, hi - lo), bad[lo:hi]))
                if pos + b.num_rows > need_end:
                    keep.append((b, bad))
                else:
                    pos += b.num_rows
            self._cursor = (path, pos, gen, keep)
        rows = sum(b.num_rows for b, _ in out)
        if rows != unit.num_rows:
            raise InputError(f"{self.name(unit.path)}: changed since planning (unit {unit.index} expects "
                             f"{unit.num_rows} rows from row {unit.row_start}, found {rows})")
        t = pa.Table.from_batches([b for b, _ in out], schema=out[0][0].schema if out else None)
        errors = [None if x is None else self._bad_text(unit.path, x) for _, bad in out for x in bad]
        return with_row_errors(_conform(t, self.schema, columns, self.name(unit.path)), errors)


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
