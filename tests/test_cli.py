"""The CLI: exit codes, bad inputs stopping before any weight loads, validate, query, status, demo."""
from __future__ import annotations

import csv
import io
import json
import os
import shutil

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchrun.cli import app
from batchrun.job.run import EXIT_BAD_JOB, EXIT_FINGERPRINT, EXIT_INPUT, EXIT_OK, JobRunner
from batchrun.tokenizer import Tokenizer
from test_job_common import counts, job_dict, tiny_model, write_job, write_prompt_files  # noqa: F401 - fixture


def invoke(*args):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def no_weights(monkeypatch):
    """Fail loudly if anything tries to build the engine (= load weights)."""
    def boom(self, tokenizer):
        raise AssertionError("weights were loaded")
    monkeypatch.setattr(JobRunner, "_default_engine", boom)


@pytest.fixture
def job_dir(tmp_path, tiny_model):  # noqa: F811
    write_prompt_files(str(tmp_path / "in"), 60, files=2, row_group_size=10)
    return tmp_path


def job_file(d, model, name="job.yaml", **sections):
    return write_job(str(d / name), job_dict(model, "in", "out", **sections))


# -- exit code 2: the job file -------------------------------------------------------------------
def test_unknown_key_exits_2_with_did_you_mean(job_dir, tiny_model, no_weights):  # noqa: F811
    job = job_file(job_dir, tiny_model, engine={"max_num_seq": 4})
    for cmd in ("submit", "validate"):
        r = invoke(cmd, job)
        assert r.exit_code == EXIT_BAD_JOB
        assert "engine.max_num_seq: unknown key, did you mean max_num_seqs?" in r.stderr
        assert "job.yaml" in r.stderr
    r = invoke("submit", job_file(job_dir, tiny_model), "--set", "sampling.max_token=3")
    assert r.exit_code == EXIT_BAD_JOB and "did you mean max_tokens?" in r.stderr


def test_json_failure_line(job_dir, tiny_model, no_weights):  # noqa: F811
    r = invoke("submit", job_file(job_dir, tiny_model, plan={"order": "random"}), "--json")
    assert r.exit_code == EXIT_BAD_JOB
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["state"] == "failed" and last["exit_code"] == EXIT_BAD_JOB and "plan.order" in last["error"]


def test_chat_without_a_chat_template_exits_2(job_dir, tiny_model, no_weights):  # noqa: F811
    model = str(job_dir / "model")
    shutil.copytree(tiny_model, model)
    cfg = json.load(open(os.path.join(model, "tokenizer_config.json")))
    cfg.pop("chat_template")
    json.dump(cfg, open(os.path.join(model, "tokenizer_config.json"), "w"))
    r = invoke("submit", job_file(job_dir, model, input={"chat": True}))
    assert r.exit_code == EXIT_BAD_JOB and "input.chat" in r.stderr and "no chat template" in r.stderr


# -- exit code 3: input or model, before any weight loads -------------------------------------------
def test_missing_column_names_column_and_file(job_dir, tiny_model, no_weights):  # noqa: F811
    r = invoke("submit", job_file(job_dir, tiny_model, input={"prompt_column": "txt"}))
    assert r.exit_code == EXIT_INPUT
    assert "input.prompt_column: column 'txt' not found in" in r.stderr and "prompts-00.parquet" in r.stderr
    assert "did you mean 'text'?" in r.stderr
    r = invoke("submit", job_file(job_dir, tiny_model, input={"passthrough": ["topik"]}))
    assert r.exit_code == EXIT_INPUT and "input.passthrough: column 'topik'" in r.stderr


def test_corrupt_file_names_the_file(job_dir, tiny_model, no_weights):  # noqa: F811
    p = job_dir / "in" / "prompts-01.parquet"
    p.write_bytes(p.read_bytes()[:-100])
    r = invoke("submit", job_file(job_dir, tiny_model))
    assert r.exit_code == EXIT_INPUT and "prompts-01.parquet: not a readable Parquet file" in r.stderr


