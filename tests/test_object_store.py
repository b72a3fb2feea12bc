"""Object storage against a real S3 API (moto's server on 127.0.0.1) and hive-partitioned output.

Oracles: the same job run on local files (every S3 run must give exactly its rows), "every input id
exactly once", the server's own 412 for a second create-only PUT, byte counts seen by a proxy in front
of the server against the Parquet footer's column-chunk sizes, and a scan of every written byte for the
credentials.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchrun.connectors import InputError, ParquetSink, filesystem
from batchrun.connectors import retry as retry_mod
from batchrun.connectors.parquet import ParquetSource
from batchrun.connectors.secrets import expand, redact
from batchrun.connectors.sink import check_partition_types
from batchrun.job.ledger import FingerprintMismatch, Ledger
from batchrun.job.plan import make_plan
from batchrun.job.run import EXIT_STORAGE, JobRunner
from batchrun.job.spec import JobError, parse_job
from s3util import BUCKET, FaultyProxy, random_faults, s3  # noqa: F401
from test_job_common import cli, job_dict, tiny_model, write_job, write_prompt_files  # noqa: F401

N, UNIT_ROWS = 60, 10
UNITS = N // UNIT_ROWS
COLS = "id, output, finish_reason, error, prompt_tokens, output_tokens, topic"


# -- shared data: prompts on S3 and the local run every S3 run must reproduce -----------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_model, s3):  # noqa: F811
    d = tmp_path_factory.mktemp("objstore")
    rows = write_prompt_files(str(d / "in"), N, files=2, row_group_size=UNIT_ROWS, seed=5)
    fs = s3.fs()
    for name in sorted(os.listdir(d / "in")):
        fs.put_file(str(d / "in" / name), f"{BUCKET}/shared/in/{name}")
    job = job_dict(tiny_model, str(d / "in"), str(d / "ref"), plan={"unit_rows": UNIT_ROWS, "window_units": 2},
                   engine={"max_num_seqs": 16})
    run(job)
    ref = duckdb.connect().execute(f"SELECT {COLS} FROM read_parquet('{d}/ref/*.parquet') ORDER BY id").fetchall()
    assert len(ref) == N and len({r[0] for r in ref}) == N
    return d, job, ref, rows


def run(job: dict, **kw) -> dict:
    return JobRunner(make_plan(parse_job(job, "<test>", "/")), progress_bar=False, **kw).run()


def s3_job(data, s3, name: str, endpoint=None, in_endpoint=None, **sections) -> dict:  # noqa: F811
    _, job, _, _ = data
    out = {"uri": s3.url(f"{name}/out"), "storage_options": s3.options(endpoint)}
    inp = {"uri": s3.url("shared/in/"), "storage_options": s3.options(in_endpoint)}
    return {**job, "input": {**job["input"], **inp}, "output": out, **sections}


def s3_rows(s3, name: str, hive: bool = False) -> list:  # noqa: F811
    """Every row DuckDB sees under s3://bucket/name/out (read through s3fs registered with DuckDB:
    DuckDB's own httpfs would need a download)."""
    con = duckdb.connect()
    con.register_filesystem(s3.fs())
    glob = f"s3://{BUCKET}/{name}/out/" + ("**/*.parquet" if hive else "*.parquet")
    return con.execute(f"SELECT {COLS} FROM read_parquet('{glob}', hive_partitioning={str(hive).lower()}) "
                       "ORDER BY id").fetchall()


def assert_no_secrets(s3, prefix: str, texts=()) -> int:  # noqa: F811
    """Neither credential in any byte under the prefix (raw, and Parquet metadata and values decoded),
    nor in the captured texts. Returns the number of objects scanned."""
    secrets = [s3.key, s3.secret]
    fs = s3.fs()
    paths = fs.find(f"{BUCKET}/{prefix}")
    for p in paths:
        raw = fs.cat_file(p)
        blobs = [raw]
        if p.endswith(".parquet"):
            pf = pq.ParquetFile(io.BytesIO(raw))
            blobs += [repr(pf.schema_arrow.metadata).encode(), repr(pf.read().to_pylist()).encode()]
        for b in blobs:
            for s in secrets:
                assert s.encode() not in b, f"credential found in s3://{p}"
    for t in texts:
        for s in secrets:
            assert s not in t, "credential found in CLI output"
    return len(paths)


