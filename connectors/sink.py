"""The Parquet writer: one zstd Parquet file per committed unit, published through the output store.

How a file is made visible (atomically, create-only or replacing) is connectors/store.py's business;
this module knows the bytes and the names: `part-<k>.parquet`, the key-value metadata, the partition
layout. `read_parquet('OUT/*.parquet')` never sees a partial file: `_batchrun/` is not matched by that glob.

With partition columns (`output.partition_by: [lang]`) a unit becomes one file per partition value,
hive-style: `lang=en/part-<k>.parquet`, the partition columns left out of the file (readers take them
from the path: DuckDB `read_parquet('OUT/**/*.parquet', hive_partitioning=true)`). Every store call
is retried on transient failures (connectors/retry.py).
"""
from __future__ import annotations

import io
import json
import re
from typing import Any, Callable, Optional
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.connectors.base import InputError
from batchrun.connectors.retry import retry_io
from batchrun.connectors.store import Committed, OutputStore

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


def encode(table: pa.Table, metadata: dict[str, Any]) -> bytes:
    """The Parquet bytes of a part file: zstd, `metadata` as key-value metadata (non-str values JSON)."""
    meta = {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=ROW_GROUP_ROWS)
    return buf.getvalue()


def encode_unit(index: int, table: pa.Table, metadata: dict[str, Any],
                partition_by: list[str]) -> list[tuple[str, bytes]]:
    """[(name, bytes)] of unit `index`'s files: one `part-<k>.parquet`, or with partition columns one
    `c=v/part-<k>.parquet` per distinct value (rows in input order, the partition columns dropped),
    ordered by each value's first row, so the first file is the unit's claim (job/commit.py)."""
    if not partition_by:
        return [(part_name(index), encode(table, metadata))]
    keys = list(zip(*(table.column(c).to_pylist() for c in partition_by)))
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    rest = table.drop_columns(partition_by)
    return [(f"{partition_dir(partition_by, k)}/{part_name(index)}",
             encode(rest.take(pa.array(rows, pa.int64())), metadata))
            for k, rows in sorted(groups.items(), key=lambda kv: kv[1][0])]


class ParquetSink(OutputStore):
    """An output store that also writes result tables as Parquet part files (any fsspec URL)."""

    def commit(self, index: int, table: pa.Table, metadata: dict[str, Any],
               before_publish: Optional[Callable[[], None]] = None) -> Committed:
        """Publish `table` as part-<index>.parquet, replacing any earlier file of that unit.

        metadata: file key-value metadata (non-str values are JSON-encoded).
        before_publish: called once the bytes are complete but not yet visible (a crash-test hook).
        """
        return self.publish(part_name(index), encode(table, metadata), before_publish)

    def commit_partitioned(self, index: int, table: pa.Table, metadata: dict[str, Any],
                           partition_by: list[str], before_publish: Optional[Callable[[], None]] = None
                           ) -> list[Committed]:
        """Publish one file per distinct value of `partition_by` in `table`: `c=v/part-<index>.parquet`,
        rows in input order, the partition columns dropped from the file. Without partition columns this
        is commit(). before_publish runs once, before the first file becomes visible."""
        files = encode_unit(index, table, metadata, partition_by)
        return [self.publish(name, data, before_publish if n == 0 else None) for n, (name, data) in enumerate(files)]

    def encode(self, table: pa.Table, metadata: dict[str, Any]) -> bytes:
        """The Parquet bytes of a part file (zstd, `metadata` as key-value metadata)."""
        return encode(table, metadata)

    def part_metadata(self, name: str) -> dict[str, str]:
        """The key-value metadata of the part file `name` (its footer only is read); {} if unreadable."""
        try:
            def read():
                with self.open(name) as f:
                    return pq.read_metadata(f).metadata or {}
            meta = retry_io(read, self.url_of(name), "read footer")
        except FileNotFoundError:
            return {}
        except Exception:   # noqa: BLE001 - a torn or foreign file: no writer to vouch for it
            return {}
        return {k.decode(): v.decode("utf-8", "replace") for k, v in meta.items()}

    def list_parts(self) -> dict[str, int]:
        """{name relative to the root: size} of every unit part file now visible (partition
        directories included), bypassing any listings cache."""
        return {name: size for name, size in self.find().items() if unit_of(name) is not None}
