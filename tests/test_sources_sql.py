"""The DuckDB SQL source: the query runs once, its result is staged under `<output>/_batchrun/input/`,
and every later submit (a resume after a crash included) plans from that snapshot, never from the
query. Oracles: DuckDB running the same query directly, and the same job over a Parquet file of the
query's rows. Crashes are real SIGKILLs of `batchrun submit` subprocesses."""
from __future__ import annotations

import json
import os

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.connectors import InputError
from batchrun.connectors.duckdb_sql import STAGING, SUFFIX, sql_key
from batchrun.job.ledger import FingerprintMismatch
from batchrun.job.plan import make_plan
from batchrun.job.run import JobRunner
from batchrun.job.spec import parse_job
from test_job_common import cli, counts, job_dict, results, tiny_model, write_job  # noqa: F401

WORDS = "river stone cloud paper engine garden window music table light".split()
SQL = "SELECT id, text, lang FROM read_parquet('data/docs.parquet') WHERE lang = 'en'"


def q(sql: str) -> list[tuple]:
    return duckdb.connect().execute(sql).fetchall()


def write_docs(d, n: int = 60, salt: int = 0) -> None:
    rows = [{"id": i, "text": " ".join(WORDS[(i * 3 + k + salt) % len(WORDS)] for k in range(2 + i % 7)),
             "lang": "en" if (i + salt) % 3 else "fr"} for i in range(n)]
    os.makedirs(d / "data", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), d / "data" / "docs.parquet", row_group_size=16)


def sql_job(model: str, out: str, sql: str = SQL, **sections) -> dict:
    job = job_dict(model, "unused", out, plan={"unit_rows": 8, "window_units": 2}, **sections)
    job["input"] = {"sql": sql, "id_column": "id", "prompt_column": "text", "passthrough": ["lang"]}
    return job


def plan_of(job: dict, base, **kw):
    return make_plan(parse_job(job, "<t>", str(base)), **kw)


def snapshot_state(out) -> dict:
    """{relative path: (bytes, mtime_ns)} of everything staged under _batchrun/input/."""
    root = os.path.join(out, STAGING)
    state = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                state[os.path.relpath(p, root)] = (fh.read(), os.stat(p).st_mtime_ns)
    return state


def test_sql_job_equals_the_query_and_a_parquet_run(tmp_path, tiny_model):  # noqa: F811
    write_docs(tmp_path)
    out = str(tmp_path / "out")
    summary = JobRunner(plan_of(sql_job(tiny_model, out), tmp_path), progress_bar=False).run()
    want = q(SQL.replace("'data/", f"'{tmp_path}/data/") + " ORDER BY id")
    assert summary["rows"] == len(want) and summary["error_rows"] == 0
    assert counts(out) == (len(want), len(want))
    got = results(out)
    assert [g[0] for g in got] == [w[0] for w in want]
    # the oracle run: the same rows as a Parquet file
    os.makedirs(tmp_path / "ref_in")
    pq.write_table(pa.Table.from_pylist([{"id": i, "text": t, "lang": lang} for i, t, lang in want]),
                   tmp_path / "ref_in" / "rows.parquet")
    ref = job_dict(tiny_model, str(tmp_path / "ref_in"), str(tmp_path / "ref"), plan={"unit_rows": 8})
    ref["input"]["passthrough"] = ["lang"]
    JobRunner(make_plan(parse_job(ref, "<t>", "/")), progress_bar=False).run()
    assert got == results(str(tmp_path / "ref"))
    # the snapshot: one marker naming the query, files that no *.parquet glob over the results matches
    marker = json.loads((tmp_path / "out" / STAGING / f"{sql_key(SQL)}.json").read_text())
    assert marker["sql"] == SQL and marker["rows"] == len(want)
    assert q(f"SELECT count(*) FROM read_parquet('{out}/**/*.parquet')")[0][0] == len(want)
    snap = q(f"SELECT count(*) FROM read_parquet('{out}/{STAGING}/*/*{SUFFIX}')")[0][0]
    assert snap == len(want)


