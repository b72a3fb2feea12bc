"""JSONL and CSV sources: units are row ranges of each file, found by one streaming pass at planning.

JSONL units also carry the byte offset of their first line, so reading one is a seek, not a rescan.
CSV rows may span lines (quoted newlines), so CSV units are row ranges read by pyarrow's streaming
reader; sequential reads continue from where the previous unit stopped.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Iterator, Optional

import pyarrow as pa
import pyarrow.csv as pcsv

from batchrun.connectors.base import InputError, Listing, Source, Unit, full_path, list_files

_SCHEMA_SAMPLE_ROWS = 64


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
    """JSON Lines: one object per non-blank line."""

    suffixes = (".jsonl", ".ndjson", ".json")

    def _lines(self, path: str, offset: int = 0) -> Iterator[tuple[int, bytes]]:
        """(byte offset, line) of each non-blank line from `offset` on."""
        with self.fs.open(path, "rb") as fh:
            fh.seek(offset)
            pos = offset
            for line in fh:
                if line.strip():
                    yield pos, line
                pos += len(line)

    def _split(self, path: str, unit_rows: int) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        n = 0
        for pos, _ in self._lines(path):
            if n % unit_rows == 0:
                out.append((n, 0, pos))
            n += 1
        return [(s, min(unit_rows, n - s), off) for s, _, off in out]

    def _parse(self, path: str, lines: list[tuple[int, bytes]], first_row: int) -> pa.Table:
        rows = []
        for i, (_, line) in enumerate(lines):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{self.name(path)}: row {first_row + i}: not valid JSON ({e.msg})") from e
            except UnicodeDecodeError as e:
                raise InputError(f"{self.name(path)}: row {first_row + i}: not valid JSON (not UTF-8: {e})") from e
            if not isinstance(obj, dict):
                raise InputError(f"{self.name(path)}: row {first_row + i}: a JSON object per line is required")
            rows.append(obj)
        try:
            return pa.Table.from_pylist(rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise InputError(f"{self.name(path)}: rows {first_row}..{first_row + len(rows)}: {e}") from e

    def _schema_of(self, path: str) -> pa.Schema:
        lines = []
        try:
            for item in self._lines(path):
                lines.append(item)
                if len(lines) >= _SCHEMA_SAMPLE_ROWS:
                    break
        except OSError as e:
            raise InputError(f"{self.name(path)}: unreadable ({e})") from e
        if not lines:
            raise InputError(f"{self.name(path)}: no JSON lines")
        return self._parse(path, lines, 0).schema

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        lines = []
        for item in self._lines(unit.path, unit.byte_offset):
            if len(lines) == unit.num_rows:
                break
            lines.append(item)
        if len(lines) != unit.num_rows:
            raise InputError(f"{self.name(unit.path)}: changed since planning (unit {unit.index} expects "
                             f"{unit.num_rows} rows from byte {unit.byte_offset}, found {len(lines)})")
        t = self._parse(unit.path, lines, unit.row_start)
        return _conform(t, self.schema, columns, self.name(unit.path))


class CsvSource(_LineSource):
    """CSV with a header row (.tsv: tab-separated). Column types are inferred once, from the first file's
    first block, and imposed on every read so all units agree."""

    suffixes = (".csv", ".tsv")

    def __init__(self, uri: str, storage_options: Optional[dict] = None):
        self._types: Optional[dict[str, pa.DataType]] = None
        self._cursor: Optional[tuple[str, int, Any, Any]] = None   # (path, next row, reader, file)
        self._lock = threading.Lock()
        super().__init__(uri, storage_options)

    def _reader(self, path: str):
        fh = self.fs.open(path, "rb")
        opts = pcsv.ParseOptions(delimiter="\t" if path.endswith(".tsv") else ",", newlines_in_values=True)
        conv = pcsv.ConvertOptions(strings_can_be_null=True, column_types=self._types)
        try:
            return pcsv.open_csv(fh, parse_options=opts, convert_options=conv), fh
        except pa.ArrowInvalid as e:
            fh.close()
            raise InputError(f"{self.name(path)}: not readable as CSV ({e})") from e

    def _batches(self, path: str):
        reader, fh = self._reader(path)
        try:
            while True:
                try:
                    yield reader.read_next_batch()
                except StopIteration:
                    return
                except pa.ArrowInvalid as e:
                    raise InputError(f"{self.name(path)}: not readable as CSV ({e})") from e
        finally:
            fh.close()

    def _schema_of(self, path: str) -> pa.Schema:
        reader, fh = self._reader(path)
        with fh:
            schema = reader.schema
        if self._types is None:
            self._types = {f.name: f.type for f in schema}
        return schema

    def _split(self, path: str, unit_rows: int) -> list[tuple[int, int, int]]:
        n = sum(b.num_rows for b in self._batches(path))
        return [(s, min(unit_rows, n - s), -1) for s in range(0, n, unit_rows)]

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        with self._lock:
            cur = self._cursor
            if cur is None or cur[0] != unit.path or cur[1] > unit.row_start:
                gen = self._batches(unit.path)
                cur = (unit.path, 0, gen, [])
            path, pos, gen, buffered = cur
            out, need_end = [], unit.row_start + unit.num_rows
            pending = list(buffered)
            while pos + sum(b.num_rows for b in pending) < need_end:
                try:
                    pending.append(next(gen))
                except StopIteration:
                    break
            # pending holds batches starting at row `pos`
            keep = []
            for b in pending:
                lo, hi = max(unit.row_start - pos, 0), min(need_end - pos, b.num_rows)
                if lo < hi:
                    out.append(b.slice(lo, hi - lo))
                if pos + b.num_rows > need_end:
                    keep.append(b)
                else:
                    pos += b.num_rows
            self._cursor = (path, pos, gen, keep)
        rows = sum(b.num_rows for b in out)
        if rows != unit.num_rows:
            raise InputError(f"{self.name(unit.path)}: changed since planning (unit {unit.index} expects "
                             f"{unit.num_rows} rows from row {unit.row_start}, found {rows})")
        t = pa.Table.from_batches(out)
        return _conform(t, self.schema, columns, self.name(unit.path))


def _conform(t: pa.Table, schema: pa.Schema, columns: Optional[list[str]], name: str) -> pa.Table:
    """Select `columns` (all when None) and cast them to the source schema so every unit agrees."""
    cols = columns if columns is not None else schema.names
    arrays, fields = [], []
    for c in cols:
        target = schema.field(c).type if c in schema.names else pa.null()
        if c not in t.column_names:
            arrays.append(pa.nulls(t.num_rows, target))
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
