"""Tiny jobs on any object store (tests/emulators.py): the shared prompts, the local run every store run
must reproduce, job dicts pointing at a store (or a proxy in front of it), DuckDB reads of a store's
output, and a scan of every stored byte for the credentials. No tests here."""
from __future__ import annotations

import io
import os

import duckdb
import pyarrow.parquet as pq
import pytest

from batchrun.job.plan import make_plan
from batchrun.job.run import JobRunner
from batchrun.job.spec import parse_job
from emulators import BUCKET
from test_job_common import job_dict, write_prompt_files

N, UNIT_ROWS = 60, 10
UNITS = N // UNIT_ROWS
COLS = "id, output, finish_reason, error, prompt_tokens, output_tokens, topic"
FAST_IO = {"BATCHRUN_IO_ATTEMPTS": "8", "BATCHRUN_IO_BACKOFF_S": "0.02"}


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_model):
    """(input dir, job dict, rows of the clean local run): 60 prompts in 2 Parquet files, 6 units."""
    d = tmp_path_factory.mktemp("storeref")
    write_prompt_files(str(d / "in"), N, files=2, row_group_size=UNIT_ROWS, seed=11)
    job = job_dict(tiny_model, str(d / "in"), str(d / "ref"), plan={"unit_rows": UNIT_ROWS, "window_units": 2},
                   engine={"max_num_seqs": 16})
    run(job)
    return str(d / "in"), job, local_rows(str(d / "ref"))


def run(job: dict, **kw) -> dict:
    """The job in this process (the code path of `batchrun submit`, without the process)."""
    return JobRunner(make_plan(parse_job(job, "<test>", "/")), progress_bar=False, **kw).run()


def local_rows(out: str) -> list:
    return duckdb.connect().execute(f"SELECT {COLS} FROM read_parquet('{out}/*.parquet') ORDER BY id").fetchall()


def upload_inputs(store, reference, prefix: str = "storejobs/in") -> str:
    """The reference prompts copied to `prefix` on the store (once); returns its URL. The prefix is this
    module's own: the session's S3 server also holds test_object_store's different `shared/in/`."""
    fs = store.fs()
    src = reference[0]
    for name in sorted(os.listdir(src)):
        dest = f"{BUCKET}/{prefix}/{name}"
        if not fs.exists(dest):
            fs.put_file(os.path.join(src, name), dest)
    return store.url(prefix + "/")


def store_job(store, reference, name: str, endpoint=None, in_endpoint=None, **sections) -> dict:
    """The reference job reading the store's copy of the prompts and writing to `name/out` on it."""
    _, job, _ = reference
    inp = {"uri": upload_inputs(store, reference), "storage_options": store.options(in_endpoint)}
    out = {"uri": store.url(f"{name}/out"), "storage_options": store.options(endpoint)}
    return {**job, "input": {**job["input"], **inp}, "output": out, **sections}


def store_rows(store, name: str) -> list:
    """Every row DuckDB's read_parquet sees under `name/out/*.parquet` on the store (the store's fsspec
    filesystem registered with DuckDB)."""
    con = duckdb.connect()
    fs = store.fs()
    con.register_filesystem(fs)
    proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return con.execute(f"SELECT {COLS} FROM read_parquet('{proto}://{BUCKET}/{name}/out/*.parquet') "
                       "ORDER BY id").fetchall()


def markers(store, name: str) -> list:
    fs = store.fs()
    try:
        return fs.ls(f"{BUCKET}/{name}/out/_batchrun/done", detail=False)
    except FileNotFoundError:
        return []


def assert_no_secrets(store, prefix: str, texts=()) -> int:
    """No credential in any object under the prefix (raw bytes, Parquet metadata and values decoded) or
    in the given texts; returns the number of objects scanned."""
    fs = store.fs()
    paths = fs.find(f"{BUCKET}/{prefix}")
    for p in paths:
        raw = fs.cat_file(p)
        blobs = [raw]
        if p.endswith(".parquet"):
            pf = pq.ParquetFile(io.BytesIO(raw))
            blobs += [repr(pf.schema_arrow.metadata).encode(), repr(pf.read().to_pylist()).encode()]
        for b in blobs:
            for s in store.secrets:
                assert s.encode() not in b, f"credential found in {store.scheme}://{p}"
    for t in texts:
        for s in store.secrets:
            assert s not in t, "credential found in command output"
    return len(paths)