def test_file_not_of_its_format(job_dir, tiny_model, no_weights):  # noqa: F811
    (job_dir / "in" / "notes.parquet").write_text("id,text\n1,hello\n")
    r = invoke("submit", job_file(job_dir, tiny_model))
    assert r.exit_code == EXIT_INPUT and "notes.parquet: not a readable Parquet file" in r.stderr
    os.remove(job_dir / "in" / "notes.parquet")
    r = invoke("submit", job_file(job_dir, tiny_model, input={"format": "jsonl", "uri": "in/prompts-00.parquet"}))
    assert r.exit_code == EXIT_INPUT and "prompts-00.parquet: line 1: not valid JSON" in r.stderr


def test_nonexistent_path(job_dir, tiny_model, no_weights):  # noqa: F811
    r = invoke("submit", job_file(job_dir, tiny_model, input={"uri": "no/such/dir"}))
    assert r.exit_code == EXIT_INPUT and "no/such/dir: no such file or directory" in r.stderr


def test_mixed_schemas_across_files(job_dir, tiny_model, no_weights):  # noqa: F811
    pq.write_table(pa.table({"id": ["x"], "text": ["t"], "topic": [1], "n_words": [1]}), job_dir / "in" / "z.parquet")
    r = invoke("validate", job_file(job_dir, tiny_model))
    assert r.exit_code == EXIT_INPUT and "z.parquet: schema differs" in r.stderr and "'topic'" in r.stderr


