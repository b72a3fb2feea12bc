"""CSV source (connectors/lines.py has the shared row-range machinery and JSONL).

Planning finds where each record starts (byte offset and physical line) with Python's csv reader, the
same dialect as pyarrow's defaults ('"' quotes, doubled to escape, quoted newlines, blank lines
skipped); a unit is then its byte range, parsed by pyarrow with the header's column names.

Text columns are read as bytes and decoded here, so a value that is not UTF-8 (a Latin-1 row in a UTF-8
file) is an error row naming its physical line instead of turning its whole column into `binary` or
failing the job; so is a row with the wrong number of fields. Every parse is eager (pyarrow's
read_csv): a streaming reader dropped half-read leaves a read-ahead thread that can abort the
interpreter at exit.
"""
from __future__ import annotations

import csv
import io
from typing import Callable, Iterator, Optional

import pyarrow as pa
import pyarrow.csv as pcsv

from batchrun.connectors.base import InputError, Unit
from batchrun.connectors.lines import _conform, _LineSource, scatter, with_row_errors

_SCHEMA_BYTES = 1 << 20        # types are inferred from the first MiB of the first file (pyarrow's block)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
        or pa.types.is_large_binary(t)


class CsvSource(_LineSource):
    """CSV with a header row (.tsv: tab-separated). Column types are inferred once, from the first file's
    first block, and imposed on every read so all units agree; text columns are strings (decoded here).
    A row with the wrong number of fields, or with bytes that are not UTF-8, is an error row naming its
    physical line."""

    suffixes = (".csv", ".tsv")

    def __init__(self, uri: str, storage_options: Optional[dict] = None):
        self._types: Optional[dict[str, pa.DataType]] = None    # what pyarrow parses each column as
        self._text: set[str] = set()                             # text columns: parsed as bytes, decoded here
        self._lines_at: dict[tuple[str, int], int] = {}      # (path, byte offset of a unit) -> its first line
        super().__init__(uri, storage_options)

    def _delimiter(self, path: str) -> str:
        return "\t" if path.endswith(".tsv") else ","

    def _parse(self, data: bytes, path: str, on_invalid: Optional[Callable] = None,
               names: Optional[list[str]] = None) -> pa.Table:
        opts = pcsv.ParseOptions(delimiter=self._delimiter(path), newlines_in_values=True,
                                 invalid_row_handler=on_invalid)
        conv = pcsv.ConvertOptions(strings_can_be_null=True, column_types=self._types)
        try:
            # use_threads=False: only then does pyarrow report the record number of an invalid row
            return pcsv.read_csv(io.BytesIO(data), read_options=pcsv.ReadOptions(use_threads=False, column_names=names),
                                 parse_options=opts, convert_options=conv)
        except pa.ArrowInvalid as e:
            raise InputError(f"{self.name(path)}: not readable as CSV ({' '.join(str(e).split())})") from e

    def _head(self, path: str) -> bytes:
        """The header and the first whole records of `path`, about _SCHEMA_BYTES (one ranged read)."""
        size, n = self._size(path), _SCHEMA_BYTES
        while True:
            data = self.fs.cat_file(path, start=0, end=min(size, n))
            if n >= size:
                return data
            text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape", newline="")
            starts = []
            try:
                starts = [off for off, _ in _record_starts(text, self._delimiter(path))]
            except csv.Error:     # the block ends inside a quoted value: the starts found so far hold
                pass
            if len(starts) > 2:   # the header, whole records, and the last (perhaps cut) one left out
                return data[:starts[-1]]
            n *= 2

    def _schema_of(self, path: str) -> pa.Schema:
        schema = self._retried(lambda: self._parse(self._head(path), path, lambda row: "skip").schema, path,
                               "read")
        if self._types is None:
            self._text = {f.name for f in schema if _is_text(f.type)}
            self._types = {f.name: pa.binary() if f.name in self._text else f.type for f in schema}
        return pa.schema([pa.field(f.name, pa.string()) if f.name in self._text else f for f in schema])

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

    def _decode_text(self, t: pa.Table) -> tuple[pa.Table, dict[int, str]]:
        """`t` with its text columns decoded from bytes, and {row: what is wrong} for rows whose bytes
        are not UTF-8 (their values become null)."""
        bad: dict[int, str] = {}
        for c in [c for c in t.column_names if c in self._text]:
            col = t.column(c)
            try:
                decoded = col.cast(pa.string())       # validates: the fast path when every value is UTF-8
            except pa.ArrowInvalid:
                values = []
                for i, v in enumerate(col.to_pylist()):
                    try:
                        values.append(None if v is None else v.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        values.append(None)
                        bad.setdefault(i, f"column {c!r} is not UTF-8 text (byte {e.start} of the value: "
                                          f"{e.reason}): {v[:80]!r}")
                decoded = pa.array(values, pa.string())
            t = t.set_column(t.column_names.index(c), c, decoded)
        return t, bad

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        data = self._range(unit)
        short: dict[int, str] = {}        # record number (1-based in this unit) -> a wrong field count

        def on_invalid(row) -> str:
            snippet = row.text if len(row.text) <= 200 else row.text[:200] + "..."
            short[row.number] = f"expected {row.expected_columns} fields, found {row.actual_columns}: {snippet!r}"
            return "skip"
        t = self._parse(data, unit.path, on_invalid, self.schema.names)
        rows = t.num_rows + len(short)
        if rows != unit.num_rows:
            raise InputError(f"{self.name(unit.path)}: changed since planning (unit {unit.index} expects "
                             f"{unit.num_rows} rows from byte {unit.byte_offset}, found {rows})")
        t, undecodable = self._decode_text(t)
        problems = dict(short)          # by record number; the parsed rows are the other records, in order
        good_recs = [rec for rec in range(1, rows + 1) if rec not in short]
        problems.update({good_recs[i]: why for i, why in undecodable.items()})
        if not problems:
            return _conform(t, self.schema, columns, self.name(unit.path))
        first_line = self._lines_at.get((unit.path, unit.byte_offset), 0)
        lines = _record_lines(data, self._delimiter(unit.path), set(problems))
        positions: list[Optional[int]] = []
        errors: list[Optional[str]] = []
        j = 0
        for rec in range(1, rows + 1):
            if rec in problems:
                line = lines.get(rec)
                at = f"line {first_line + line - 1}" if line and first_line else "a row"
                positions.append(None)
                errors.append(f"{self.name(unit.path)}: {at}: {problems[rec]}")
            else:
                positions.append(j)
                errors.append(None)
            if rec not in short:      # a parsed row (t holds the undecodable ones too)
                j += 1
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
