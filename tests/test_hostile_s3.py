"""Hostile inputs on an object store (moto's S3 on loopback, tests/s3util.py): a corrupt page is the
input's fault (exit 3), not the store's (74); an unreachable store is 74 naming the URL; bad rows are
error rows exactly as on disk; no credential is ever printed."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hostile_util import fails, invoke, job, rows, succeeds
from s3util import BUCKET, s3  # noqa: F401 - fixture
from test_job_common import tiny_model  # noqa: F401 - fixture


def put(s3, key: str, data: bytes) -> str:  # noqa: F811
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=data)
    return s3.url(key)


def parquet_bytes(n: int) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(n)), "text": [f"row {i} of the table" for i in range(n)]}), buf,
                   row_group_size=10, compression="none", use_dictionary=False)
    return buf.getvalue()


def s3_job(tmp_path, model, s3, uri, endpoint=None, options=None, **sections):  # noqa: F811
    inp = {"uri": uri, "storage_options": s3.options(endpoint, **(options or {})), "passthrough": []}
    return job(tmp_path, model, uri, input=inp, **sections)


def test_empty_prefix(tmp_path, tiny_model, s3):  # noqa: F811
    r = invoke("validate", s3_job(tmp_path, tiny_model, s3, s3.url("hostile/nothing-here/")))
    fails(r, 3, f"s3://{BUCKET}/hostile/nothing-here", "no such file")
    assert s3.key not in r.stderr and s3.secret not in r.stderr


def test_truncated_object(tmp_path, tiny_model, s3):  # noqa: F811
    data = parquet_bytes(30)
    uri = put(s3, "hostile/trunc/p.parquet", data[:-40])
    fails(invoke("validate", s3_job(tmp_path, tiny_model, s3, uri)), 3, uri, "not a readable Parquet file")


def test_corrupt_page_on_s3_is_exit_3_not_74(tmp_path, tiny_model, s3):  # noqa: F811
    """The page's bytes arrive fine from the store; they just do not decode: no retry can help."""
    data = bytearray(parquet_bytes(30))
    chunk = pq.read_metadata(io.BytesIO(bytes(data))).row_group(1).column(1)
    data[chunk.data_page_offset:chunk.data_page_offset + 24] = b"\xab" * 24
    uri = put(s3, "hostile/corrupt/p.parquet", bytes(data))
    r = invoke("submit", s3_job(tmp_path, tiny_model, s3, uri, plan={"unit_rows": 10}), "--no-progress")
    fails(r, 3, uri, "row group(s) 1", "corrupt")


def test_unreachable_store_is_74_naming_the_url(tmp_path, tiny_model, s3, monkeypatch):  # noqa: F811
    monkeypatch.setenv("BATCHRUN_IO_ATTEMPTS", "2")
    monkeypatch.setenv("BATCHRUN_IO_BACKOFF_S", "0.01")
    uri = s3.url("hostile/down/")
    quick = {"config_kwargs": {"retries": {"max_attempts": 1}}}     # botocore's own retries: ours suffice
    r = invoke("validate", s3_job(tmp_path, tiny_model, s3, uri, endpoint="http://127.0.0.1:9", options=quick))
    fails(r, 74, f"s3://{BUCKET}/hostile/down")
    assert s3.key not in r.stderr and s3.secret not in r.stderr


@pytest.mark.parametrize("name, body, line, needle", [
    ("p.csv", b"id,text\n1,first row\n2,caf\xe9 au lait\n3,third row\n", 3, "column 'text' is not UTF-8"),
    ("p.jsonl", b'{"id": 1, "text": "first row"}\n{"id": 99999999999999999999, "text": "x"}\n'
                b'{"id": 3, "text": "third row"}\n', 2, "'id': integer 99999999999999999999"),
])
def test_bad_row_on_s3_is_an_error_row(tmp_path, tiny_model, s3, name, body, line, needle):  # noqa: F811
    uri = put(s3, f"hostile/rows/{name}", body)
    succeeds(invoke("submit", s3_job(tmp_path, tiny_model, s3, uri), "--no-progress", "--json"))
    got = rows(str(tmp_path / "out"))
    assert [g[:2] for g in got] == [(1, "length"), (3, "length"), (None, "error")]
    assert got[2][2].startswith(f"{uri}: line {line}: {needle}")
    summary = (tmp_path / "out" / "_batchrun" / "summary.json").read_text()
    assert json.loads(summary)["error_rows"] == 1 and s3.secret not in summary
