"""Parquet source: units are row ranges aligned to row groups, enumerated from file footers alone."""
from __future__ import annotations

from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.connectors.base import InputError, Listing, Source, Unit, full_path, list_files


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
                with self.fs.open(f.path, "rb") as fh:
                    pf = pq.ParquetFile(fh)
                    meta, schema = pf.metadata, pf.schema_arrow
            except Exception as e:  # pyarrow raises several types for non-Parquet bytes
                raise InputError(f"{name}: not a readable Parquet file ({e})") from e
            if self.schema is None:
                self.schema = schema
            elif not schema.equals(self.schema):
                raise InputError(f"{name}: schema differs from the first file's "
                                 f"({full_path(self.fs, files[0].path)}):\n  {schema}\n  vs\n  {self.schema}")
            self._meta.append(meta)

    @property
    def num_rows(self) -> int:
        return sum(m.num_rows for m in self._meta)

    def units(self, unit_rows: int) -> list[Unit]:
        """Consecutive row groups of a file form a unit until it holds >= unit_rows rows; a larger row
        group is split into row ranges. Numbering follows the sorted listing, so it is deterministic."""
        units: list[Unit] = []
        first = 0
        for f, meta in zip(self.listing.files, self._meta):
            start, groups, rows = 0, [], 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if n > unit_rows and not groups:
                    for off in range(0, n, unit_rows):
                        k = min(unit_rows, n - off)
                        units.append(Unit(len(units), f.path, start + off, k, first + start + off, (g,)))
                    start += n
                    continue
                groups.append(g)
                rows += n
                if rows >= unit_rows:
                    units.append(Unit(len(units), f.path, start, rows, first + start, tuple(groups)))
                    start, groups, rows = start + rows, [], 0
            if groups:
                units.append(Unit(len(units), f.path, start, rows, first + start, tuple(groups)))
            first += meta.num_rows
        return units

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        i = next(i for i, f in enumerate(self.listing.files) if f.path == unit.path)
        meta = self._meta[i]
        group_start = sum(meta.row_group(g).num_rows for g in range(unit.row_groups[0]))
        try:
            with self.fs.open(unit.path, "rb") as fh:
                table = pq.ParquetFile(fh).read_row_groups(list(unit.row_groups), columns=columns)
        except Exception as e:
            raise InputError(f"{full_path(self.fs, unit.path)}: read failed ({e})") from e
        return table.slice(unit.row_start - group_start, unit.num_rows)
