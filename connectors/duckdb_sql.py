"""DuckDB SQL source: `input.sql` runs once per output and its result is materialised into the job's
own staging area, so units are deterministic and a resume never re-runs the query.

Layout under the output URL (written through the output's filesystem, so object stores work too):
    _batchrun/input/<key>-<nonce>/data-<n>.parquet-snapshot   the result, row groups of unit_rows rows
    _batchrun/input/<key>.json                                 the completion marker: sql, dir, rows
<key> is a hash of the SQL text. The marker is created only after every snapshot file is complete, and
create-only, so a crash mid-materialisation leaves no marker (the next submit runs the query again into
a fresh directory and removes the debris) and two racing first submits agree on one snapshot. The
snapshot files do not end in .parquet, so no `read_parquet('OUT/**/*.parquet')` over the results picks
them up; they are Parquet all the same.

Relative paths in the SQL resolve against the job file's directory (DuckDB's file_search_path). Other
fsspec protocols named in the SQL (`memory://`, `s3://`, `gs://`, ...) are read through fsspec with the
input's storage_options, so no DuckDB extension has to be downloaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import time
import uuid
from typing import Optional

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.connectors.base import InputError, filesystem, full_path
from batchrun.connectors.parquet import ParquetSource
from batchrun.connectors.sink import ParquetSink

STAGING = "_batchrun/input"
SUFFIX = ".parquet-snapshot"
FILE_ROW_GROUPS = 256          # row groups per snapshot file
_NO_FSSPEC = {"file", "local", "http", "https"}    # DuckDB reads these itself
CRASH_ENV = "BATCHRUN_TEST_CRASH_AT"     # as in batchrun.job.run; point "sql_staged" is handled here


class SqlSource(ParquetSource):
    """The materialised result of `input.sql`. `snapshot` is the completion marker's content; `ran_query`
    tells whether this process ran the query (False: an earlier submit's snapshot was reused)."""

    def __init__(self, uri: str, storage_options: Optional[dict], sql: str, snapshot: dict, ran_query: bool):
        super().__init__(uri, storage_options)
        self.sql = sql
        self.snapshot = snapshot
        self.ran_query = ran_query


def sql_key(sql: str) -> str:
    return hashlib.sha256(sql.encode()).hexdigest()[:16]


def open_sql_source(sql: str, output_uri: str, output_storage_options: Optional[dict] = None,
                    input_storage_options: Optional[dict] = None, base_dir: str = ".",
                    row_group_rows: int = 2048, restart: bool = False, stage: bool = True) -> SqlSource:
    """The snapshot of `sql` staged under `output_uri`, running the query only when there is none.

    restart: run the query again even if a snapshot exists (submit --restart).
    stage=False (validate): never write under the output; without a snapshot the query's result goes
    to a private memory:// directory for this process only.
    Raises InputError naming input.sql with DuckDB's message when the query fails.
    """
    if stage:
        sink = ParquetSink(output_uri, output_storage_options)
    else:
        sink = ParquetSink(output_uri, output_storage_options, create=False)
    key = sql_key(sql)
    marker = f"{STAGING}/{key}.json"
    snap = None if restart else _read_marker(sink, marker, sql)
    if snap is not None:
        return _open(sink, output_storage_options, sql, snap, ran_query=False)
    if not stage:
        mem = ParquetSink(f"memory://batchrun-validate/{uuid.uuid4().hex}")
        snap = _materialize(sql, mem, f"{key}-{uuid.uuid4().hex[:12]}", input_storage_options, base_dir,
                            row_group_rows)
        return _open(mem, None, sql, snap, ran_query=True)
    try:
        snap = _materialize(sql, sink, f"{key}-{uuid.uuid4().hex[:12]}", input_storage_options, base_dir,
                            row_group_rows)
    except InputError:
        raise
    except Exception:    # noqa: BLE001 - e.g. a racing submit that won removed our half-written directory
        other = None if restart else _read_marker(sink, marker, sql)
        if other is None:
            raise
        return _open(sink, output_storage_options, sql, other, ran_query=False)
    if os.environ.get(CRASH_ENV) == "sql_staged":    # crash test: snapshot written, no marker yet
        os.kill(os.getpid(), signal.SIGKILL)
    data = (json.dumps(snap, indent=1, sort_keys=True) + "\n").encode()
    if restart:
        sink.remove([marker])
    if not sink.put_new(marker, data):     # another submit finished first: use its snapshot
        _remove_dir(sink, f"{STAGING}/{snap['dir']}")
        snap = _read_marker(sink, marker, sql)
        if snap is None:
            raise InputError(f"{full_path(sink.fs, sink.path(marker))}: vanished while being read")
    for d in _snapshot_dirs(sink, key):      # debris of a crash mid-materialisation, or an older --restart
        if d != snap["dir"]:
            _remove_dir(sink, f"{STAGING}/{d}")
    return _open(sink, output_storage_options, sql, snap, ran_query=True)


def _read_marker(sink: ParquetSink, marker: str, sql: str) -> Optional[dict]:
    url = full_path(sink.fs, sink.path(marker))
    try:
        with sink.fs.open(sink.path(marker), "rb") as f:
            snap = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{url}: corrupt snapshot marker ({e}); delete it or submit --restart") from e
    if snap.get("sql") != sql:     # a hash collision is not worth a silent wrong answer
        raise InputError(f"{url}: snapshot of a different query; delete it or submit --restart")
    return snap


def _snapshot_dirs(sink: ParquetSink, key: str) -> list[str]:
    try:
        sink.fs.invalidate_cache(sink.path(STAGING))
    except Exception:   # noqa: BLE001 - not every filesystem keeps a listings cache
        pass
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in sink.fs.ls(sink.path(STAGING), detail=False)]
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith(f"{key}-") and not n.endswith(".json")]