def test_crash_then_changed_data_resume_uses_the_snapshot_and_restart_reruns(tmp_path, tiny_model):  # noqa: F811
    write_docs(tmp_path)
    ref_out = str(tmp_path / "ref")
    JobRunner(plan_of(sql_job(tiny_model, ref_out), tmp_path), progress_bar=False).run()
    ref = results(ref_out)
    out = str(tmp_path / "out")
    job = write_job(str(tmp_path / "job.yaml"), sql_job(tiny_model, out))
    p = cli("submit", job, "--json", "--no-progress", env={"BATCHRUN_TEST_CRASH_AT": "after_done:2"})
    assert p.returncode == -9, p.stderr
    n, _ = counts(out)
    assert 0 < n < len(ref)
    staged = snapshot_state(out)
    assert any(k.endswith(SUFFIX) for k in staged)
    write_docs(tmp_path, n=90, salt=1)          # the underlying data changes while the job is down
    p = cli("submit", job, "--json", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert results(out) == ref                  # every row from the snapshot, each once
    assert snapshot_state(out) == staged        # the query did not run again: nothing restaged
    # --restart runs the query again: now the rows of the new data
    p = cli("submit", job, "--json", "--no-progress", "--restart")
    assert p.returncode == 0, p.stderr
    want = q(SQL.replace("'data/", f"'{tmp_path}/data/") + " ORDER BY id")
    assert [g[0] for g in results(out)] == [w[0] for w in want] and len(want) != len(ref)
    assert snapshot_state(out) != staged and len([k for k in snapshot_state(out) if k.endswith(SUFFIX)]) >= 1
    assert not (set(snapshot_state(out)) & {k for k in staged if k.endswith(SUFFIX)})   # old snapshot removed


def test_crash_mid_materialisation_reruns_the_query_cleanly(tmp_path, tiny_model):  # noqa: F811
    write_docs(tmp_path)
    out = str(tmp_path / "out")
    job = write_job(str(tmp_path / "job.yaml"), sql_job(tiny_model, out))
    p = cli("submit", job, "--json", "--no-progress", env={"BATCHRUN_TEST_CRASH_AT": "sql_staged"})
    assert p.returncode == -9, p.stderr
    debris = snapshot_state(out)
    assert debris and not any(k.endswith(".json") for k in debris)     # files written, no marker
    plan = plan_of(sql_job(tiny_model, out), tmp_path)
    assert plan.source.ran_query
    JobRunner(plan, progress_bar=False).run()
    after = snapshot_state(out)
    assert not set(debris) & set(after)          # the half-staged directory is gone
    want = q(SQL.replace("'data/", f"'{tmp_path}/data/") + " ORDER BY id")
    assert [g[0] for g in results(out)] == [w[0] for w in want]
    assert not plan_of(sql_job(tiny_model, out), tmp_path).source.ran_query


def test_bad_query_names_input_sql_and_duckdb_message_before_weights(tmp_path, tiny_model):  # noqa: F811
    write_docs(tmp_path)
    out = tmp_path / "out"
    job = write_job(str(tmp_path / "job.yaml"), sql_job(tiny_model, str(out), sql="SELEC id FROM docs"))
    p = cli("submit", job, "--json")
    assert p.returncode == 3
    assert "input.sql: Parser Error: syntax error" in p.stderr
    assert not (out / "_batchrun" / "manifest.json").exists()
    with pytest.raises(InputError, match=r"input\.sql: .*No files found.*nope\.parquet"):
        plan_of(sql_job(tiny_model, str(out), sql="SELECT * FROM read_parquet('nope.parquet')"), tmp_path)
    # an error while rows stream out: nothing half-staged is left behind
    boom = ("SELECT i AS id, CASE WHEN i < 500 THEN 'word' ELSE error('boom at ' || i) END AS text, 'en' AS lang "
            "FROM range(1000) t(i)")
    with pytest.raises(InputError, match=r"input\.sql: .*boom at"):
        plan_of(sql_job(tiny_model, str(out), sql=boom), tmp_path)
    assert not any(f.endswith(SUFFIX) for _, _, fs in os.walk(out) for f in fs)
    with pytest.raises(InputError, match="input.prompt_column: column 'text' not found in the result of input.sql"):
        plan_of(sql_job(tiny_model, str(out), sql="SELECT 1 AS id"), tmp_path)


def test_changed_sql_is_refused_and_validate_stages_nothing(tmp_path, tiny_model):  # noqa: F811
    write_docs(tmp_path)
    out = str(tmp_path / "out")
    v = plan_of(sql_job(tiny_model, out), tmp_path, stage_input=False)
    assert v.num_rows > 0 and not os.path.exists(os.path.join(out, "_batchrun"))
    JobRunner(plan_of(sql_job(tiny_model, out), tmp_path), progress_bar=False).run()
    other = SQL.replace("'en'", "'fr'")
    plan = plan_of(sql_job(tiny_model, out, sql=other), tmp_path)
    assert plan.fingerprint["input"]["sql"] == other
    with pytest.raises(FingerprintMismatch, match="input"):
        JobRunner(plan, progress_bar=False).run()
    # validate after a submit reports the staged snapshot and runs nothing
    assert not plan_of(sql_job(tiny_model, out), tmp_path, stage_input=False).source.ran_query


def test_sql_over_memory_filesystem_input_and_output(tmp_path, tiny_model):  # noqa: F811
    mem = fsspec.filesystem("memory")
    rows = [{"id": f"m{i}", "text": " ".join(WORDS[: 1 + i % 9]), "lang": "en" if i % 2 else "de"} for i in range(30)]
    with mem.open("/sqltest/in/docs.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist(rows), f)
    sql = "SELECT id, text, lang FROM read_parquet('memory://sqltest/in/docs.parquet') WHERE lang = 'en'"
    try:
        job = sql_job(tiny_model, "memory://sqltest/out", sql=sql, output={"openai_jsonl": True})
        s = JobRunner(plan_of(job, tmp_path), progress_bar=False).run()
        assert s["rows"] == 15 and s["error_rows"] == 0
        assert mem.exists(f"/sqltest/out/{STAGING}/{sql_key(sql)}.json")
        ids = []
        for p in sorted(mem.glob("/sqltest/out/part-*.parquet")):
            with mem.open(p, "rb") as f:
                ids += pq.read_table(f).column("id").to_pylist()
        assert sorted(ids) == sorted(r["id"] for r in rows if r["lang"] == "en")
        # the OpenAI-format file goes up through the same filesystem, one line per row
        with mem.open("/sqltest/out/openai_output.jsonl", "rb") as f:
            assert sorted(json.loads(x)["custom_id"] for x in f) == sorted(ids)
    finally:
        mem.rm("/sqltest", recursive=True)
