"""Issue 14 item 4: JSONL and CSV inputs on object storage are range-read and retried, as Parquet is.

Against moto's S3 server on loopback, through the counting / fault-injecting proxy of s3util: a unit's
read fetches its own bytes (about 1/units of the file), never the rest of the file; and a job whose
input GETs fail (503s, connections dropped before or after the server answered; botocore's own retries
off) gives exactly the rows of the same job on local files.
"""
from __future__ import annotations

import csv
import json
import os

import duckdb
import pytest

from batchrun.connectors import open_source
from batchrun.job.plan import make_plan
from batchrun.job.run import JobRunner
from batchrun.job.spec import parse_job
from s3util import BUCKET, FaultyProxy, random_faults, s3  # noqa: F401
from test_job_common import job_dict, prompt_texts, tiny_model  # noqa: F401

N = 120


def write_input(path: str, fmt: str, texts: list) -> None:
    """Rows id, text, topic; CSV with quoted values spanning lines, and one bad line in each format."""
    rows = [{"id": i, "text": t + (" ..." * 40), "topic": "abc"[i % 3]} for i, t in enumerate(texts)]
    if fmt == "jsonl":
        lines = [json.dumps(r) for r in rows]
        lines[77] = '{"id": 77, "text": "unterminated'
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    else:
        rows[40]["text"] = "two\nlines, quoted"
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "text", "topic"])
            for i, r in enumerate(rows):
                if i == 77:
                    f.write('77,"bad",a,extra\n')
                else:
                    w.writerow([r["id"], r["text"], r["topic"]])


@pytest.fixture(scope="module", params=["jsonl", "csv"])
def lines_input(request, tmp_path_factory, s3):  # noqa: F811
    fmt = request.param
    d = tmp_path_factory.mktemp(f"ranges-{fmt}")
    local = str(d / f"prompts.{fmt}")
    write_input(local, fmt, prompt_texts(N, seed=4))
    key = f"ranges/{fmt}/in/prompts.{fmt}"
    s3.fs().put_file(local, f"{BUCKET}/{key}")
    return fmt, local, key


def test_a_unit_fetches_only_its_own_bytes(lines_input, s3):  # noqa: F811
    fmt, local, key = lines_input
    size = os.path.getsize(local)
    proxy = FaultyProxy(s3.endpoint).start()
    try:
        remote = open_source(s3.url(key), fmt, s3.options(proxy.endpoint))
        ref = open_source(local, fmt)
        units = remote.units(10)
        assert [(u.row_start, u.num_rows) for u in units] == [(u.row_start, u.num_rows) for u in ref.units(10)]
        fetched = []
        for u, r in zip(units, ref.units(10)):
            before = proxy.get_bytes[key]
            got = remote.read(u, ["id", "text", "topic"])
            fetched.append(proxy.get_bytes[key] - before)
            want = ref.read(r, ["id", "text", "topic"])
            assert got.to_pylist() == [
                {**row, "_batchrun_row_error": row["_batchrun_row_error"].replace(local, f"s3://{BUCKET}/{key}")}
                if row.get("_batchrun_row_error") else row for row in want.to_pylist()]
            assert fetched[-1] <= 2 * size / len(units), (u, fetched[-1], size)   # its slice, not the file
    finally:
        proxy.stop()
    assert len(units) == N // 10 and sum(fetched) <= size * 1.05


def test_a_job_over_flaky_jsonl_or_csv_input_gives_the_local_rows(lines_input, s3, tiny_model, monkeypatch,  # noqa: F811
                                                                   tmp_path):
    fmt, local, key = lines_input
    monkeypatch.setenv("BATCHRUN_IO_BACKOFF_S", "0.01")
    monkeypatch.setenv("BATCHRUN_IO_ATTEMPTS", "12")
    job = job_dict(tiny_model, local, str(tmp_path / "ref"), plan={"unit_rows": 20, "window_units": 2},
                   input={"passthrough": ["topic"]})
    JobRunner(make_plan(parse_job(job, "<ref>", "/")), progress_bar=False).run()
    proxy = FaultyProxy(s3.endpoint, random_faults(3, 0.2, 0.05, 0.05,
                                                   spare=lambda r: not r.key.startswith(f"ranges/{fmt}/in"))).start()
    try:
        no_retry = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}
        flaky = {**job, "input": {**job["input"], "uri": s3.url(key),
                                  "storage_options": s3.options(proxy.endpoint, **no_retry)},
                 "output": {"uri": str(tmp_path / "out")}}
        summary = JobRunner(make_plan(parse_job(flaky, "<flaky>", "/")), progress_bar=False).run()
    finally:
        proxy.stop()
    assert proxy.injected["503"] > 0 and summary["rows"] == N and summary["error_rows"] == 1
    q = "SELECT id, output, finish_reason, prompt_tokens, output_tokens FROM read_parquet('{}/*.parquet') ORDER BY id"
    assert duckdb.sql(q.format(tmp_path / "out")).fetchall() == duckdb.sql(q.format(tmp_path / "ref")).fetchall()