def _remove_dir(sink: ParquetSink, name: str) -> None:
    try:
        sink.fs.rm(sink.path(name), recursive=True)
    except FileNotFoundError:
        pass


def _open(sink: ParquetSink, storage_options: Optional[dict], sql: str, snap: dict, ran_query: bool) -> SqlSource:
    uri = full_path(sink.fs, sink.path(f"{STAGING}/{snap['dir']}/*{SUFFIX}"))
    try:
        sink.fs.invalidate_cache(sink.path(f"{STAGING}/{snap['dir']}"))
    except Exception:   # noqa: BLE001
        pass
    src = SqlSource(uri, storage_options, sql, snap, ran_query)
    if src.num_rows != snap["rows"] or len(src.listing.files) != len(snap["files"]):
        raise InputError(f"{uri}: the staged snapshot of input.sql has {src.num_rows} rows in "
                         f"{len(src.listing.files)} file(s), its marker records {snap['rows']} in "
                         f"{len(snap['files'])}; submit --restart to run the query again")
    return src


def _connect(sql: str, input_storage_options: Optional[dict], base_dir: str):
    import duckdb
    con = duckdb.connect()
    con.execute(f"SET file_search_path = '{base_dir.replace(chr(39), chr(39) * 2)}'")
    for proto in sorted(set(re.findall(r"\b([a-zA-Z][a-zA-Z0-9+.-]*)://", sql)) - _NO_FSSPEC):
        if proto not in fsspec.available_protocols():
            continue       # a URL-looking string literal, or a scheme DuckDB knows itself
        try:       # through filesystem(): ${ENV_VAR} options expanded, a missing extra named
            fs, _ = filesystem(f"{proto}://", input_storage_options)
        except InputError as e:
            raise InputError(f"input.sql: {e}") from None
        con.register_filesystem(fs)
    return con


def _materialize(sql: str, sink: ParquetSink, dirname: str, input_storage_options: Optional[dict],
                 base_dir: str, row_group_rows: int) -> dict:
    """Run `sql` and write its result under STAGING/dirname; returns the marker's content."""
    con = _connect(sql, input_storage_options, base_dir)
    try:
        return _write_result(con, sql, sink, dirname, row_group_rows)
    finally:
        con.close()


def _write_result(con, sql: str, sink: ParquetSink, dirname: str, row_group_rows: int) -> dict:
    import duckdb
    t0 = time.time()
    try:
        rel = con.sql(sql)
        if rel is None:
            raise InputError("input.sql: the statement returns no rows; input.sql must be a query "
                             "(SELECT ...)")
        reader = rel.to_arrow_reader(row_group_rows)
        schema = reader.schema
    except duckdb.Error as e:
        raise InputError(f"input.sql: {e}") from None
    files: list[dict] = []
    rows = 0
    writer, fh, groups = None, None, 0
    pending: list[pa.RecordBatch] = []
    pending_rows = 0

    def open_file():
        nonlocal writer, fh, groups
        path = sink.path(f"{STAGING}/{dirname}/data-{len(files):05d}{SUFFIX}")
        sink.fs.makedirs(sink.path(f"{STAGING}/{dirname}"), exist_ok=True)
        fh = sink.fs.open(path, "wb")
        writer = pq.ParquetWriter(fh, schema, compression="zstd")
        groups = 0
        files.append({"name": path.rsplit("/", 1)[-1], "rows": 0})

    def close_file():
        nonlocal writer, fh
        if writer is not None:
            writer.close()
            fh.close()
            writer = fh = None

    def write(t: pa.Table):
        nonlocal groups, rows
        for off in range(0, t.num_rows, row_group_rows):
            if writer is None or groups >= FILE_ROW_GROUPS:
                close_file()
                open_file()
            chunk = t.slice(off, row_group_rows)
            writer.write_table(chunk, row_group_size=row_group_rows)
            files[-1]["rows"] += chunk.num_rows
            rows += chunk.num_rows
            groups += 1

    try:
        try:
            for batch in reader:
                pending.append(batch)
                pending_rows += batch.num_rows
                if pending_rows >= row_group_rows:
                    t = pa.Table.from_batches(pending, schema=schema).combine_chunks()
                    full = (pending_rows // row_group_rows) * row_group_rows
                    write(t.slice(0, full))
                    rest = t.slice(full)
                    pending, pending_rows = rest.to_batches(), rest.num_rows
        except (duckdb.Error, pa.ArrowException) as e:
            raise InputError(f"input.sql: {e}") from None
        if pending_rows or writer is None:
            if writer is None:
                open_file()
            if pending_rows:
                write(pa.Table.from_batches(pending, schema=schema))
        close_file()
    except BaseException:
        close_file()
        _remove_dir(sink, f"{STAGING}/{dirname}")
        raise
    return {"sql": sql, "dir": dirname, "files": files, "rows": rows, "columns": schema.names,
            "query_s": round(time.time() - t0, 3), "created_at": time.time()}