def test_unknown_architecture_and_missing_model(job_dir, tiny_model, no_weights):  # noqa: F811
    model = str(job_dir / "model")
    shutil.copytree(tiny_model, model)
    cfg = json.load(open(os.path.join(model, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(model, "config.json"), "w"))
    r = invoke("submit", job_file(job_dir, model))
    assert r.exit_code == EXIT_INPUT and "config.json" in r.stderr and "GPT2LMHeadModel" in r.stderr
    r = invoke("validate", job_file(job_dir, str(job_dir / "nope")))
    assert r.exit_code == EXIT_INPUT and "model.path" in r.stderr and "nope" in r.stderr


def test_non_string_prompt_column(job_dir, tiny_model, no_weights):  # noqa: F811
    r = invoke("submit", job_file(job_dir, tiny_model, input={"prompt_column": "n_words"}))
    assert r.exit_code == EXIT_INPUT and "'n_words'" in r.stderr and "not a string" in r.stderr


# -- exit code 4 and --restart ----------------------------------------------------------------------
def test_fingerprint_mismatch_refused_then_restart(job_dir, tiny_model):  # noqa: F811
    job = job_file(job_dir, tiny_model)
    assert invoke("submit", job, "--no-progress").exit_code == EXIT_OK
    changed = job_file(job_dir, tiny_model, "job2.yaml", sampling={"max_tokens": 3})
    r = invoke("submit", changed, "--no-progress", "--json")
    assert r.exit_code == EXIT_FINGERPRINT
    assert "sampling changed" in r.stderr and "--restart" in r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["exit_code"] == EXIT_FINGERPRINT
    out = str(job_dir / "out")
    assert duckdb.connect().execute(f"SELECT max(output_tokens) FROM read_parquet('{out}/*.parquet')").fetchone()[0] == 8
    r = invoke("submit", changed, "--no-progress", "--restart", "--json")
    assert r.exit_code == EXIT_OK, r.stderr
    assert counts(out) == (60, 60)
    assert duckdb.connect().execute(f"SELECT max(output_tokens) FROM read_parquet('{out}/*.parquet')").fetchone()[0] == 3
    # engine knobs are not part of the fingerprint: a tuned re-submit resumes (here: nothing left)
    r = invoke("submit", changed, "--no-progress", "--json", "--set", "engine.max_num_seqs=7")
    assert r.exit_code == EXIT_OK and json.loads(r.stdout.strip().splitlines()[-1])["units_committed"] == 0


# -- validate, query, status, demo ------------------------------------------------------------------
def test_validate_prints_the_plan_without_loading_weights(job_dir, tiny_model, no_weights):  # noqa: F811
    job = job_file(job_dir, tiny_model, plan={"unit_rows": 20, "window_units": 2})
    r = invoke("validate", job, "--json", "--sample", "40")
    assert r.exit_code == EXIT_OK, r.stderr
    rep = json.loads(r.stdout)
    # two files of 30 rows in 10-row groups: units of two groups, then one -> 4 units
    assert rep["input"]["files"] == 2 and rep["plan"]["rows"] == 60 and rep["plan"]["units"] == 4
    tok = Tokenizer.from_dir(tiny_model)
    texts = pq.read_table(job_dir / "in" / "prompts-00.parquet").column("text").to_pylist()[:30]
    texts += pq.read_table(job_dir / "in" / "prompts-01.parquet").column("text").to_pylist()[:10]
    lens = [len(tok.encode(t)) for t in texts]
    assert rep["sample"]["rows"] == 40
    assert rep["sample"]["prompt_tokens"]["max"] == max(lens) and rep["sample"]["prompt_tokens"]["min"] == min(lens)
    m = rep["memory_ledger"]
    cfg = json.load(open(os.path.join(tiny_model, "config.json")))
    assert m["kv_bytes_per_token"] == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert m["weights_bytes"] == os.path.getsize(os.path.join(tiny_model, "model.safetensors"))
    assert m["kv_tokens"] == (32 << 20) // m["kv_bytes_per_token"]
    assert rep["output"]["state"] == "new"
    text = invoke("validate", job).stdout
    assert "60 rows in 4 units" in text and "memory" in text and "max_model_len" in text


def test_query_status_and_no_results(job_dir, tiny_model):  # noqa: F811
    job = job_file(job_dir, tiny_model)
    out = str(job_dir / "out")
    r = invoke("query", out, "SELECT 1")
    assert r.exit_code == EXIT_INPUT and "no committed results yet" in r.stderr
    assert "not started" in invoke("status", out).stdout
    assert invoke("submit", job, "--no-progress").exit_code == EXIT_OK
    r = invoke("query", out, "SELECT count(*) AS n, count(DISTINCT id) AS d FROM results", "--format", "csv")
    assert r.exit_code == EXIT_OK and list(csv.reader(io.StringIO(r.stdout))) == [["n", "d"], ["60", "60"]]
    r = invoke("query", job, "SELECT id, topic FROM results ORDER BY id LIMIT 2", "--format", "json")
    assert [json.loads(x) for x in r.stdout.splitlines()] == [{"id": "r00000", "topic": "a"}, {"id": "r00001", "topic": "b"}]
    r = invoke("query", out, "SELECT finish_reason, count(*) FROM results GROUP BY 1")
    assert r.exit_code == EXIT_OK and "finish_reason" in r.stdout
    r = invoke("query", out, "SELEC nonsense")
    assert r.exit_code == EXIT_BAD_JOB and "query failed" in r.stderr
    st = json.loads(invoke("status", job, "--json").stdout)
    assert st["state"] == "finished" and st["rows_done"] == st["rows_total"] == 60


def test_status_of_a_killed_job_is_failed(job_dir, tiny_model):  # noqa: F811
    from batchrun.connectors import ParquetSink
    from batchrun.job.ledger import Ledger
    led = Ledger(ParquetSink(str(job_dir / "out")))
    led.open({"x": 1}, {"units_total": 2, "rows_total": 10, "job": "j"})
    led.write_progress({"state": "running", "pid": 2 ** 22 + 12345, "host": os.uname().nodename,
                        "updated_at": 0, "rows_per_s": 1.0})
    st = json.loads(invoke("status", str(job_dir / "out"), "--json").stdout)
    assert st["state"] == "failed" and "re-submit" in st["detail"]


def test_demo_then_submit(tmp_path):
    # the random model: the whole CLI path in seconds (the SmolLM2 demo runs in test_demo_real.py)
    r = invoke("demo", str(tmp_path / "demo"), "--model", "random")
    assert r.exit_code == EXIT_OK
    job = str(tmp_path / "demo" / "job.yaml")
    assert r.stdout.strip().splitlines()[-1] == f"batchrun submit {job}"
    r = invoke("submit", job, "--json", "--no-progress")
    assert r.exit_code == EXIT_OK, r.stderr
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["rows"] == 200 and s["error_rows"] == 0
    assert counts(str(tmp_path / "demo" / "out")) == (200, 200)