# -- the server and the filesystems ---------------------------------------------------------------------
def test_moto_answers_412_to_a_second_create_only_put(s3):  # noqa: F811
    """First check the server: a second PUT with If-None-Match: * is refused with 412 and the first
    object is untouched. Then our create-only write on S3, a local directory and memory://."""
    import botocore.exceptions
    c = s3.client()
    c.put_object(Bucket=BUCKET, Key="cas/raw", Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.put_object(Bucket=BUCKET, Key="cas/raw", Body=b"second", IfNoneMatch="*")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert c.get_object(Bucket=BUCKET, Key="cas/raw")["Body"].read() == b"first"


@pytest.mark.parametrize("where", ["s3", "local", "memory"])
def test_create_only_markers_have_one_winner(s3, tmp_path, where):  # noqa: F811
    """Two workers (separate filesystem instances, like two processes) race to mark the same units
    done: for every unit exactly one mark_done returns True, and the stored marker is the winner's."""
    uri = {"s3": s3.url("race/out"), "local": str(tmp_path / "out"), "memory": "memory://race/out"}[where]
    opts = s3.options() if where == "s3" else {}
    ledgers = [Ledger(ParquetSink(uri, {**opts, "skip_instance_cache": True} if opts else None))
               for _ in range(2)]
    units = 12
    won = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def worker(w):
        for k in range(units):
            barrier.wait()
            if ledgers[w].mark_done(k, {"unit": k, "worker": w}):
                won[w].append(k)

    ts = [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(won[0] + won[1]) == list(range(units))           # each unit exactly one winner
    markers = ledgers[0].done_markers()
    assert {k: m["worker"] for k, m in markers.items()} == {k: w for w in (0, 1) for k in won[w]}
    assert not ledgers[1].mark_done(0, {"unit": 0, "worker": 9})   # a late third try loses too
    assert ledgers[1].mark_done(99, {"unit": 99, "worker": 1})      # worker 0 listed before this:
    assert 99 in ledgers[0].done_markers()                         # its listing cache is bypassed


def test_missing_filesystem_names_the_extra(monkeypatch):
    """gs:// and az:// without gcsfs / adlfs: the message names the pip extra (the import is blocked,
    so this holds whether or not they happen to be installed)."""
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    monkeypatch.setitem(sys.modules, "adlfs", None)
    with pytest.raises(InputError) as e:
        filesystem("gs://bucket/prompts/")
    assert "gs://bucket/prompts/" in str(e.value) and "pip install 'batchrun[gcs]'" in str(e.value)
    with pytest.raises(InputError) as e:
        ParquetSink("abfs://container/out", create=False)
    assert "pip install 'batchrun[azure]'" in str(e.value)


def test_env_references_expand_at_use_and_are_redacted(monkeypatch, tiny_model, tmp_path):  # noqa: F811
    monkeypatch.setenv("BR_T_SECRET", "s3cr3t-value-xyz")
    opts = {"secret": "${BR_T_SECRET}", "client_kwargs": {"endpoint_url": "http://h:${BR_T_PORT}"},
            "list": ["a-${BR_T_SECRET}"]}
    monkeypatch.setenv("BR_T_PORT", "9000")
    assert expand(opts) == {"secret": "s3cr3t-value-xyz", "client_kwargs": {"endpoint_url": "http://h:9000"},
                            "list": ["a-s3cr3t-value-xyz"]}
    assert redact("denied for s3cr3t-value-xyz") == "denied for ***"
    job = job_dict(tiny_model, str(tmp_path / "in"), str(tmp_path / "out"))
    job["output"]["storage_options"] = {"secret": "${BR_T_UNSET_VAR}"}
    with pytest.raises(JobError) as e:
        parse_job(job, "job.yaml", "/")
    assert "output.storage_options.secret" in str(e.value) and "BR_T_UNSET_VAR" in str(e.value)
    spec = parse_job({**job, "output": {"uri": str(tmp_path / "o"), "storage_options": {"secret": "${BR_T_SECRET}"}}},
                     "job.yaml", "/")
    assert spec.output.storage_options == {"secret": "${BR_T_SECRET}"}        # the spec keeps the reference


def test_retry_classifies_errors_as_s3fs_raises_them(monkeypatch):
    """Errors shaped exactly as s3fs raises them (botocore ClientError translated by s3fs): a 503 is
    retried and then succeeds; a 403 stops at once as a permanent StorageError naming the URL; a
    missing key and a non-I/O error reach the caller unchanged after one call."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error
    monkeypatch.setenv("BATCHRUN_IO_BACKOFF_S", "0.001")
    monkeypatch.setenv("BATCHRUN_IO_ATTEMPTS", "4")

    def s3_error(code, status):
        return translate_boto_error(ClientError({"Error": {"Code": code, "Message": code},
                                                 "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"))

    def failing(errors, result="ok"):
        calls = []

        def fn():
            calls.append(1)
            if len(calls) <= len(errors):
                raise errors[len(calls) - 1]
            return result
        return fn, calls

    fn, calls = failing([s3_error("ServiceUnavailable", 503), s3_error("SlowDown", 503)])
    assert retry_mod.retry_io(fn, "s3://b/k", "put") == "ok" and len(calls) == 3
    fn, calls = failing([s3_error("InternalError", 500)] * 4)
    with pytest.raises(retry_mod.StorageError) as e:
        retry_mod.retry_io(fn, "s3://b/k", "put")
    assert len(calls) == 4 and e.value.transient and "s3://b/k: put failed (gave up after 4 attempts)" in str(e.value)
    fn, calls = failing([s3_error("AccessDenied", 403)])
    with pytest.raises(retry_mod.StorageError) as e:
        retry_mod.retry_io(fn, "s3://b/k", "put")
    assert len(calls) == 1 and not e.value.transient and "permanent error" in str(e.value) and "403" in str(e.value)
    for err in (s3_error("NoSuchKey", 404), ValueError("corrupt footer")):
        fn, calls = failing([err])
        with pytest.raises(type(err)):
            retry_mod.retry_io(fn, "s3://b/k", "get")
        assert len(calls) == 1


# -- jobs on S3 ------------------------------------------------------------------------------------------
def test_s3_job_end_to_end_with_cli_and_no_credentials_anywhere(data, s3, tmp_path):  # noqa: F811
    """S3 in, S3 out through `batchrun submit`; DuckDB reads back exactly the local run's rows;
    `status`, `validate` and `query` work from the job file; no credential in any written object or
    any command output."""
    _, _, ref, _ = data
    job = s3_job(data, s3, "e2e")
    path = write_job(str(tmp_path / "job.yaml"), job)
    assert s3.secret not in open(path).read()                     # the job file holds only ${...}
    p = cli("submit", path, "--json", "--no-progress", "-v")
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["units_committed"] == UNITS and summary["rows"] == N
    assert s3_rows(s3, "e2e") == ref
    runner = CliRunner()
    st = runner.invoke(cli_app(), ["status", path, "--json"])
    assert st.exit_code == 0 and json.loads(st.stdout)["state"] == "finished"
    q = runner.invoke(cli_app(), ["query", path, "SELECT count(*), count(DISTINCT id) FROM results",
                                  "--format", "csv"])
    assert q.exit_code == 0 and q.stdout.strip().splitlines()[-1] == f"{N},{N}"
    v = runner.invoke(cli_app(), ["validate", path])
    assert v.exit_code == 0 and "finished" in v.stdout
    scanned = assert_no_secrets(s3, "e2e", [p.stdout, p.stderr, st.stdout, q.stdout, v.stdout])
    names = {x.rsplit("/", 1)[-1] for x in s3.fs().find(f"{BUCKET}/e2e/out")}
    assert {"manifest.json", "summary.json", "progress.json", "_SUCCESS"} <= names and scanned > UNITS


def cli_app():
    from batchrun.cli import app
    return app


def test_s3_sigkill_after_publish_then_resume_every_id_once(data, s3, tmp_path):  # noqa: F811
    """The crash test of the job runner, on S3: SIGKILL after unit 3's part is PUT but before its
    marker; the part without a marker is removed on resume, and the result is the local run's rows."""
    _, _, ref, _ = data
    path = write_job(str(tmp_path / "job.yaml"), s3_job(data, s3, "crash"))
    p = cli("submit", path, "--no-progress", env={"BATCHRUN_TEST_CRASH_AT": "after_part:3"})
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    fs = s3.fs()
    parts = [x for x in fs.find(f"{BUCKET}/crash/out") if x.endswith(".parquet")]
    markers = fs.ls(f"{BUCKET}/crash/out/_batchrun/done")
    assert len(parts) == 3 and len(markers) == 2                 # one published part has no marker
    logs: list[str] = []
    summary = run(s3_job(data, s3, "crash"), log=logs.append)    # the resume, in this process
    assert summary["units_skipped"] == 2 and summary["units_committed"] == UNITS - 2
    assert any("resuming" in m for m in logs)
    got = s3_rows(s3, "crash")
    assert got == ref and len({r[0] for r in got}) == N
    assert len(fs.ls(f"{BUCKET}/crash/out/_batchrun/done", refresh=True)) == UNITS


def test_unit_committed_by_another_worker_is_not_committed_again(data, s3):  # noqa: F811
    """While this run works, another worker commits unit 0 (its part and marker appear on S3). This run
    must see the marker, skip publishing unit 0, and not count it; the output is still the local run's."""
    d, _, ref, _ = data
    job = s3_job(data, s3, "twoworkers")
    logs: list[str] = []
    runner = JobRunner(make_plan(parse_job(job, "<t>", "/")), progress_bar=False, log=logs.append)
    fs = s3.fs()

    def engine_factory(tokenizer):      # runs after the ledger opened, before any unit is written
        fs.put_file(str(d / "ref" / "part-000000.parquet"), f"{BUCKET}/twoworkers/out/part-000000.parquet")
        fs.put_file(str(d / "ref" / "_batchrun" / "done" / "0.json"), f"{BUCKET}/twoworkers/out/_batchrun/done/0.json")
        return runner._default_engine(tokenizer)
    runner.engine_factory = engine_factory
    summary = runner.run()
    assert summary["units_committed"] == UNITS - 1 and summary["rows"] == N
    assert any("unit 0 was committed by another worker" in m for m in logs)
    assert s3_rows(s3, "twoworkers") == ref


def test_transient_failures_are_retried(data, s3, monkeypatch):  # noqa: F811
    """A proxy in front of the server fails ~20% of requests (503, or the connection dropped before or
    after the server acted). botocore's own retries are off, so only batchrun's retries stand between
    the job and failure; the job finishes with exactly the local run's rows and counts every unit as
    its own (a marker PUT whose answer was lost is recognised as ours)."""
    _, _, ref, _ = data
    monkeypatch.setenv("BATCHRUN_IO_BACKOFF_S", "0.01")
    monkeypatch.setenv("BATCHRUN_IO_ATTEMPTS", "10")    # a unit read is several GETs: P(10 failed tries) ~ 1e-4
    proxy = FaultyProxy(s3.endpoint, random_faults(7, 0.12, 0.04, 0.04, spare=lambda r: "lock" in r.key)).start()
    try:
        no_retry = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}
        job = s3_job(data, s3, "flaky")
        job["input"]["storage_options"] = s3.options(proxy.endpoint, **no_retry)
        job["output"]["storage_options"] = s3.options(proxy.endpoint, **no_retry)
        before = retry_mod.STATS["retries"]
        summary = run(job)
    finally:
        proxy.stop()
    assert summary["units_committed"] == UNITS and summary["rows"] == N
    assert sum(proxy.injected.values()) >= 10 and proxy.injected["503"] > 0
    assert retry_mod.STATS["retries"] - before > 0
    assert s3_rows(s3, "flaky") == ref


def test_permanent_failure_exits_74_naming_the_url_then_resubmit_resumes(data, s3, tmp_path):  # noqa: F811
    """After two units are committed the store answers 503 to everything: `submit` stops with exit 74
    and a message naming the s3:// URL and the error; once the store is back a re-submit resumes and
    every id is there exactly once."""
    _, _, ref, _ = data
    state = {"markers": 0, "down": False}

    def rule(r):
        if "lock" in r.key:
            return None
        if state["down"]:
            return "503"
        if r.method == "PUT" and "/_batchrun/done/" in r.key:
            state["markers"] += 1
            state["down"] = state["markers"] >= 2
        return None

    proxy = FaultyProxy(s3.endpoint, rule).start()
    try:
        job = s3_job(data, s3, "outage", endpoint=proxy.endpoint)
        job["output"]["storage_options"]["config_kwargs"] = {"retries": {"total_max_attempts": 1}}
        path = write_job(str(tmp_path / "job.yaml"), job)
        env = {"BATCHRUN_IO_ATTEMPTS": "3", "BATCHRUN_IO_BACKOFF_S": "0.01"}
        p = cli("submit", path, "--json", "--no-progress", env=env)
        assert p.returncode == EXIT_STORAGE, p.stderr[-3000:]
        err = json.loads(p.stdout.strip().splitlines()[-1])["error"]
        assert f"s3://{BUCKET}/outage/out/" in err and "gave up after 3 attempts" in err and "503" in err
        assert 2 <= len(s3.fs().ls(f"{BUCKET}/outage/out/_batchrun/done")) < UNITS
        state["down"], state["markers"] = False, -10 ** 9
        summary = run(job)                                        # the re-submit, in this process
    finally:
        proxy.stop()
    assert 2 <= summary["units_skipped"] < UNITS and summary["rows"] == N
    assert s3_rows(s3, "outage") == ref


def test_parquet_units_fetch_only_their_row_groups(s3, tmp_path):  # noqa: F811
    """A unit's read fetches (through the proxy, counted) about its own column chunks: within the
    footer's compressed sizes of its row groups' selected columns (+ pyarrow's coalescing slack), a
    small fraction of the file. The rows equal a local read of the same slice."""
    import random
    rng = random.Random(0)
    n, rg = 400, 50
    table = pa.table({"id": [f"r{i:05d}" for i in range(n)], "text": [f"prompt {i}" for i in range(n)],
                      "blob": [rng.randbytes(2048) for _ in range(n)]})
    local = str(tmp_path / "wide.parquet")
    pq.write_table(table, local, row_group_size=rg, compression="zstd")
    size = os.path.getsize(local)
    s3.fs().put_file(local, f"{BUCKET}/ranges/wide.parquet")
    proxy = FaultyProxy(s3.endpoint).start()
    try:
        src = ParquetSource(s3.url("ranges/wide.parquet"), s3.options(proxy.endpoint))
        footer_bytes = proxy.get_bytes["ranges/wide.parquet"]
        units = src.units(rg)
        meta = pq.read_metadata(local)
        fetched = []
        for u in units:
            before = proxy.get_bytes["ranges/wide.parquet"]
            got = src.read(u, ["id", "text"])
            fetched.append(proxy.get_bytes["ranges/wide.parquet"] - before)
            assert got.equals(table.select(["id", "text"]).slice(u.row_start, u.num_rows))
            chunks = sum(meta.row_group(g).column(c).total_compressed_size for g in u.row_groups for c in (0, 1))
            assert chunks <= fetched[-1] <= chunks + 16 * 1024, (u, fetched[-1], chunks)
    finally:
        proxy.stop()
    assert len(units) == n // rg
    assert footer_bytes < size / 10 and sum(fetched) < size / 10


def test_changed_input_is_refused_unchanged_input_resumes(tiny_model, s3, tmp_path):  # noqa: F811
    """Same size, different bytes (only the ETag tells): the resume is refused naming the file; with the
    input unchanged a finished job re-submits cleanly."""
    rows = write_prompt_files(str(tmp_path / "in"), 20, files=1, row_group_size=10, seed=3)
    local = str(tmp_path / "in" / "prompts-00.parquet")
    t = pq.read_table(local)
    pq.write_table(t, local, compression="none", use_dictionary=False, row_group_size=10)
    s3.fs().put_file(local, f"{BUCKET}/changed/in/prompts-00.parquet")
    size_before = os.path.getsize(local)
    job = job_dict(tiny_model, s3.url("changed/in/"), s3.url("changed/out"), plan={"unit_rows": 10})
    job["input"]["storage_options"] = job["output"]["storage_options"] = s3.options()
    assert run(job)["units_committed"] == 2
    assert run(job)["units_committed"] == 0               # unchanged input: no false alarm
    texts = t.column("text").to_pylist()
    first = texts[0]
    texts[0] = first[:-1] + ("x" if first[-1] != "x" else "y")
    pq.write_table(t.set_column(1, "text", pa.array(texts)), local, compression="none", use_dictionary=False,
                   row_group_size=10)
    s3.fs().put_file(local, f"{BUCKET}/changed/in/prompts-00.parquet")
    info = s3.fs().info(f"{BUCKET}/changed/in/prompts-00.parquet")
    assert info["size"] == size_before and len(rows) == 20          # same size: only the ETag differs
    with pytest.raises(FingerprintMismatch) as e:
        run(job)
    msg = str(e.value)
    assert "input changed" in msg and f"{BUCKET}/changed/in/prompts-00.parquet: version" in msg
    assert "size" not in msg.split("prompts-00.parquet:")[1].split(")")[0]     # only the ETag differed


# -- partitioned output ------------------------------------------------------------------------------
def test_partitioned_output_on_s3_reads_back_with_hive_partitioning(data, s3):  # noqa: F811
    """partition_by: [topic] -> topic=<v>/part-<k>.parquet, one file per (unit, topic) present in the
    unit; DuckDB with hive_partitioning sees exactly the local run's rows; `query` sees them too."""
    _, _, ref, rows = data
    job = s3_job(data, s3, "parts")
    job["output"]["partition_by"] = ["topic"]
    assert run(job)["units_committed"] == UNITS
    files = sorted(x.split("/parts/out/", 1)[1] for x in s3.fs().find(f"{BUCKET}/parts/out") if x.endswith(".parquet"))
    expect = sorted({f"topic={r['topic']}/part-{i // UNIT_ROWS:06d}.parquet" for i, r in enumerate(rows)})
    assert files == expect
    assert s3_rows(s3, "parts", hive=True) == ref
    fs = s3.fs()
    one = pq.ParquetFile(io.BytesIO(fs.cat_file(f"{BUCKET}/parts/out/{files[0]}")))
    assert "topic" not in one.schema_arrow.names                 # the value lives in the path


def test_partitioned_crash_query_sees_only_committed_then_resume_cleans_orphans(data, tmp_path):
    """Local partitioned job SIGKILLed after unit 2's files are published but before its marker:
    `query` counts only committed rows; opening the ledger removes the orphan files; the resumed job
    gives every id once, equal to the local unpartitioned run."""
    d, job, ref, _ = data
    out = str(tmp_path / "out")
    pjob = {**job, "output": {"uri": out, "partition_by": ["topic"]}}
    path = write_job(str(tmp_path / "job.yaml"), pjob)
    p = cli("submit", path, "--no-progress", env={"BATCHRUN_TEST_CRASH_AT": "after_part:3"})
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    led = Ledger(ParquetSink(out))
    markers = led.done_markers()
    assert len(markers) == 2
    committed = {n for m in markers.values() for n in (f["name"] for f in m["files"])}
    on_disk = set(led.sink.list_parts())
    orphans = on_disk - committed                                 # one unit's files, without a marker
    assert committed < on_disk and len({n.rsplit("/", 1)[1] for n in orphans}) == 1
    q = CliRunner().invoke(cli_app(), ["query", out, "SELECT count(*), count(DISTINCT id) FROM results",
                                       "--format", "csv"])
    rows_committed = sum(m["rows"] for m in markers.values())
    assert q.exit_code == 0 and q.stdout.strip().splitlines()[-1] == f"{rows_committed},{rows_committed}"
    manifest = led.read_manifest()
    led.open(manifest["fingerprint"], {k: v for k, v in manifest.items() if k not in ("fingerprint", "version")})
    assert set(led.sink.list_parts()) == committed                # the orphans are gone
    assert run(pjob)["units_committed"] == UNITS - 2              # the resume, in this process
    got = duckdb.connect().execute(f"SELECT {COLS} FROM read_parquet('{out}/**/*.parquet', hive_partitioning=true) "
                                   "ORDER BY id").fetchall()
    assert got == ref


def test_partition_columns_must_be_passthrough_scalars(data, tmp_path):
    _, job, _, _ = data
    bad = {**job, "output": {"uri": str(tmp_path / "o"), "partition_by": ["lang"]}}
    with pytest.raises(JobError) as e:
        parse_job(bad, "job.yaml", "/")
    assert "output.partition_by" in str(e.value) and "'lang'" in str(e.value)
    schema = pa.schema([("topic", pa.string()), ("tags", pa.list_(pa.string()))])
    check_partition_types(schema, ["topic"])
    with pytest.raises(InputError) as e:
        check_partition_types(schema, ["tags"])
    assert "'tags'" in str(e.value) and "list<" in str(e.value)
