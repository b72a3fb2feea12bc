"""End to end through the CLI: 2,000 prompts over several Parquet files, read back with DuckDB."""
import duckdb
import pyarrow.parquet as pq

from batchrun import LLM, SamplingParams
from jobutil import cli, counts, last_json, prompt_rows, results, write_job, write_parquet_files

N = 640


def test_cli_job_every_id_once_and_equal_to_llm_generate(job_model, tmp_path):
    rows = prompt_rows(N)
    write_parquet_files(str(tmp_path / "in"), rows, files=4, row_group_size=100)
    job = write_job(str(tmp_path / "job.yaml"), job_model, str(tmp_path / "in"), str(tmp_path / "out"),
                    plan__unit_rows=64, plan__window_units=3)
    r = cli("submit", job, "--json", "--quiet", check=True)
    summary = last_json(r.stdout)
    assert summary["ok"] and summary["rows"] == N and summary["error_rows"] == 0
    out = str(tmp_path / "out")
    assert counts(out) == (N, N)
    got = results(out)
    assert [g[0] for g in got] == sorted(r["id"] for r in rows)
    # the oracle: the same prompts through LLM.generate in one call, in input order
    llm = LLM(job_model, dtype="float32", max_num_seqs=64)
    want = llm.generate([f"Q: {r['text']}" for r in rows],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [(g[1], g[2], g[3]) for g in got] == [(w.text, w.finish_reason, len(w.token_ids)) for w in want]
    # passthrough and schema; metadata carries job, model and sampling
    con = duckdb.connect()
    topic = con.sql(f"SELECT id, topic FROM read_parquet('{out}/*.parquet') ORDER BY id").fetchall()
    assert topic == [(r["id"], r["topic"]) for r in rows]
    part = sorted((tmp_path / "out").glob("part-*.parquet"))[0]
    md = pq.read_schema(part).metadata
    assert md[b"batchrun.job"] == b"test-job" and b"max_tokens" in md[b"batchrun.sampling"]
    assert pq.ParquetFile(part).metadata.row_group(0).column(0).compression == "ZSTD"
    assert (tmp_path / "out" / "_SUCCESS").exists()
    assert len(list((tmp_path / "out" / "_batchrun" / "done").glob("*.json"))) == summary["units"]
    # resubmitting a finished job commits nothing new and rewrites nothing
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("part-*.parquet")}
    again = last_json(cli("submit", job, "--json", "--quiet", check=True).stdout)
    assert again["units_skipped"] == summary["units"] and again["units_committed"] == 0
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("part-*.parquet")} == mtimes


def test_input_order_gives_the_same_rows(job_model, tmp_path):
    rows = prompt_rows(300, seed=3)
    write_parquet_files(str(tmp_path / "in"), rows, files=2)
    a = write_job(str(tmp_path / "a.yaml"), job_model, str(tmp_path / "in"), str(tmp_path / "oa"), plan__order="length")
    b = write_job(str(tmp_path / "b.yaml"), job_model, str(tmp_path / "in"), str(tmp_path / "ob"), plan__order="input")
    cli("submit", a, "--quiet", check=True)
    cli("submit", b, "--quiet", check=True)
    assert results(str(tmp_path / "oa")) == results(str(tmp_path / "ob"))
