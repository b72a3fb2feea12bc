"""JSONL and CSV sources: units are row ranges of each file, counted by one streaming pass at planning."""
from __future__ import annotations

import io
import json
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.csv as pcsv

from batchrun.connectors.base import InputError, Listing, Source, Unit, full_path, list_files


class _LineSource(Source):
    suffixes: tuple[str, ...] = ()

    def __init__(self, uri: str, storage_options: Optional[dict] = None):
        self.uri = uri
        self.fs, files = list_files(uri, storage_options, self.suffixes)
        self.listing = Listing(files)
        self._rows = [self._count(f.path) for f in files]
        self.schema = self._schema_of(files[0].path)
        for f in files[1:]:
            other = self._schema_of(f.path)
            if set(other.names) != set(self.schema.names):
                raise InputError(f"{full_path(self.fs, f.path)}: columns {other.names} differ from "
                                 f"{full_path(self.fs, files[0].path)}'s {self.schema.names}")

    @property
    def num_rows(self) -> int:
        return sum(self._rows)

    def units(self, unit_rows: int) -> list[Unit]:
        units, first = [], 0
        for f, n in zip(self.listing.files, self._rows):
            for off in range(0, n, unit_rows):
                units.append(Unit(len(units), f.path, off, min(unit_rows, n - off), first + off))
            first += n
        return units

    def _schema_of(self, path: str) -> pa.Schema:
        return self._read_rows(path, 0, 64).schema


class JsonlSource(_LineSource):
    """JSON Lines: one object per non-blank line."""

    suffixes = (".jsonl", ".ndjson", ".json")

    def _lines(self, path: str) -> Iterator[tuple[int, bytes]]:
        with self.fs.open(path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    yield lineno, line

    def _count(self, path: str) -> int:
        return sum(1 for _ in self._lines(path))

    def _read_rows(self, path: str, start: int, n: int) -> pa.Table:
        rows = []
        for i, (lineno, line) in enumerate(self._lines(path)):
            if i < start:
                continue
            if i >= start + n:
                break
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{full_path(self.fs, path)}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise InputError(f"{full_path(self.fs, path)}:{lineno}: a JSON object per line is required")
            rows.append(obj)
        try:
            return pa.Table.from_pylist(rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise InputError(f"{full_path(self.fs, path)}: rows {start}..{start + n}: {e}") from e

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        t = self._read_rows(unit.path, unit.row_start, unit.num_rows)
        return t.select([c for c in columns if c in t.column_names]) if columns else t


class CsvSource(_LineSource):
    """CSV with a header row (quoted fields may hold newlines: rows are counted by pyarrow's parser)."""

    suffixes = (".csv", ".tsv")

    def _batches(self, path: str):
        try:
            with self.fs.open(path, "rb") as fh:
                data = fh.read()
            opts = pcsv.ParseOptions(delimiter="\t" if path.endswith(".tsv") else ",")
            reader = pcsv.open_csv(io.BytesIO(data), parse_options=opts,
                                   convert_options=pcsv.ConvertOptions(strings_can_be_null=True))
            yield from reader
        except pa.ArrowInvalid as e:
            raise InputError(f"{full_path(self.fs, path)}: not readable as CSV ({e})") from e

    def _count(self, path: str) -> int:
        return sum(b.num_rows for b in self._batches(path))

    def _read_rows(self, path: str, start: int, n: int) -> pa.Table:
        out, seen = [], 0
        for b in self._batches(path):
            lo, hi = max(start - seen, 0), min(start + n - seen, b.num_rows)
            if lo < hi:
                out.append(b.slice(lo, hi - lo))
            seen += b.num_rows
            if seen >= start + n:
                break
        return pa.Table.from_batches(out) if out else pa.table({})

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        t = self._read_rows(unit.path, unit.row_start, unit.num_rows)
        return t.select(columns) if columns else t
